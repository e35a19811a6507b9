# What the multi-host test scripts share (sourced): the pretend hosts of a set (scripts/pretend-hosts.sh),
# a job started across them, and ending a job by the pids of everything it started.
#
# A test whose hosts cannot be made here (not root, no `ip`/`unshare`/`nsenter`) exits with 77,
# which CTest reports as skipped, after printing the reason; it never passes without running.
pretend_hosts=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/pretend-hosts.sh
skip_code=77

# hosts_ready SET: exits the script (skipped) when namespaces cannot be made here, or (failed)
# when the set's fixture did not bring it up.
hosts_ready() {
  local reason
  if ! reason=$("$pretend_hosts" check); then
    echo "SKIPPED: $reason"
    exit "$skip_code"
  fi
  if [ ! -e "/run/moe-ep-hosts/$1/count" ]; then
    echo "FAIL: the pretend hosts of set '$1' are not up (its fixture, hosts.up_$1, failed?)"
    exit 1
  fi
}

# host_list SET HOSTS PER_HOST: Open MPI's --host list, PER_HOST slots on each of the first HOSTS hosts.
host_list() {
  local list="" k
  for ((k = 0; k < $2; ++k)); do list+="${list:+,}moeep-$1-h$k:$3"; done
  echo "$list"
}

# descendants PID: every process below PID (ppid chains read from /proc).
descendants() {
  local parent=$1 child
  for child in $(ps -o pid= --ppid "$parent" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}

# end_job PID: SIGKILL to everything PID started (the launcher, its agents, the remote daemons and
# every rank on every host): Open MPI 4.1 with --enable-recovery does not exit its launcher after a
# remote rank died, so a test ends what it started itself, by pid. PID itself, `pretend-hosts.sh
# mpirun`, then removes the job's folder (Open MPI's segments, which killed processes never
# unlink) and exits; it is killed too if it has not exited within 10 s.
end_job() {
  local pids
  pids=$(descendants "$1")
  # shellcheck disable=SC2086
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 100); do
    running "$1" || break
    sleep 0.1
  done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# running PID: PID has not exited (a zombie child counts as exited).
running() {
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ "$state" != Z* ]]
}

# wait_job PID LIMIT: the job's exit status; a job still running after LIMIT seconds is ended
# (status 124).
wait_job() {
  local job=$1 deadline=$((SECONDS + $2))
  while running "$job"; do
    if ((SECONDS >= deadline)); then
      echo "FAIL: the job ran past $2 s; ending it" >&2
      end_job "$job"
      return 124
    fi
    sleep 0.1
  done
  wait "$job"
}
