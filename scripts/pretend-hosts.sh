#!/usr/bin/env bash
# Pretend hosts: two to four hosts on this machine, made of Linux namespaces, that Open MPI sees as
# separate machines (their own network, hostname and /etc/hosts; TCP between them).
#
#   pretend-hosts.sh up SET N        creates the set SET of N hosts (2..4); prints its folder
#   pretend-hosts.sh down SET        removes everything the set made (processes, namespaces, files)
#   pretend-hosts.sh exec SET K CMD  runs CMD on host K (0-based) of SET
#   pretend-hosts.sh mpirun SET ARGS runs `mpirun ARGS` on host 0, launching into the others
#   pretend-hosts.sh check           exit 0 if namespaces can be made here, else 77 and the reason
#   pretend-hosts.sh agent DIR HOST CMD...  Open MPI's launcher agent (plm_rsh_agent): runs CMD on HOST
#
# Each host is a network namespace `moeep-SET-hK` joined by a veth pair to a bridge in the
# namespace `moeep-SET-br`, with the address 10.213.0.(K+1)/24 (a private range that exists only
# inside these namespaces: the machine's own interfaces and routes are never touched), loopback
# up; a UTS namespace with the hostname `moeep-SET-hK` (bound to a file in the set's folder); and
# a view of /etc/hosts that names every host of the set (bind-mounted over /etc/hosts in a mount
# namespace of each command run there). Open MPI launches into a host through this script's agent
# instead of ssh, and is told to use only the set's network for its own traffic and for TCP.
#
# Each job that `mpirun` starts keeps Open MPI's files (its session directory and its shared-memory
# segments) in a folder of its own, /dev/shm/moeep-SET/job.XXXXXX, which `mpirun` removes once the
# launcher is gone, however it ended: a job killed by pid (SIGKILL never lets Open MPI unlink its
# segments) leaves nothing once the launcher's processes are dead.
#
# `up` first removes what an earlier, interrupted run of the same SET left behind. `down` kills
# every process still in the set's namespaces and removes the set's folders. Needs root, `ip`
# (iproute2), `unshare`, `nsenter`; `check` says which is missing. SET: letters, digits and '-', at
# most 20 characters.
set -euo pipefail

prefix=moeep
run_root=/run/moe-ep-hosts
subnet=10.213.0
self=$(readlink -f "$0")

die() { echo "pretend-hosts: $*" >&2; exit 1; }

# check: can namespaces be made here? Exit 77 (CTest's skip code) with the reason.
check() {
  [ "$(id -u)" -eq 0 ] || { echo "pretend-hosts: not root (namespaces and veth pairs need root)"; return 77; }
  local tool
  for tool in ip unshare nsenter mount; do
    command -v "$tool" >/dev/null 2>&1 || { echo "pretend-hosts: '$tool' is not installed"; return 77; }
  done
  local probe="${prefix}-probe-$$"
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "pretend-hosts: cannot create a network namespace: $err"
    return 77
  fi
  ip netns del "$probe" >/dev/null 2>&1 || true
  if ! err=$(unshare --uts --mount true 2>&1); then
    echo "pretend-hosts: cannot create UTS and mount namespaces: $err"
    return 77
  fi
  return 0
}

valid_set() {
  [[ "$1" =~ ^[A-Za-z0-9-]{1,20}$ ]] || die "set name '$1' must be 1 to 20 letters, digits or '-'"
}

host_name() { echo "${prefix}-$1-h$2"; }

# The folder of the set's jobs' Open MPI files (memory, like Open MPI's own default).
jobs_root() { echo "/dev/shm/${prefix}-$1"; }

down() {
  local set=$1 dir="$run_root/$1" ns
  valid_set "$set"
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}-${set}-(h[0-9]+|br)$" || true); do
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  done
  # Processes that were killed must be reaped before their namespace's addresses go away.
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}-${set}-(h[0-9]+|br)$" || true); do
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break; sleep 0.1; done
    ip netns del "$ns" 2>/dev/null || true
  done
  if [ -d "$dir" ]; then
    local uts
    for uts in "$dir"/h*.uts; do
      [ -e "$uts" ] || continue
      umount "$uts" 2>/dev/null || true
    done
    rm -rf "$dir"
  fi
  rm -rf "$(jobs_root "$set")"
}

