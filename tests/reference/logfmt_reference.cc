#include "reference/logfmt_reference.hh"

#include <cmath>
#include <cstring>

#include "reference/numeric_reference.hh"

namespace moe_ep::reference {
namespace {

struct Params {
  bool castable;
  float ln, step, r;
};

Params params(float amax, float amin) {
  Params p{};
  const float la = log2f(amax);
  float ln = la - 32.0f;
  if (amin != 0.0f && log2f(amin) > ln) ln = log2f(amin);
  p.castable = la < 0.0f && ln < la;
  if (p.castable) {
    p.ln = ln;
    p.step = (la - ln) / 510.0f;
    const float half = (1.0f + exp2f(p.step)) / 2.0f;
    p.r = 2.0f - log2f(half) / p.step;
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
          float c = log2f(v) / p.step + p.r - p.ln / p.step;
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
        const float v = codes[i] == 0 ? 0.0f : exp2f(static_cast<float>(codes[i] - 1) * q.step + q.ln);
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
