#!/usr/bin/env bash
# `moe-ep env` and the commands judge an environment value alike: with NAME=VALUE, `moe-ep env`
# marks the variable (invalid) and says why (wrapped under its description), and `moe-ep run`
# refuses to start (exit 2) with the very same message on its one line of stderr, which must
# contain EXPECTED.
# Usage: env_invalid_check.sh MOE_EP NAME VALUE EXPECTED
set -uo pipefail
moe_ep=$1 name=$2 value=$3 expected=$4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() {
  echo "env_invalid_check: $*"
  exit 1
}
env "$name=$value" "$moe_ep" env >"$dir/env" 2>&1 || fail "moe-ep env exited $?"
env "$name=$value" "$moe_ep" run --ranks 2 --experts 4 --topk 2 --tokens 8 --hidden 128 --iters 1 \
  >"$dir/out" 2>"$dir/err" </dev/null
status=$?
echo "--- moe-ep env:"; cat "$dir/env"
echo "--- moe-ep run (exit $status), stderr:"; cat "$dir/err"
grep -Eq "^$name +[a-z]+ +[^ ]* +\(invalid\) +environment$" "$dir/env" || fail "the table does not mark $name invalid"
# The lines of "  invalid: ..." and their continuations, joined at the spaces they were wrapped at.
said=$(awk '/^  invalid: /{on=1; sub(/^  invalid: /, ""); printf "%s", $0; next}
            on && /^    /{sub(/^ +/, " "); printf "%s", $0; next} {on=0}' "$dir/env")
[ -n "$said" ] || fail "moe-ep env gives no reason"
[ "$status" -eq 2 ] || fail "moe-ep run exited $status, expected 2"
[ "$(wc -l <"$dir/err")" -eq 1 ] || fail "moe-ep run's stderr is not one line"
[ "$(cat "$dir/err")" = "moe-ep: $said" ] || fail "moe-ep env says '$said', moe-ep run '$(cat "$dir/err")'"
case "$said" in
  *"$expected"*) ;;
  *) fail "the reason does not contain '$expected'" ;;
esac
echo PASS
