// The LogFMT codec's kernels (docs/quantized-formats.md): a table of functions per instruction set
// (scalar in logfmt_scalar.cc, AVX2 and AVX-512 in logfmt_avx2.cc and logfmt_avx512.cc), all giving
// the same bits. logfmt_rows.cc computes the parameters of every block of a row first, then walks
// the row chunk by chunk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_ep::core::logfmt {

inline constexpr int kBlock = 128;           // channels per (amax, amin) pair
inline constexpr int kMaxChunkBlocks = 8;    // a chunk has 256 * U elements, U <= 4
inline constexpr int kMaxChunk = kMaxChunkBlocks * kBlock;
inline constexpr int kGroupBytes = 20;       // 16 codes of 9 bits and their 16 sign bits

// A castable block's parameters (logfmt_math.hh).
struct Params {
  float ln, step, step_inv, fused;
};

// What a kernel does with the values v it produces: out = v, out = w * v, or out = out + w * v.
enum class Mode { kStore, kFirst, kAdd };

// Kernels over `blocks` blocks of 128 values (a castable chunk; meta and params: any count).
struct Kernels {
  // meta[2b], meta[2b + 1] = the (amax, amin) pair of block b of x (NaN amax as 0x7fc0).
  void (*meta)(const std::uint16_t* x, std::int64_t blocks, std::uint16_t* meta);
  // Each block's parameters from its meta pair, and castable[b] = 1 or 0 (params of an uncastable
  // block are not used).
  void (*params)(const std::uint16_t* meta, std::int64_t blocks, Params* out, std::uint8_t* castable);
  // Codes and signs, 20 bytes per 16 values.
  void (*encode)(const std::uint16_t* x, const Params* p, int blocks, std::byte* out);
  // What encoded values decode to, written or accumulated into out.
  void (*decode)(const std::byte* in, const Params* p, int blocks, float w, Mode mode, float* out);
  // What the encoding of x decodes to (without packing), into out.
  void (*round_trip)(const std::uint16_t* x, const Params* p, int blocks, float w, Mode mode, float* out);
  // BF16 values (an uncastable chunk), written or accumulated into out.
  void (*plain)(const std::uint16_t* x, std::int64_t n, float w, Mode mode, float* out);
  // out[i] = the BF16 rounding of acc[i] (NaN stays NaN).
  void (*narrow)(const float* acc, std::int64_t n, std::uint16_t* out);
};

extern const Kernels kScalarKernels;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
extern const Kernels kAvx2Kernels;
extern const Kernels kAvx512Kernels;
#endif

}  // namespace moe_ep::core::logfmt