up() {
  local set=$1 count=$2 dir="$run_root/$1" k
  valid_set "$set"
  [[ "$count" =~ ^[2-4]$ ]] || die "the number of hosts must be 2, 3 or 4 (got '$count')"
  local reason
  if ! reason=$(check); then die "${reason#pretend-hosts: }"; fi
  down "$set"  # what an interrupted run left
  mkdir -p "$dir" "$(jobs_root "$set")"
  chmod 0700 "$dir" "$(jobs_root "$set")"
  echo "$count" >"$dir/count"
  local bridge="${prefix}-${set}-br"
  ip netns add "$bridge"
  ip -n "$bridge" link add br0 type bridge
  ip -n "$bridge" link set br0 up
  ip -n "$bridge" link set lo up
  {
    echo "127.0.0.1 localhost"
    for ((k = 0; k < count; ++k)); do echo "$subnet.$((k + 1)) $(host_name "$set" "$k")"; done
  } >"$dir/hosts"
  for ((k = 0; k < count; ++k)); do
    local name ns
    name=$(host_name "$set" "$k")
    ns=$name
    ip netns add "$ns"
    ip link add eth0 netns "$ns" type veth peer name "p$k" netns "$bridge"
    ip -n "$ns" addr add "$subnet.$((k + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "$bridge" link set "p$k" master br0
    ip -n "$bridge" link set "p$k" up
    touch "$dir/h$k.uts"
    unshare --uts="$dir/h$k.uts" hostname "$name"
  done
  # The agent Open MPI runs instead of ssh (plm_rsh_agent takes a program).
  cat >"$dir/agent" <<EOF
#!/bin/sh
exec "$self" agent "$dir" "\$@"
EOF
  chmod 0755 "$dir/agent"
  for ((k = 0; k < count; ++k)); do echo "$(host_name "$set" "$k")" >>"$dir/hostnames"; done
  echo "$dir"
}

# run_on DIR K CMD...: CMD in host K's network and UTS namespaces, with the set's /etc/hosts.
run_on() {
  local dir=$1 k=$2
  shift 2
  local set
  set=$(basename "$dir")
  [ -e "$dir/h$k.uts" ] || die "set '$set' has no host $k (is it up?)"
  exec nsenter --net="/run/netns/$(host_name "$set" "$k")" --uts="$dir/h$k.uts" -- \
    unshare --mount --propagation private -- /bin/sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$dir/hosts" "$@"
}

agent() {
  local dir=$1 host=$2
  shift 2
  local set k count
  set=$(basename "$dir")
  count=$(cat "$dir/count")
  for ((k = 0; k < count; ++k)); do
    if [ "$host" = "$(host_name "$set" "$k")" ]; then
      # Open MPI passes the remote command as words for a remote shell to join and run.
      run_on "$dir" "$k" /bin/sh -c "$*"
    fi
  done
  die "agent: '$host' is not a host of set '$set'"
}

# mpirun SET ARGS...: mpirun on host 0; the hostfile names every host of the set. Open MPI's files
# go to the job's own folder, removed when mpirun has exited or was killed; INT, TERM and HUP are
# passed on to mpirun. Exits with mpirun's status.
mpirun_on() {
  local set=$1 dir="$run_root/$1"
  shift
  [ -d "$dir" ] || die "set '$set' is not up"
  local job launcher status=0
  mkdir -p "$(jobs_root "$set")"
  job=$(mktemp -d "$(jobs_root "$set")/job.XXXXXX")
  # Explicit stdin: an asynchronous command would otherwise read /dev/null.
  (run_on "$dir" 0 mpirun --mca plm_rsh_agent "$dir/agent" --mca orte_launch_agent orted \
    --mca oob_tcp_if_include "$subnet.0/24" --mca btl_tcp_if_include "$subnet.0/24" \
    --mca orte_tmpdir_base "$job" --mca btl_vader_backing_directory "$job" "$@") <&0 &
  launcher=$!
  trap 'kill -TERM "$launcher" 2>/dev/null' INT TERM HUP
  # A trapped signal ends `wait` early: wait again until mpirun itself is gone.
  while :; do
    status=0
    wait "$launcher" 2>/dev/null || status=$?
    kill -0 "$launcher" 2>/dev/null || break
  done
  rm -rf "$job"
  exit "$status"
}

command=${1:-}
case "$command" in
  check) check ;;
  up) [ $# -eq 3 ] || die "usage: up SET N"; up "$2" "$3" ;;
  down) [ $# -eq 2 ] || die "usage: down SET"; down "$2" ;;
  exec) [ $# -ge 4 ] || die "usage: exec SET K CMD..."; valid_set "$2"; run_on "$run_root/$2" "$3" "${@:4}" ;;
  mpirun) [ $# -ge 2 ] || die "usage: mpirun SET ARGS..."; valid_set "$2"; mpirun_on "$2" "${@:3}" ;;
  agent) [ $# -ge 4 ] || die "usage: agent DIR HOST CMD..."; agent "$2" "$3" "${@:4}" ;;
  *) die "usage: pretend-hosts.sh check | up SET N | down SET | exec SET K CMD... | mpirun SET ARGS..." ;;
esac
