#!/usr/bin/env bash
# One command line of moe-ep against its expected exit status and messages.
# Usage: cli_check.sh MOE_EP RC STDERR_REGEX [STDOUT_REGEX] -- ARGS...
# RC != 0 (a usage error): stderr must be exactly one line, matching STDERR_REGEX (grep -E), and
# stdout empty. RC = 0: STDERR_REGEX '-' means stderr must be empty, anything else must match
# exactly one line of it; STDOUT_REGEX, when given, must match a line of stdout.
# CLI_CHECK_LAUNCHER, when set, starts moe-ep (e.g. "mpiexec -np 2").
set -uo pipefail
moe_ep=$1 rc=$2 err_regex=$3
shift 3
out_regex=""
if [ "${1:-}" != "--" ]; then out_regex=$1; shift; fi
[ "${1:-}" = "--" ] || { echo "usage: cli_check.sh MOE_EP RC STDERR_REGEX [STDOUT_REGEX] -- ARGS..."; exit 2; }
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
read -r -a launcher <<<"${CLI_CHECK_LAUNCHER:-}"
"${launcher[@]}" "$moe_ep" "$@" >"$dir/out" 2>"$dir/err" </dev/null
status=$?
echo "command: ${launcher[*]} $moe_ep $*"
echo "exit status: $status (expected $rc)"
echo "--- stderr:"; cat "$dir/err"
echo "--- stdout:"; head -c 4000 "$dir/out"
fail=0
[ "$status" -eq "$rc" ] || { echo "FAIL: exit status $status, expected $rc"; fail=1; }
lines=$(wc -l <"$dir/err")
if [ "$rc" -ne 0 ]; then
  [ "$lines" -eq 1 ] && [ "$(tail -c 1 "$dir/err" | od -An -c | tr -d ' ')" = '\n' ] ||
    { echo "FAIL: stderr has $lines line(s), expected exactly one"; fail=1; }
  [ ! -s "$dir/out" ] || { echo "FAIL: stdout is not empty"; fail=1; }
  grep -Eq -- "$err_regex" "$dir/err" || { echo "FAIL: stderr does not match /$err_regex/"; fail=1; }
elif [ "$err_regex" = "-" ]; then
  [ ! -s "$dir/err" ] || { echo "FAIL: stderr is not empty"; fail=1; }
else
  matches=$(grep -Ec -- "$err_regex" "$dir/err")
  [ "$matches" -eq 1 ] || { echo "FAIL: $matches stderr line(s) match /$err_regex/, expected one"; fail=1; }
fi
if [ -n "$out_regex" ]; then
  grep -Eq -- "$out_regex" "$dir/out" || { echo "FAIL: stdout does not match /$out_regex/"; fail=1; }
fi
[ $fail -eq 0 ] && echo PASS
exit $fail
