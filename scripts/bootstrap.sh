#!/usr/bin/env bash
# Installs the Debian packages moe-ep needs (only those missing), then configures and builds.
# Usage: scripts/bootstrap.sh [build-dir]   (default: build). Env: BUILD_TYPE (default Release), JOBS,
# CMAKE_ARGS (more configure arguments), TARGETS (build only these), CC/CXX (the compiler).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}

packages=(g++ cmake ninja-build pkg-config libgtest-dev libgmock-dev libbenchmark-dev libdlpack-dev
          libcli11-dev nlohmann-json3-dev libfmt-dev libopenmpi-dev openmpi-bin python3 python3-numpy
          clang-14 libclang-rt-14-dev python3-dev python3-pybind11 pybind11-dev python3-torch python3-pytest
          python3-mpi4py python3-matplotlib libhwloc-dev)
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

jobs=${JOBS:-$(nproc)}
# shellcheck disable=SC2086  # CMAKE_ARGS and TARGETS are lists of words
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" ${CMAKE_ARGS:-} >/dev/null
if [ -n "${TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$build" -j "$jobs" --target ${TARGETS}
else
  cmake --build "$build" -j "$jobs"
fi
