#!/usr/bin/env bash
# A rank stopped (SIGSTOP) or killed (SIGKILL) in the middle of `moe-ep run --transport mpi` across
# pretend hosts. The victim is hit once its log (TRACE) shows its second combine, so the others
# wait for it, or for ranks that wait for it, in any phase. With --enable-recovery a rank that
# exits does not make the launcher end the others before they reported; the script ends the job
# by pid.
#  - stop: every other rank, on every host, gives up after MOE_EP_TIMEOUT_SECS (5 s here) and names
#    the stopped rank as the one at fault, also the ranks that waited for a live rank that waited
#    for it.
#  - kill: the timeout is 60 s and no rank may reach it: the victim's host mate sees its process
#    gone at once and its notice tells the ranks of the other host, so every other rank names the
#    killed rank as the one at fault, in a message that starts with its operation and does not say
#    it timed out; and no rank, as it leaves, gives up waiting for a live node peer's peer-read
#    section (it would wait up to the timeout, and its log says so).
# Usage: tool_failure_check.sh SET HOSTS PER_HOST VICTIM stop|kill MOE_EP [run arguments...]
set -uo pipefail
. "$(dirname "$0")/common.sh"
set_name=$1 hosts=$2 per_host=$3 victim=$4 mode=$5 tool=$6
shift 6
case "$mode" in
  stop) timeout=5 signal=STOP did=stopped report_secs=75 ;;
  kill) timeout=60 signal=KILL did=killed report_secs=120 ;;
  *) echo "FAIL: mode '$mode' is neither stop nor kill"; exit 1 ;;
esac
hosts_ready "$set_name"
ranks=$((hosts * per_host))
out=$(mktemp)
logs=$(mktemp -d)
marker="hosts-$mode-rank-$$"
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
kill -"$signal" "$pid"
# Every other rank reports (one line each), then the job is ended by pid.
for _ in $(seq $((10 * report_secs))); do
  (($(grep -c "^moe-ep: \[rank" "$out") >= ranks - 1)) && break
  sleep 0.1
done
end_job "$job"
cat "$out"
fail=0
# The operations of the run loop, which every message starts with.
operations="barrier|get_dispatch_layout|dispatch|combine|low_latency_dispatch|low_latency_combine"
for ((r = 0; r < ranks; ++r)); do
  ((r == victim)) && continue
  line=$(grep -E "^moe-ep: \[rank $r\] " "$out" | head -1)
  if [ -z "$line" ]; then echo "FAIL: rank $r reported nothing"; fail=1; continue; fi
  if [[ "$line" != *"(ranks at fault: [$victim])" ]]; then
    echo "FAIL: rank $r does not name rank $victim alone as the one at fault: $line"; fail=1
  fi
  if [ "$mode" = kill ]; then
    if ! grep -qE "^moe-ep: \[rank $r\] ($operations): " <<<"$line"; then
      echo "FAIL: rank $r's message does not start with the operation ($operations): $line"; fail=1
    fi
    if [[ "$line" == *"timed out"* ]]; then
      echo "FAIL: rank $r waited for its timeout instead of learning that rank $victim was killed: $line"; fail=1
    fi
  fi
done
# A rank that leaves waits for its node peers' peer-read sections to close; one that gives up
# waiting for a live peer (a section that held a wait on other ranks) warns, after the timeout.
if [ "$mode" = kill ]; then
  stuck=$(cat "$logs"/log.* 2>/dev/null | grep "still reads this rank's memory" | grep -v "rank $victim still reads")
  if [ -n "$stuck" ]; then
    echo "FAIL: a rank waited for a live node peer's peer-read section while it left the channel:"
    echo "$stuck"; fail=1
  fi
fi
if [ "$mode" = stop ]; then
  grep -q "(timeout $timeout s)" "$out" || { echo "FAIL: no rank timed out with MOE_EP_TIMEOUT_SECS ($timeout s)"; fail=1; }
fi
[ $fail -eq 0 ] && echo "PASS (rank $victim $did, $hosts hosts x $per_host)"
exit $fail
