#!/usr/bin/env bash
# Creates or updates the project's Python environment: a virtual environment of Debian's
# /usr/bin/python3 holding the pinned packages of python/requirements*.txt (torch, numpy, pytest,
# pybind11, mpi4py, matplotlib; the engines whose DeepEP dispatchers the tests run). Idempotent:
# when the environment already holds exactly these pins it returns at once.
# Usage: scripts/python-env.sh [--check] [venv-dir]   (default: $MOE_EP_VENV, else .venv in the
# source tree). Prints the environment's interpreter on its last line. --check only tells, by its
# exit status, whether the environment is ready (0) or would be set up (1). docs/python.md
# describes the environment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
check=0
if [ "${1:-}" = --check ]; then check=1; shift; fi
venv=${1:-${MOE_EP_VENV:-$root/.venv}}
base=/usr/bin/python3
req=$root/python/requirements.txt
engines=$root/python/requirements-engines.txt
engine_deps=$root/python/requirements-engines-deps.txt
constraints=$root/python/constraints.txt

[ -x "$base" ] || { echo "python-env: $base is missing (scripts/bootstrap.sh installs python3)" >&2; exit 1; }
stamp="$venv/.moe-ep-pins"
want=$(cat "$req" "$engines" "$engine_deps" "$constraints" | sha256sum | cut -d' ' -f1)
want="$want $("$base" -c 'import sys; print(sys.version.split()[0])')"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
[ $check = 0 ] || exit 1

echo "python-env: setting up $venv (pinned packages from PyPI; the first time takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$base" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input -q)
# Binary wheels only for the heavy packages (mpi4py's wheel runs on Debian's Open MPI).
"${pip[@]}" install --only-binary=:all: -r "$req" -c "$constraints" >&2
# The engines without their dependency sets (most are GPU-only); what their dispatchers import:
"${pip[@]}" install --only-binary=:all: -r "$engine_deps" -c "$constraints" >&2
# --ignore-requires-python: megatron-core 0.19 declares Python >= 3.12 while publishing a cp311 wheel
# (docs/python.md, "The engines' pins"); the other engines declare 3.10 or less.
"${pip[@]}" install --only-binary=:all: --no-deps --ignore-requires-python -r "$engines" -c "$constraints" >&2
echo "$want" >"$stamp"
echo "$venv/bin/python"
