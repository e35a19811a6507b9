// The LogFMT codec's own log2 and exp2 and its per-block parameters (docs/quantized-formats.md,
// "LogFMT low-latency combine"): every step one IEEE FP32 operation in the order written here, no
// fused multiply-add (the files that use this header compile with -ffp-contract=off), so the
// scalar code below and the vector kernels (logfmt_simd.hh) give the same bits.
#pragma once

#include <cstdint>
#include <limits>

#include "moe_ep/dtype.hpp"

namespace moe_ep::core::logfmt {

// log2: v = 2^e * m with m in [kMantissaLow, 2 * kMantissaLow) (kMantissaLow = 0x3F3504F3, the FP32
// value just below sqrt(1/2)); s = (m - 1) / (m + 1); log2(m) = s * P(s^2), P by Horner with the
// FP32 roundings of 2 / (k ln 2), k = 9, 7, 5, 3, 1.
inline constexpr std::uint32_t kMantissaLow = 0x3F3504F3u;
inline constexpr std::uint32_t kLog2C[5] = {0x4038AA3Bu, 0x3F76384Fu, 0x3F13BB63u, 0x3ED30BB1u, 0x3EA4258Au};  // k = 1, 3, .., 9
// exp2: n = x rounded to the nearest integer, ties to even; f = x - n; 2^f = Q(f), Q of degree 6 by
// Horner (Q(0) = 1; the other coefficients minimize the relative error on [-1/2, 1/2], rounded to
// FP32); the result (Q * 2^floor(n/2)) * 2^(n - floor(n/2)), one rounding (the first product is exact).
inline constexpr std::uint32_t kExp2C[7] = {0x3F800000u, 0x3F317219u, 0x3E75FDF0u, 0x3D635716u,
                                            0x3C1D94F2u, 0x3AAFC47Fu, 0x3922363Fu};  // f^0, .., f^6
inline constexpr float kExp2Low = -160.0f, kExp2High = 128.0f;  // the clamp of x
inline constexpr float kRoundMagic = 12582912.0f;                // 1.5 * 2^23: x + it rounds x to an integer

// The exponent k that log2 reduces a normal FP32 value with bits u by: u - (k << 23) are the bits
// of m in [kMantissaLow, 2 * kMantissaLow).
inline std::int32_t reduction_exponent(std::uint32_t u) { return static_cast<std::int32_t>(u - kMantissaLow) >> 23; }

inline float log2_of_mantissa(float m) {
  const float s = (m - 1.0f) / (m + 1.0f);
  const float z = s * s;
  float q = bits_float(kLog2C[4]);
  q = q * z + bits_float(kLog2C[3]);
  q = q * z + bits_float(kLog2C[2]);
  q = q * z + bits_float(kLog2C[1]);
  q = q * z + bits_float(kLog2C[0]);
  return s * q;
}

// log2 of an FP32 value: +0 and -0 give -inf, +inf gives +inf, NaN and negative values give NaN.
inline float log2(float v) {
  if (!(v >= 0.0f)) return std::numeric_limits<float>::quiet_NaN();
  if (v == 0.0f) return -std::numeric_limits<float>::infinity();
  if (v == std::numeric_limits<float>::infinity()) return v;
  std::int32_t e = 0;
  if (v < 0x1p-126f) {  // subnormal: scaled into the normal range exactly
    v = v * 0x1p23f;
    e = -23;
  }
  const std::uint32_t u = float_bits(v);
  const std::int32_t k = reduction_exponent(u);
  const float m = bits_float(u - (static_cast<std::uint32_t>(k) << 23));
  return log2_of_mantissa(m) + static_cast<float>(k + e);
}

// 2^x of an FP32 value: NaN gives NaN, x >= 128 gives +inf, x <= -160 gives +0 (through the clamp).
inline float exp2(float x) {
  if (x != x) return x;
  x = x < kExp2Low ? kExp2Low : x;
  x = x > kExp2High ? kExp2High : x;
  const float t = x + kRoundMagic;
  const std::int32_t n = static_cast<std::int32_t>(float_bits(t) - float_bits(kRoundMagic));
  const float f = x - (t - kRoundMagic);
  float p = bits_float(kExp2C[6]);
  for (int k = 5; k >= 0; --k) p = p * f + bits_float(kExp2C[k]);
  const std::int32_t n1 = n >> 1, n2 = n - n1;
  const float s1 = bits_float(static_cast<std::uint32_t>(n1 + 127) << 23);
  const float s2 = bits_float(static_cast<std::uint32_t>(n2 + 127) << 23);
  return (p * s1) * s2;
}

// A block's parameters, from its meta pair (BF16 amax, amin), in DeepEP's order of operations:
// step_inv = 1 / step and fused = r - ln * step_inv, r = 2 - log2((1 + exp2(step)) * 0.5) * step_inv.
struct Block {
  bool castable = false;
  float ln = 0, step = 0, step_inv = 0, fused = 0;
};

inline Block block(std::uint16_t amax_bits, std::uint16_t amin_bits) {
  Block c;
  const float amax = bf16_to_float(amax_bits), amin = bf16_to_float(amin_bits);
  const float la = log2(amax);
  const float floor_ln = la - 32.0f;
  float ln = floor_ln;
  if (amin != 0.0f) {
    const float lmin = log2(amin);
    ln = lmin < floor_ln ? floor_ln : lmin;
  }
  c.castable = la < 0.0f && ln < la;
  if (!c.castable) return c;
  c.ln = ln;
  c.step = (la - ln) / 510.0f;
  c.step_inv = 1.0f / c.step;
  const float r = 2.0f - log2((1.0f + exp2(c.step)) * 0.5f) * c.step_inv;
  c.fused = r - ln * c.step_inv;
  return c;
}

// The code of a magnitude v of a castable block whose log2(v) is l: floor(max(t, 0)) capped at 511,
// t = l * step_inv + fused (v = 0: l = -inf, code 0).
inline std::uint32_t code_of_log2(float l, const Block& c) {
  const float t = l * c.step_inv + c.fused;
  const float clamped = t < 0.0f ? 0.0f : (t > 511.0f ? 511.0f : t);
  return static_cast<std::uint32_t>(clamped);  // truncation: floor of a value in [0, 511]
}

// The magnitude a code decodes to: 0, or 2^((code - 1) * step + ln).
inline float level(std::uint32_t code, const Block& c) {
  if (code == 0) return 0.0f;
  return exp2(static_cast<float>(code - 1) * c.step + c.ln);
}

// log2 of every BF16 magnitude (index: the 15 magnitude bits; NaN for NaN patterns), built once
// from log2 above.
const float* log2_of_bf16();

// log2_of_mantissa of the m that log2 above reduces a BF16 value with mantissa bits M to, for each
// of the 128 values of M (kMantissaEntries). m depends on M alone: for a normal BF16 value with
// FP32 bits u (exponent E, mantissa M), k = (u - kMantissaLow) >> 23 = E - 127 - (M < 54) and
// u - (k << 23) is the same pattern for every E, so log2 gives log2_of_mantissa_bits()[M] + float(k)
// (the same two roundings). The AVX-512 encoder looks log2 up this way: 128 values in registers
// instead of log2_of_bf16's 128 KiB (zero, subnormal, infinite and NaN magnitudes still come from
// that one).
inline constexpr int kMantissaEntries = 128;
const float* log2_of_mantissa_bits();

}  // namespace moe_ep::core::logfmt
