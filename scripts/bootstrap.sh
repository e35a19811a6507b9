#!/usr/bin/env bash
# Installs the Debian packages moe-ep needs (only those missing) and, unless the build turns the
# Python package off, the project's Python environment (scripts/python-env.sh: .venv with the
# pinned torch), then configures and builds.
# Usage: scripts/bootstrap.sh [build-dir]   (default: build). Env: BUILD_TYPE (default Release), JOBS,
# CMAKE_ARGS (more configure arguments), TARGETS (build only these), CC/CXX (the compiler),
# MOE_EP_VENV (where the Python environment lives; default .venv in the source tree).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}

packages=(g++ cmake ninja-build pkg-config libgtest-dev libgmock-dev libbenchmark-dev libdlpack-dev
          libcli11-dev nlohmann-json3-dev libfmt-dev libopenmpi-dev openmpi-bin python3 python3-numpy
          clang-14 libclang-rt-14-dev python3-dev python3-venv libhwloc-dev)
missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

python_args=()
case " ${CMAKE_ARGS:-} " in
  *" -DMOE_EP_WITH_PYTHON=OFF "*) ;;
  *)
    if ! python=$("$root/scripts/python-env.sh" | tail -1); then
      echo "bootstrap: the Python environment could not be set up (above); CMAKE_ARGS=-DMOE_EP_WITH_PYTHON=OFF" \
           "builds everything but the Python package" >&2
      exit 1
    fi
    python_args=(-DPython_EXECUTABLE="$python") ;;
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
