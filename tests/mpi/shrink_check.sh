#!/usr/bin/env bash
# Runs tests/mpi/shrink_probe.cc under mpirun on 4 processes (ranks 1 and 2 are killed during the
# run) and checks that ranks 0 and 3 each said "OK", and that the job left nothing in its session
# directory (TMPDIR, where Open MPI's shared-memory segments go) or under moe-ep's names in /dev/shm.
# Usage: shrink_check.sh <mpiexec> <probe> [mpiexec flags...]
set -uo pipefail
mpiexec=$1 probe=$2
shift 2
session=$(mktemp -d)
trap 'rm -rf "$session"' EXIT
own_shm() { ls -A /dev/shm 2>/dev/null | grep -E '^(moe-ep|moe_ep)' | sort; }
before=$(own_shm)
# Open MPI ends the job when a rank dies unless told to let the others go on.
recovery=()
help=$("$mpiexec" --help all 2>/dev/null)
if [[ "$help" == *--enable-recovery* ]]; then recovery=(--enable-recovery); fi
output=$(TMPDIR=$session OMPI_MCA_btl_vader_backing_directory=$session \
         MOE_EP_TIMEOUT_SECS=${MOE_EP_TIMEOUT_SECS:-30} "$mpiexec" "${recovery[@]}" -np 4 "$@" "$probe" 2>&1)
status=$?
after=$(own_shm)
echo "$output"
echo "mpiexec exit status: $status"
fail=0
for r in 0 3; do
  line=$(grep -E "^rank $r: " <<<"$output" | head -1)
  if [[ "$line" != "rank $r: OK" ]]; then echo "FAIL: rank $r said '${line:-nothing}', expected 'rank $r: OK'"; fail=1; fi
done
for r in 1 2; do
  if grep -qE "^rank $r: " <<<"$output"; then echo "FAIL: rank $r reported although it was killed"; fail=1; fi
done
leaked=$(comm -13 <(echo "$before") <(echo "$after"))
if [ -n "$leaked" ]; then echo "FAIL: left in /dev/shm: $leaked"; fail=1; fi
left=$(find "$session" -mindepth 1 2>/dev/null | head -20)
if [ -n "$left" ]; then echo "FAIL: left in the session directory: $left"; fail=1; fi
[ $fail -eq 0 ] && echo "PASS"
exit $fail
