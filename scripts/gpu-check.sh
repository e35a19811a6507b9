#!/usr/bin/env bash
# The device check of the CUDA provider (docs/cuda.md), run on a GPU machine from a build made
# elsewhere with CUDA (the provider links the CUDA runtime statically: nothing is built or
# installed here). Runs the GPU test (every output against the built-in provider, bit for bit),
# the Python test on torch CUDA tensors (where the interpreter, MOE_EP_GPU_PYTHON or python3, has
# torch and matches the extension's build), and the GPU bench, and writes one log.
# Usage: scripts/gpu-check.sh [build-dir] [log]   (defaults: build, $OUT/gpu-check.log or ./gpu-check.log)
# Time: the tests take about a minute, the bench (DeepSeek-V3 shape, 4096 and 128 tokens per rank,
# 8 ranks) a few; each has a timeout so the whole stays under 8 minutes.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)  # absolute: the Python step runs from tests/python
log=${2:-${OUT:-.}/gpu-check.log}
mkdir -p "$(dirname "$log")"
status=0
# The build may have been carried to another path than it was made at: name its libraries.
export LD_LIBRARY_PATH="$build/src${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOE_EP_CUDA_PROVIDER="$build/src/libmoe_ep_cuda.so"
export MOE_EP_PROVIDER_PATH="$MOE_EP_CUDA_PROVIDER"
{
  echo "# moe-ep gpu-check $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: not available"
  for f in "$build/src/libmoe_ep_cuda.so" "$build/tests/cuda_gpu_test" "$build/tests/cuda_host_test" "$build/moe-ep"; do
    [ -e "$f" ] || { echo "gpu-check: $f is missing: build with CUDA first (MOE_EP_WITH_CUDA=ON)"; exit 2; }
  done
  echo "## the provider library, probed through the provider ABI"
  MOE_EP_EXPECT_GPU=1 timeout 60 "$build/tests/cuda_host_test" --gtest_filter='CudaProviderLibrary.*' --gtest_brief=1 || status=1
  echo "## GPU test (tests/cuda/gpu): outputs against the built-in provider"
  timeout 300 "$build/tests/cuda_gpu_test" --gtest_brief=1 || status=1
  echo "## Python: moe_ep.deep_ep.ElasticBuffer on torch CUDA tensors (tests/python/test_cuda_tensors.py)"
  py=${MOE_EP_GPU_PYTHON:-python3}
  ext=$(ls "$build"/python/moe_ep/_C*.so 2>/dev/null | head -1)
  if ! "$py" -c "import torch, pytest" 2>/dev/null; then
    echo "not run: $py has no torch and pytest (set MOE_EP_GPU_PYTHON to an interpreter that has)"
  elif [ -z "$ext" ] || [[ "$ext" != *"$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" ]]; then
    echo "not run: the extension (${ext:-none}) was not built for $py"
  else
    (cd "$root/tests/python" && MOE_EP_PROVIDER_PATH="$MOE_EP_CUDA_PROVIDER:cpu" PYTHONPATH="$build/python:$build/deep_ep_alias" MOE_EP_BUILD_DIR="$build" \
      timeout 300 "$py" -m pytest -q -p no:cacheprovider -rs test_cuda_tensors.py) || status=1
  fi
  echo "## GPU bench: DeepSeek-V3 shape, 8 ranks on the device(s) present"
  timeout 240 "$build/moe-ep" bench --provider cuda || status=1
  echo "## gpu-check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
