#!/usr/bin/env bash
# A rank that stops (SIGSTOP) in the middle of `moe-ep run --transport mpi`: the other ranks give up
# after MOE_EP_TIMEOUT_SECS (not the buffers' own default of minutes) and name it. Rank 1 is stopped
# once its log (TRACE, one line per operation) shows its second combine: it is past the buffer's
# construction and inside the run loop, however slowly the machine runs.
# Usage: stopped_rank_check.sh <mpiexec> <moe-ep> <api: v1|v2> [mpiexec flags...]
set -uo pipefail
mpiexec=$1 tool=$2 api=$3
shift 3
out=$(mktemp)
logs=$(mktemp -d)
marker="stopped-rank-check-$$"
trap 'rm -rf "$out" "$logs"' EXIT
MOE_EP_TIMEOUT_SECS=5 MOE_EP_CHECK_MARKER=$marker MOE_EP_DEBUG=TRACE MOE_EP_DEBUG_SUBSYS=COLL \
  MOE_EP_DEBUG_FILE="$logs/log.%p" "$mpiexec" -np 4 "$@" \
  "$tool" run --transport mpi --api "$api" --tokens 32 --hidden 256 --iters 1000000 >"$out" 2>&1 &
job=$!
# Rank 1 of this job (its environment carries the marker).
pid=""
for _ in $(seq 600); do
  for p in $(pgrep -x moe-ep); do
    env=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null)
    if grep -qx "MOE_EP_CHECK_MARKER=$marker" <<<"$env" && grep -qx "OMPI_COMM_WORLD_RANK=1" <<<"$env"; then pid=$p; fi
  done
  [ -n "$pid" ] && break
  sleep 0.1
done
if [ -z "$pid" ]; then echo "FAIL: rank 1 of the job was not found"; cat "$out"; kill "$job" 2>/dev/null; exit 1; fi
# Well inside the run (a million iterations): rank 1 has submitted its second combine.
for _ in $(seq 3000); do
  [ "$(grep -c "combine: submitted" "$logs/log.$pid" 2>/dev/null)" -ge 2 ] && break
  sleep 0.1
done
if [ "$(grep -c "combine: submitted" "$logs/log.$pid" 2>/dev/null)" -lt 2 ]; then
  echo "FAIL: rank 1 did not reach its second combine within 300 s"; cat "$out"; kill "$job" 2>/dev/null; exit 1
fi
kill -STOP "$pid"
# The others report within the timeout; then the stopped rank is released so the job can end.
for _ in $(seq 1200); do
  grep -q "^moe-ep: " "$out" && break
  sleep 0.1
done
kill -KILL "$pid" 2>/dev/null
wait "$job"
status=$?
cat "$out"
echo "mpiexec exit status: $status"
fail=0
if ! grep -q "(timeout 5 s)" "$out"; then echo "FAIL: no rank timed out with MOE_EP_TIMEOUT_SECS (5 s)"; fail=1; fi
if ! grep -E "^moe-ep: .*(ranks|rank) \[([0-9]+, )*1(, [0-9]+)*\]" "$out" >/dev/null; then
  echo "FAIL: no error names rank 1"; fail=1
fi
[ "$status" -ne 0 ] || { echo "FAIL: the job exited with status 0"; fail=1; }
[ $fail -eq 0 ] && echo PASS
exit $fail
