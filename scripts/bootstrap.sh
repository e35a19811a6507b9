#!/usr/bin/env bash
# Installs the Debian packages moe-ep needs (scripts/packages.sh: only those missing) and, unless
# the build turns the Python package off, the project's Python environment (scripts/python-env.sh:
# .venv with the pinned torch), then configures and builds.
# Usage: scripts/bootstrap.sh [build-dir]   (default: build). Env: BUILD_TYPE (default Release), JOBS,
# CMAKE_ARGS (more configure arguments), TARGETS (build only these), CC/CXX (the compiler),
# MOE_EP_VENV (where the Python environment lives; default .venv in the source tree).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}

"$root/scripts/packages.sh"

python_args=()
case " ${CMAKE_ARGS:-} " in
  *" -DMOE_EP_WITH_PYTHON=OFF "*) ;;
  *)
    if ! python=$("$root/scripts/python-env.sh" | tail -1); then
      echo "bootstrap: the Python environment could not be set up (above); CMAKE_ARGS=-DMOE_EP_WITH_PYTHON=OFF" \
           "builds everything but the Python package" >&2
      exit 1
    fi
    python_args=(-DMOE_EP_WITH_PYTHON=ON -DPython_EXECUTABLE="$python") ;;
esac

jobs=${JOBS:-$(nproc)}
# shellcheck disable=SC2086  # CMAKE_ARGS and TARGETS are lists of words
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "${python_args[@]}" ${CMAKE_ARGS:-} >/dev/null
if [ -n "${TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$build" -j "$jobs" --target ${TARGETS}
else
  cmake --build "$build" -j "$jobs"
fi
