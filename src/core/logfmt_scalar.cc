// The LogFMT chunk kernels in portable C++: one value at a time, the operations of logfmt_math.hh.
#include <cstring>
#include <vector>

#include "core/logfmt_kernels.hh"
#include "core/logfmt_math.hh"

namespace moe_ep::core::logfmt {
namespace {

void put(float* out, float v, float w, Mode mode) {
  if (mode == Mode::kStore) {
    *out = v;
  } else {
    const float product = w * v;
    *out = mode == Mode::kFirst ? product : *out + product;
  }
}

Block block_of(const Params& p) { return {true, p.ln, p.step, p.step_inv, p.fused}; }

// The code of BF16 value x (its magnitude; the sign travels apart).
std::uint32_t code_of(std::uint16_t x, const Block& c) { return code_of_log2(log2_of_bf16()[x & 0x7fff], c); }

void meta_scalar(const std::uint16_t* x, std::int64_t blocks, std::uint16_t* meta) {
  for (std::int64_t b = 0; b < blocks; ++b) {
    std::uint16_t amax = 0, amin = 0x7f80;  // magnitudes as BF16 bits order like their values
    for (int i = 0; i < kBlock; ++i) {
      const std::uint16_t m = x[b * kBlock + i] & 0x7fff;
      amax = m > amax ? m : amax;  // NaN magnitudes (above 0x7f80) make the block uncastable through amax
      amin = m < amin ? m : amin;
    }
    meta[2 * b] = amax > 0x7f80 ? std::uint16_t{0x7fc0} : amax;  // one NaN for every NaN
    meta[2 * b + 1] = amin;
  }
}

void params_scalar(const std::uint16_t* meta, std::int64_t blocks, Params* out, std::uint8_t* castable) {
  for (std::int64_t b = 0; b < blocks; ++b) {
    const Block c = block(meta[2 * b], meta[2 * b + 1]);
    castable[b] = c.castable ? 1 : 0;
    out[b] = {c.ln, c.step, c.step_inv, c.fused};
  }
}

void encode_scalar(const std::uint16_t* x, const Params* params, int blocks, std::byte* out) {
  for (int g = 0; g < blocks * kBlock; g += 16, out += kGroupBytes) {
    const Block p = block_of(params[g / kBlock]);
    std::uint32_t words[5] = {0, 0, 0, 0, 0};
    for (int i = 0; i < 16; ++i) {
      const std::uint32_t k = code_of(x[g + i], p);
      const int bit = 9 * i;
      words[bit / 32] |= k << (bit % 32);
      if (bit % 32 > 23) words[bit / 32 + 1] |= k >> (32 - bit % 32);
      words[4] |= static_cast<std::uint32_t>(x[g + i] >> 15) << (16 + i);
    }
    std::memcpy(out, words, sizeof words);
  }
}

void decode_scalar(const std::byte* in, const Params* params, int blocks, float w, Mode mode, float* out) {
  for (int g = 0; g < blocks * kBlock; g += 16, in += kGroupBytes) {
    const Block p = block_of(params[g / kBlock]);
    std::uint32_t words[5];
    std::memcpy(words, in, sizeof words);
    for (int i = 0; i < 16; ++i) {
      const int bit = 9 * i;
      std::uint32_t k = words[bit / 32] >> (bit % 32);
      if (bit % 32 > 23) k |= words[bit / 32 + 1] << (32 - bit % 32);
      const float v = level(k & 0x1ffu, p);
      put(out + g + i, (words[4] >> (16 + i)) & 1u ? -v : v, w, mode);
    }
  }
}

void round_trip_scalar(const std::uint16_t* x, const Params* params, int blocks, float w, Mode mode, float* out) {
  for (int i = 0; i < blocks * kBlock; ++i) {
    const Block p = block_of(params[i / kBlock]);
    const float v = level(code_of(x[i], p), p);
    put(out + i, x[i] >> 15 ? -v : v, w, mode);
  }
}

void plain_scalar(const std::uint16_t* x, std::int64_t n, float w, Mode mode, float* out) {
  for (std::int64_t i = 0; i < n; ++i) put(out + i, bf16_to_float(x[i]), w, mode);
}

void narrow_scalar(const float* acc, std::int64_t n, std::uint16_t* out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(acc[i]);
}

}  // namespace

const float* log2_of_bf16() {
  static const std::vector<float> table = [] {
    std::vector<float> t(0x8000);
    for (std::uint32_t m = 0; m < 0x8000; ++m) t[m] = log2(bf16_to_float(static_cast<std::uint16_t>(m)));
    return t;
  }();
  return table.data();
}

const float* log2_of_mantissa_bits() {
  static const std::vector<float> table = [] {
    std::vector<float> t(kMantissaEntries);
    for (std::uint32_t m = 0; m < kMantissaEntries; ++m) {
      const std::uint32_t u = 0x3F800000u | m << 16;  // 1.M: E = 127
      const std::int32_t k = reduction_exponent(u);
      t[m] = log2_of_mantissa(bits_float(u - (static_cast<std::uint32_t>(k) << 23)));
    }
    return t;
  }();
  return table.data();
}

const Kernels kScalarKernels = {meta_scalar,       params_scalar, encode_scalar, decode_scalar,
                                round_trip_scalar, plain_scalar,  narrow_scalar};

}  // namespace moe_ep::core::logfmt
