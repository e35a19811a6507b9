#!/usr/bin/env bash
# The progress line of a long command: on a terminal's stderr (a pseudo-terminal made by
# util-linux `script`), none with --quiet, none when stderr is not a terminal, never on stdout.
# Usage: progress_check.sh MOE_EP MODE REGEX -- ARGS...
#   MODE tty:   under a pseudo-terminal, the output must contain REGEX after a carriage return
#   MODE quiet: under a pseudo-terminal with --quiet added, no REGEX and no carriage return
#   MODE pipe:  stdout and stderr are files: stderr empty, no REGEX and no carriage return in either
# The command must succeed in every mode.
set -uo pipefail
moe_ep=$1 mode=$2 regex=$3
shift 3
[ "${1:-}" = "--" ] || { echo "usage: progress_check.sh MOE_EP MODE REGEX -- ARGS..."; exit 2; }
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
command -v script >/dev/null || { echo "FAIL: util-linux script is not installed"; exit 1; }
quoted=$(printf '%q ' "$moe_ep" "$@")
fail=0
# The captured terminal output as lines: every rewrite of the line on a line of its own.
lines() { tr '\r' '\n' <"$1" | sed $'s/\e\\[K//g'; }
case "$mode" in
  tty|quiet)
    [ "$mode" = quiet ] && quoted+="--quiet"
    script -qec "$quoted" /dev/null >"$dir/tty" </dev/null
    status=$?
    echo "script -qec \"$quoted\": exit status $status"
    lines "$dir/tty" | tail -n 40
    [ "$status" -eq 0 ] || { echo "FAIL: exit status $status"; fail=1; }
    if [ "$mode" = tty ]; then
      lines "$dir/tty" | grep -Eq -- "$regex" || { echo "FAIL: no progress line /$regex/"; fail=1; }
      grep -q $'\r\e\[K' "$dir/tty" || { echo "FAIL: the line is not rewritten in place"; fail=1; }
    else
      ! lines "$dir/tty" | grep -Eq -- "$regex" || { echo "FAIL: progress with --quiet"; fail=1; }
      ! grep -q $'\e\[K' "$dir/tty" || { echo "FAIL: progress with --quiet"; fail=1; }
    fi
    ;;
  pipe)
    "$moe_ep" "$@" >"$dir/out" 2>"$dir/err" </dev/null
    status=$?
    echo "exit status $status"; cat "$dir/err"
    [ "$status" -eq 0 ] || { echo "FAIL: exit status $status"; fail=1; }
    [ ! -s "$dir/err" ] || { echo "FAIL: stderr is not empty when it is not a terminal"; fail=1; }
    ! grep -Eq -- "$regex" "$dir/out" "$dir/err" || { echo "FAIL: progress in a file"; fail=1; }
    ! grep -q $'\r' "$dir/out" "$dir/err" || { echo "FAIL: a carriage return in a file"; fail=1; }
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
[ $fail -eq 0 ] && echo PASS
exit $fail
