#!/usr/bin/env bash
# Runs a program as an MPI job across pretend hosts and exits with its status (77: skipped, the
# hosts cannot be made here). PER_HOST ranks on each of the first HOSTS hosts of SET, consecutive
# ranks per host. The job is ended by pid if it outlives TIMEOUT seconds.
# Usage: run_on_hosts.sh SET HOSTS PER_HOST TIMEOUT PROGRAM [ARGS...]
set -uo pipefail
. "$(dirname "$0")/common.sh"
set_name=$1 hosts=$2 per_host=$3 limit=$4
shift 4
hosts_ready "$set_name"
"$pretend_hosts" mpirun "$set_name" -np $((hosts * per_host)) --host "$(host_list "$set_name" "$hosts" "$per_host")" \
  --map-by slot "$@" &
job=$!
trap 'end_job $job' INT TERM
wait_job "$job" "$limit"
status=$?
end_job "$job"  # anything the job left behind
exit "$status"
