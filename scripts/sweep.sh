#!/usr/bin/env bash
# Bench sweeps and their plots in one command: runs `moe-ep bench --sweep KEY=LIST` on each
# transport, then tools/plot_bench.py on the records.
# Usage: scripts/sweep.sh KEY=LIST [OUT_DIR] [more moe-ep bench arguments...]
#   KEY=LIST  tokens=128,256,...,8192 | ranks=2,4,8,16 | hidden=2048,4096,7168 (see moe-ep bench --help)
#   OUT_DIR   where the records (sweep-KEY[-TRANSPORT].json/.csv) and the PNGs go (default: out/)
# Env: TRANSPORTS: the transports to sweep (default "local host mpi"; ranks= sweeps only local):
#      local runs the ranks as threads, host and mpi under mpirun -np NP (default 8) with that
#      transport (adding the baselines). The first record's bandwidth and time plots are drawn, and
#      the efficiency of every transport on one picture (sweep-KEY-efficiency.png).
#      Memory: the host transport keeps every rank's buffers in shared memory; 8 processes at
#      4096 tokens per rank need more than 24 GiB (sweep host to 2048 on such a machine).
#      BUILD: the build folder (default build/; built with scripts/bootstrap.sh when it has no moe-ep).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ] || [[ "$1" != *=* ]]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
sweep=$1
key=${sweep%%=*}
out=${2:-out}
shift $(($# >= 2 ? 2 : 1))
build=${BUILD:-$root/build}
transports=${TRANSPORTS:-local host mpi}
[ "$key" = ranks ] && transports=local
np=${NP:-8}
if [ "$(id -u)" -eq 0 ]; then  # Open MPI refuses root unless told
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
[ -x "$build/moe-ep" ] || "$root/scripts/bootstrap.sh" "$build"
mkdir -p "$out"
records=()
for transport in $transports; do
  name="sweep-$key"
  [ "$transport" = local ] || name="sweep-$key-$transport"
  cmd=("$build/moe-ep" bench --sweep "$sweep" --json "$out/$name.json" --csv "$out/$name.csv" "$@")
  if [ "$transport" != local ]; then
    cmd=(mpirun -np "$np" --oversubscribe "${cmd[@]}" --transport "$transport")
  fi
  echo "+ ${cmd[*]}" >&2
  "${cmd[@]}"
  records+=("$out/$name.json")
done
# matplotlib lives in the project's Python environment (scripts/python-env.sh, made by bootstrap.sh).
"$("$root/scripts/python-env.sh" | tail -1)" "$root/tools/plot_bench.py" "${records[@]}" --out "$out"
