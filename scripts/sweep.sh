#!/usr/bin/env bash
# A bench sweep and its plots in one command: runs `moe-ep bench --sweep KEY=LIST`, then
# tools/plot_bench.py on its record.
# Usage: scripts/sweep.sh KEY=LIST [OUT_DIR] [more moe-ep bench arguments...]
#   KEY=LIST  tokens=128,256,...,8192 | ranks=2,4,8,16 | hidden=2048,4096,7168 (see moe-ep bench --help)
#   OUT_DIR   where sweep-KEY.json, sweep-KEY.csv and the PNGs go (default: out/)
# Env: NP=N runs the sweep under mpirun -np N --transport mpi (adds the MPI_Alltoallv baseline;
#      not for ranks=), BUILD (the build folder, default build/; built with scripts/bootstrap.sh
#      when it has no moe-ep yet).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ] || [[ "$1" != *=* ]]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
sweep=$1
key=${sweep%%=*}
out=${2:-out}
shift $(($# >= 2 ? 2 : 1))
build=${BUILD:-$root/build}
[ -x "$build/moe-ep" ] || "$root/scripts/bootstrap.sh" "$build"
mkdir -p "$out"
cmd=("$build/moe-ep" bench --sweep "$sweep" --json "$out/sweep-$key.json" --csv "$out/sweep-$key.csv" "$@")
if [ -n "${NP:-}" ]; then
  cmd=(mpirun -np "$NP" --oversubscribe "${cmd[@]}" --transport mpi)
fi
echo "+ ${cmd[*]}" >&2
"${cmd[@]}"
# matplotlib lives in the project's Python environment (scripts/python-env.sh, made by bootstrap.sh).
"$("$root/scripts/python-env.sh" | tail -1)" "$root/tools/plot_bench.py" "$out/sweep-$key.json" --out "$out"
