#!/usr/bin/env bash
# Builds moe-ep (installing missing packages) and runs the main job on the embedded default:
# a DeepSeek-V3-shaped MoE layer on 8 in-process ranks, verified against a single-threaded reference.
# Extra arguments go to `moe-ep run` (see `build/moe-ep run --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/bootstrap.sh" "$root/build"
exec "$root/build/moe-ep" run "$@"
