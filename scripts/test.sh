#!/usr/bin/env bash
# Builds moe-ep (installing missing packages) and runs the whole test suite with CTest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/bootstrap.sh" "$root/build"
cd "$root/build"
exec ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 1200
