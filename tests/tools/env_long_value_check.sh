#!/usr/bin/env bash
# `moe-ep env` with a value longer than a line (MOE_EP_PROVIDER_PATH of 30 libraries): with
# stdout not a terminal every line fits 100 columns, the table shows the value cut short, and
# the value appears whole (wrapped) under the variable's description.
# Usage: env_long_value_check.sh MOE_EP
set -euo pipefail
moe_ep=$1
value=$(for i in $(seq 10 39); do printf '/opt/moe-ep/providers/lib%s.so:' "$i"; done)cpu
out=$(MOE_EP_PROVIDER_PATH="$value" "$moe_ep" env)
fail() {
  echo "env_long_value_check: $*" >&2
  echo "$out" >&2
  exit 1
}
long=$(echo "$out" | awk 'length($0) > 100' | head -1)
[ -z "$long" ] || fail "a line is longer than 100 columns: $long"
echo "$out" | grep -Eq '^MOE_EP_PROVIDER_PATH +string +/opt/moe-ep/provid[^ ]*\.\.\. +environment$' ||
  fail "the table row does not show the value cut short"
# The lines of "  value: ..." and their continuations, joined, give the value back.
whole=$(echo "$out" | awk '/^  value: /{on=1; sub(/^  value: /, ""); printf "%s", $0; next}
                           on && /^    /{sub(/^ +/, ""); printf "%s", $0; next} {on=0}')
[ "$whole" = "$value" ] || fail "the value below the table is not whole: $whole"
