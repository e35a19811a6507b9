#include "reference/logfmt_reference.hh"

#include <cmath>
#include <cstring>

#include "reference/numeric_reference.hh"

namespace moe_ep::reference {
namespace {

// The codec's log2 (docs/quantized-formats.md): v = 2^e * m with m in [a, 2a), a the FP32 value
// 0x3F3504F3 just below sqrt(1/2), found here by halving and doubling; s = (m - 1) / (m + 1);
// log2(m) = s * P(s^2), P by Horner with the FP32 roundings of 2 / (k ln 2), k = 9, 7, 5, 3, 1.
const float kLowMantissa = 0x1.6a09e6p-1f;  // 0x3F3504F3
const float kP[5] = {0x1.715476p+1f, 0x1.ec709ep-1f, 0x1.2776c6p-1f, 0x1.a61762p-2f, 0x1.484b14p-2f};
// The codec's exp2: Q(f) = 1 + f (q1 + f (q2 + ...)), degree 6, the doc's minimax coefficients.
const float kQ[7] = {0x1p+0f, 0x1.62e432p-1f, 0x1.ebfbep-3f, 0x1.c6ae2cp-5f, 0x1.3b29e4p-7f, 0x1.5f88fep-10f,
                     0x1.446c7ep-13f};

struct Params {
  bool castable;
  float ln, step, step_inv, fused;
};

// The doc's order: step = (la - ln) / 510, step_inv = 1 / step, r = 2 - log2((1 + exp2(step)) * 0.5)
// * step_inv, fused = r - ln * step_inv.
Params params(float amax, float amin) {
  Params p{};
  const float la = logfmt_log2(amax);
  float ln = la - 32.0f;
  if (amin != 0.0f && logfmt_log2(amin) > ln) ln = logfmt_log2(amin);
  p.castable = la < 0.0f && ln < la;
  if (p.castable) {
    p.ln = ln;
    p.step = (la - ln) / 510.0f;
    p.step_inv = 1.0f / p.step;
    const float half = (1.0f + logfmt_exp2(p.step)) * 0.5f;
    const float r = 2.0f - logfmt_log2(half) * p.step_inv;
    p.fused = r - ln * p.step_inv;
  }
  return p;
}

void put_bits(std::vector<std::uint8_t>& out, std::size_t& bit, std::uint32_t value, int width) {
  for (int i = 0; i < width; ++i, ++bit) {
    if (bit / 8 >= out.size()) out.push_back(0);
    if ((value >> i) & 1u) out[bit / 8] = static_cast<std::uint8_t>(out[bit / 8] | (1u << (bit % 8)));
  }
}

std::uint32_t get_bits(const std::vector<std::uint8_t>& in, std::size_t& bit, int width) {
  std::uint32_t v = 0;
  for (int i = 0; i < width; ++i, ++bit)
    if ((in[bit / 8] >> (bit % 8)) & 1u) v |= 1u << i;
  return v;
}

int chunk_of(int hidden) { return hidden % 1024 == 0 ? 1024 : 512; }

}  // namespace

float logfmt_log2(float v) {
  if (std::isnan(v) || v < 0.0f) return NAN;
  if (v == 0.0f) return -INFINITY;
  if (std::isinf(v)) return INFINITY;
  int e = 0;
  if (v < 0x1p-126f) {
    v = v * 0x1p23f;
    e = -23;
  }
  float m = v;
  while (m >= 2.0f * kLowMantissa) {
    m = m / 2.0f;
    ++e;
  }
  while (m < kLowMantissa) {
    m = m * 2.0f;
    --e;
  }
  const float s = (m - 1.0f) / (m + 1.0f);
  const float z = s * s;
  float q = kP[4];
  for (int k = 3; k >= 0; --k) q = q * z + kP[k];
  return s * q + static_cast<float>(e);
}

float logfmt_exp2(float x) {
  if (std::isnan(x)) return x;
  if (x < -160.0f) x = -160.0f;
  if (x > 128.0f) x = 128.0f;
  const float n = std::nearbyint(x);  // ties to even (the default rounding mode)
  const float f = x - n;
  float q = kQ[6];
  for (int k = 5; k >= 0; --k) q = q * f + kQ[k];
  const int whole = static_cast<int>(n);
  const int n1 = whole >= 0 ? whole / 2 : -((-whole + 1) / 2);  // floor(n / 2)
  return (q * std::ldexp(1.0f, n1)) * std::ldexp(1.0f, whole - n1);
}

std::vector<std::uint8_t> logfmt_encode(const std::uint16_t* x, int hidden) {
  const int blocks = hidden / 128;
  std::vector<float> amax(static_cast<size_t>(blocks), 0.0f), amin(static_cast<size_t>(blocks), INFINITY);
  std::vector<bool> nan(static_cast<size_t>(blocks), false);
  for (int h = 0; h < hidden; ++h) {
    const float v = std::fabs(float_from_bf16(x[h]));
    const auto b = static_cast<size_t>(h / 128);
    if (std::isnan(v)) nan[b] = true;
    if (v > amax[b]) amax[b] = v;
    if (v < amin[b]) amin[b] = v;
  }
  std::vector<std::uint8_t> out;
  std::size_t bit = 0;
  for (int b = 0; b < blocks; ++b) {
    // A NaN magnitude makes the pair's amax NaN (the block is then not castable).
    const std::uint16_t hi = nan[static_cast<size_t>(b)] ? 0x7fc0 : bf16_from_float(amax[static_cast<size_t>(b)]);
    put_bits(out, bit, hi, 16);
    put_bits(out, bit, bf16_from_float(amin[static_cast<size_t>(b)]), 16);
  }
  const int chunk = chunk_of(hidden);
  for (int start = 0; start < hidden; start += chunk) {
    const int end = start + chunk < hidden ? start + chunk : hidden;
    bool castable = true;
    for (int b = start / 128; b < end / 128; ++b)
      castable = castable && !nan[static_cast<size_t>(b)] && params(amax[static_cast<size_t>(b)], amin[static_cast<size_t>(b)]).castable;
    if (!castable) {
      for (int h = start; h < end; ++h) put_bits(out, bit, x[h], 16);
      continue;
    }
    for (int g = start; g < end; g += 16) {
      const Params p = params(amax[static_cast<size_t>(g / 128)], amin[static_cast<size_t>(g / 128)]);
      for (int i = 0; i < 16; ++i) {
        const float v = std::fabs(float_from_bf16(x[g + i]));
        std::uint32_t code = 0;
        if (v != 0.0f) {
          const float product = logfmt_log2(v) * p.step_inv;
          float c = product + p.fused;
          c = std::floor(c < 0.0f ? 0.0f : c);
          code = c > 511.0f ? 511u : static_cast<std::uint32_t>(c);
        }
        put_bits(out, bit, code, 9);
      }
      for (int i = 0; i < 16; ++i) put_bits(out, bit, x[g + i] >> 15, 1);
    }
  }
  return out;
}

std::vector<float> logfmt_decode(const std::vector<std::uint8_t>& in, int hidden) {
  const int blocks = hidden / 128;
  std::vector<Params> p(static_cast<size_t>(blocks));
  std::size_t bit = 0;
  for (int b = 0; b < blocks; ++b) {
    const float amax = float_from_bf16(static_cast<std::uint16_t>(get_bits(in, bit, 16)));
    const float amin = float_from_bf16(static_cast<std::uint16_t>(get_bits(in, bit, 16)));
    p[static_cast<size_t>(b)] = params(amax, amin);
  }
  std::vector<float> out(static_cast<size_t>(hidden));
  const int chunk = chunk_of(hidden);
  for (int start = 0; start < hidden; start += chunk) {
    const int end = start + chunk < hidden ? start + chunk : hidden;
    bool castable = true;
    for (int b = start / 128; b < end / 128; ++b) castable = castable && p[static_cast<size_t>(b)].castable;
    if (!castable) {
      for (int h = start; h < end; ++h) out[static_cast<size_t>(h)] = float_from_bf16(static_cast<std::uint16_t>(get_bits(in, bit, 16)));
      continue;
    }
    for (int g = start; g < end; g += 16) {
      const Params& q = p[static_cast<size_t>(g / 128)];
      std::uint32_t codes[16];
      for (int i = 0; i < 16; ++i) codes[i] = get_bits(in, bit, 9);
      for (int i = 0; i < 16; ++i) {
        const float v = codes[i] == 0 ? 0.0f : logfmt_exp2(static_cast<float>(codes[i] - 1) * q.step + q.ln);
        out[static_cast<size_t>(g + i)] = get_bits(in, bit, 1) ? -v : v;
      }
    }
  }
  return out;
}

double calc_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double xy = 0, sq = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    xy += x[i] * y[i];
    sq += x[i] * x[i] + y[i] * y[i];
  }
  return sq == 0 ? 0.0 : 1.0 - 2.0 * xy / sq;
}

}  // namespace moe_ep::reference
