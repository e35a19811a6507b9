#!/usr/bin/env bash
# The device check of the CUDA provider (docs/cuda.md), run on a GPU machine from a build made
# elsewhere with CUDA (the provider links the CUDA runtime statically: nothing is built or
# installed here). Runs the GPU test (every output against the built-in provider, bit for bit)
# and the GPU bench, and writes one log.
# Usage: scripts/gpu-check.sh [build-dir] [log]   (defaults: build, $OUT/gpu-check.log or ./gpu-check.log)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
log=${2:-${OUT:-.}/gpu-check.log}
mkdir -p "$(dirname "$log")"
status=0
{
  echo "# moe-ep gpu-check $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: not available"
  for f in "$build/src/libmoe_ep_cuda.so" "$build/tests/cuda_gpu_test" "$build/bench/cuda_bench"; do
    [ -e "$f" ] || { echo "gpu-check: $f is missing: build with CUDA first (MOE_EP_WITH_CUDA=ON)"; exit 2; }
  done
  echo "## the provider library, probed through the provider ABI"
  MOE_EP_EXPECT_GPU=1 timeout 60 "$build/tests/cuda_host_test" --gtest_filter='CudaProviderLibrary.*' --gtest_brief=1 || status=1
  echo "## GPU test (tests/cuda/gpu): outputs against the built-in provider"
  timeout 300 "$build/tests/cuda_gpu_test" --gtest_brief=1 || status=1
  echo "## GPU bench: DeepSeek-V3 shape, 8 ranks on the device(s) present"
  timeout 180 "$build/bench/cuda_bench" || status=1
  echo "## gpu-check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
