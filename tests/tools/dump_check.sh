#!/usr/bin/env bash
# Runs `moe-ep run --dump` and checks the dump with the independent numpy checker.
# Usage: dump_check.sh MOE_EP CHECKER [run options...]
# DUMP_CHECK_LAUNCHER, when set, starts moe-ep (e.g. "mpiexec -np 4" with --transport mpi).
set -euo pipefail
moe_ep=$1 checker=$2
shift 2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
read -r -a launcher <<<"${DUMP_CHECK_LAUNCHER:-}"
"${launcher[@]}" "$moe_ep" run "$@" --dump "$dir" >/dev/null
python=/usr/bin/python3
[ -x "$python" ] || python=python3
"$python" "$checker" "$dir"
