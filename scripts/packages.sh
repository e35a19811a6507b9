#!/usr/bin/env bash
# Installs the Debian packages moe-ep's build, tests and Python environment need, only those
# missing (apt-get; as root, or through sudo). scripts/bootstrap.sh runs it first.
set -euo pipefail
packages=(g++ cmake ninja-build pkg-config libgtest-dev libgmock-dev libbenchmark-dev libdlpack-dev
          libcli11-dev nlohmann-json3-dev libfmt-dev libopenmpi-dev openmpi-bin python3 python3-numpy
          clang-14 libclang-rt-14-dev python3-dev python3-venv libhwloc-dev iproute2 procps
          ccache)
missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "packages: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

