// The CUDA provider's bench entry: a C function the provider library exports beside its table,
// which `moe-ep bench --provider cuda` calls (docs/cuda.md). It times the V2 buffer on device
// tensors and prints the report on stdout; it returns 0, 77 when no CUDA device exists (the
// report says "SKIP: no CUDA device"), or 1 on failure (the reason on stderr).
#pragma once

extern "C" {

struct MoeEpCudaBenchOptions {
  int ranks;             // threads of this process, on devices rank % devices
  int hidden;            // BF16 elements per row
  int experts;
  int topk;
  int prefill_tokens;    // tokens per rank of the prefill shape
  int decode_tokens;     // tokens per rank of the decode shape
  int prefill_iterations;
  int decode_iterations;
  unsigned long long seed;
};

}  // extern "C"

inline constexpr const char* kMoeEpCudaBenchSymbol = "moe_ep_cuda_bench_1";
