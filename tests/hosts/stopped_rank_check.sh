#!/usr/bin/env bash
# A rank stopped (SIGSTOP) in the middle of `moe-ep run --transport mpi` across pretend hosts: every
# other rank, on every host, gives up after MOE_EP_TIMEOUT_SECS and names the stopped rank as the
# one at fault, also the ranks that waited for a live rank that waited for it (the stopped rank is
# stopped inside the run loop, so the others wait for it, or for ranks that wait for it, in any
# phase). The victim is stopped once its log (TRACE) shows its second combine. With
# --enable-recovery, a rank that exits does not make the launcher end the others before they
# reported; the script ends the job by pid.
# Usage: stopped_rank_check.sh SET HOSTS PER_HOST VICTIM MOE_EP [run arguments...]
set -uo pipefail
. "$(dirname "$0")/common.sh"
set_name=$1 hosts=$2 per_host=$3 victim=$4 tool=$5
shift 5
hosts_ready "$set_name"
ranks=$((hosts * per_host))
timeout=5
out=$(mktemp)
logs=$(mktemp -d)
marker="hosts-stopped-rank-$$"
trap 'rm -rf "$out" "$logs"' EXIT
MOE_EP_TIMEOUT_SECS=$timeout MOE_EP_CHECK_MARKER=$marker MOE_EP_DEBUG=TRACE MOE_EP_DEBUG_SUBSYS=${MOE_EP_CHECK_SUBSYS:-COLL} \
  MOE_EP_DEBUG_FILE="$logs/log.%p" "$pretend_hosts" mpirun "$set_name" --enable-recovery -np "$ranks" \
  --host "$(host_list "$set_name" "$hosts" "$per_host")" --map-by slot \
  "$tool" run --transport mpi --iters 1000000 "$@" >"$out" 2>&1 &
job=$!
trap 'end_job $job; [ -n "${MOE_EP_CHECK_KEEP:-}" ] && cp -r "$logs" "$MOE_EP_CHECK_KEEP"; rm -rf "$out" "$logs"' EXIT
pid=""
for _ in $(seq 600); do
  for p in $(pgrep -x moe-ep); do
    env=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null)
    if grep -qx "MOE_EP_CHECK_MARKER=$marker" <<<"$env" && grep -qx "OMPI_COMM_WORLD_RANK=$victim" <<<"$env"; then pid=$p; fi
  done
  [ -n "$pid" ] && break
  sleep 0.1
done
[ -n "$pid" ] || { echo "FAIL: rank $victim of the job was not found"; cat "$out"; exit 1; }
for _ in $(seq 3000); do
  [ "$(grep -c "combine: submitted" "$logs/log.$pid" 2>/dev/null || true)" -ge 2 ] 2>/dev/null && break
  sleep 0.1
done
if [ "$(grep -c "combine: submitted" "$logs/log.$pid" 2>/dev/null || echo 0)" -lt 2 ]; then
  echo "FAIL: rank $victim did not reach its second combine within 300 s"; cat "$out"; exit 1
fi
kill -STOP "$pid"
# Every other rank reports (one line each), then the job is ended by pid.
for _ in $(seq $((10 * (3 * timeout + 60)))); do
  (($(grep -c "^moe-ep: \[rank" "$out") >= ranks - 1)) && break
  sleep 0.1
done
end_job "$job"
cat "$out"
fail=0
for ((r = 0; r < ranks; ++r)); do
  ((r == victim)) && continue
  line=$(grep -E "^moe-ep: \[rank $r\] " "$out" | head -1)
  if [ -z "$line" ]; then echo "FAIL: rank $r reported nothing"; fail=1; continue; fi
  if [[ "$line" != *"(ranks at fault: [$victim])" ]]; then
    echo "FAIL: rank $r does not name rank $victim alone as the one at fault: $line"; fail=1
  fi
done
grep -q "(timeout $timeout s)" "$out" || { echo "FAIL: no rank timed out with MOE_EP_TIMEOUT_SECS ($timeout s)"; fail=1; }
[ $fail -eq 0 ] && echo "PASS (rank $victim stopped, $hosts hosts x $per_host)"
exit $fail
