#!/usr/bin/env bash
# A rank that fails on one pretend host (tests/mpi/failure_probe.cc: killed, stopped, gone without a
# word, or never arriving at a call): every other rank, on every host, must fail with a PeerError
# or TimeoutError that names the victim, and soon: within one timeout of the failure, never after a
# second one. Each survivor's delay (its error's time minus the victim's time of failure) is
# printed; the check allows half a timeout of scheduling beyond the timeout itself (a second wait
# of a full timeout, the fault this guards against, is well beyond it).
# Usage: failure_check.sh SET HOSTS PER_HOST MODE VICTIM PROBE      (MOE_EP_TIMEOUT_SECS: the timeout)
set -uo pipefail
. "$(dirname "$0")/common.sh"
set_name=$1 hosts=$2 per_host=$3 mode=$4 victim=$5 probe=$6
hosts_ready "$set_name"
ranks=$((hosts * per_host))
timeout=${MOE_EP_TIMEOUT_SECS:-6}
reports=$(mktemp -d)
out=$(mktemp)
trap 'rm -rf "$reports" "$out"' EXIT
MOE_EP_TIMEOUT_SECS=$timeout MOE_EP_PROBE_REPORTS=$reports MOE_EP_PROBE_VICTIM=$victim \
  "$pretend_hosts" mpirun "$set_name" --enable-recovery -np "$ranks" \
  --host "$(host_list "$set_name" "$hosts" "$per_host")" --map-by slot "$probe" "$mode" >"$out" 2>&1 &
job=$!
trap 'end_job $job; rm -rf "$reports" "$out"' EXIT
# Every survivor leaves a file once it reported; then the job is ended by pid (the launcher of a
# job with a dead rank does not exit by itself).
deadline=$((SECONDS + 3 * timeout + 60))
while ((SECONDS < deadline)); do
  n=$(find "$reports" -name 'rank-*' | wc -l)
  ((n >= ranks - 1)) && break
  running "$job" || break
  sleep 0.1
done
end_job "$job"
cat "$out"
fail=0
victim_time=$(cat "$reports/victim" 2>/dev/null)
[ -n "$victim_time" ] || { echo "FAIL: the victim (rank $victim) did not reach its failure"; exit 1; }
for ((r = 0; r < ranks; ++r)); do
  ((r == victim)) && continue
  line=$(grep -E "^rank $r: " "$out" | head -1)
  if [[ "$line" != "rank $r: ERROR at "* ]]; then
    echo "FAIL: rank $r said '${line:-nothing}', expected an error naming rank $victim"; fail=1; continue
  fi
  named=$(grep -oE "(PeerError|TimeoutError) naming \[[0-9, ]*\]" <<<"$line" | head -1)
  if [[ "$named" != *"naming [$victim]" ]]; then
    echo "FAIL: rank $r's error is '${named:-not a PeerError}', expected one naming [$victim] alone: $line"; fail=1
  fi
  at=$(sed -E 's/^rank [0-9]+: ERROR at ([0-9.]+) .*/\1/' <<<"$line")
  delay=$(awk -v a="$at" -v v="$victim_time" 'BEGIN { printf "%.2f", a - v }')
  echo "rank $r failed $delay s after the victim (timeout $timeout s)"
  if ! awk -v d="$delay" -v t="$timeout" 'BEGIN { exit !(d <= 1.5 * t) }'; then
    echo "FAIL: rank $r failed $delay s after the victim: more than the timeout ($timeout s) and half another"; fail=1
  fi
done
[ $fail -eq 0 ] && echo "PASS ($mode, victim rank $victim, $hosts hosts x $per_host)"
exit $fail
