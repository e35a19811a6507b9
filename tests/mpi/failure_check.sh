#!/usr/bin/env bash
# Runs tests/mpi/failure_probe.cc under mpirun and checks what the surviving ranks said, and that
# nothing the job created is left in its session directory (TMPDIR, where Open MPI's shared-memory
# segments are put too) or, under moe-ep's names, in /dev/shm. Only the job's own names are
# checked, so the check holds while other tests run beside it.
# Usage: failure_check.sh <mpiexec> <probe> <mode: normal|kill|absent> <ranks> [mpiexec flags...]
set -uo pipefail
mpiexec=$1 probe=$2 mode=$3 ranks=$4
shift 4
session=$(mktemp -d)
reports=$(mktemp -d)  # the probe's ranks leave a file here once they have reported
trap 'rm -rf "$session" "$reports"' EXIT
own_shm() { ls -A /dev/shm 2>/dev/null | grep -E '^(moe-ep|moe_ep)' | sort; }
before=$(own_shm)
# A rank that dies must not take the job down before the others have reported: Open MPI needs
# --enable-recovery for that. The help text is read whole (grep -q on a pipe could end mpiexec
# with SIGPIPE, which pipefail would turn into "not supported").
recovery=()
if [ "$mode" != normal ]; then
  help=$("$mpiexec" --help all 2>/dev/null)
  if [[ "$help" == *--enable-recovery* ]]; then recovery=(--enable-recovery); fi
fi
output=$(TMPDIR=$session OMPI_MCA_btl_vader_backing_directory=$session MOE_EP_PROBE_REPORTS=$reports \
         MOE_EP_TIMEOUT_SECS=${MOE_EP_TIMEOUT_SECS:-10} "$mpiexec" "${recovery[@]}" -np "$ranks" "$@" "$probe" "$mode" 2>&1)
status=$?
after=$(own_shm)
echo "$output"
echo "mpiexec exit status: $status"
fail=0
for ((r = 0; r < ranks; ++r)); do
  line=$(grep -E "^rank $r: " <<<"$output" | head -1)
  case "$mode" in
    normal) expected="rank $r: OK" ;;
    *) if [ "$r" -eq 1 ]; then continue; fi
       expected="rank $r: ERROR" ;;
  esac
  if [[ "$line" != "$expected"* ]]; then echo "FAIL: rank $r said '${line:-nothing}', expected '$expected...'"; fail=1; continue; fi
  if [ "$mode" != normal ] && ! grep -qE "ranks \[([0-9]+, )*1(, [0-9]+)*\]" <<<"$line"; then
    echo "FAIL: rank $r's error does not name rank 1: $line"; fail=1
  fi
done
if [ "$mode" = normal ] && [ "$status" -ne 0 ]; then echo "FAIL: the clean job exited with $status"; fail=1; fi
leaked=$(comm -13 <(echo "$before") <(echo "$after"))
if [ -n "$leaked" ]; then echo "FAIL: left in /dev/shm: $leaked"; fail=1; fi
left=$(find "$session" -mindepth 1 2>/dev/null | head -20)
if [ -n "$left" ]; then echo "FAIL: left in the session directory: $left"; fail=1; fi
[ $fail -eq 0 ] && echo "PASS ($mode)"
exit $fail
