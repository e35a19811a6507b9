#include "core/logfmt_rows.hh"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe_ep/dtype.hpp"

namespace moe_ep::core {
namespace {

constexpr std::int64_t kBlock = 128;

std::int64_t chunk_elements(std::int64_t hidden) { return 256 * (hidden % 1024 == 0 ? 4 : 2); }

// The per-block parameters both sides derive from the meta pair.
struct BlockCode {
  bool castable = false;
  float step = 0, ln = 0, r = 0;
};

BlockCode block_code(std::uint16_t amax_bits, std::uint16_t amin_bits) {
  BlockCode c;
  const float amax = bf16_to_float(amax_bits), amin = bf16_to_float(amin_bits);
  const float la = std::log2(amax);
  const float floor_ln = la - 32.0f;
  const float ln = amin == 0.0f ? floor_ln : std::max(std::log2(amin), floor_ln);
  c.castable = la < 0.0f && ln < la;
  if (!c.castable) return c;
  c.ln = ln;
  c.step = (la - ln) / 510.0f;
  c.r = 2.0f - std::log2((1.0f + std::exp2(c.step)) / 2.0f) / c.step;
  return c;
}

std::uint32_t encode_value(float v, const BlockCode& c) {
  if (v == 0.0f) return 0;
  const float t = std::log2(v) / c.step + c.r - c.ln / c.step;
  const float code = std::floor(std::max(t, 0.0f));
  return code >= 511.0f ? 511u : static_cast<std::uint32_t>(code);
}

float decode_value(std::uint32_t code, const BlockCode& c) {
  if (code == 0) return 0.0f;
  return std::exp2(static_cast<float>(code - 1) * c.step + c.ln);
}

}  // namespace

std::int64_t logfmt_max_row_bytes(std::int64_t hidden) { return 2 * hidden + 4 * (hidden / kBlock); }

std::int64_t logfmt_encode_row(const std::uint16_t* bf16, std::int64_t hidden, std::byte* out) {
  const std::int64_t blocks = hidden / kBlock, chunk = chunk_elements(hidden);
  auto* meta = reinterpret_cast<std::uint16_t*>(out);
  std::byte* body = out + 4 * blocks;
  for (std::int64_t b = 0; b < blocks; ++b) {
    std::uint16_t amax = 0, amin = 0x7f80;  // magnitudes as BF16 bits order like their values
    for (std::int64_t i = 0; i < kBlock; ++i) {
      const std::uint16_t m = bf16[b * kBlock + i] & 0x7fff;
      // NaN magnitudes (above 0x7f80) make the block uncastable through amax.
      amax = std::max(amax, m);
      amin = std::min(amin, m);
    }
    meta[2 * b] = amax > 0x7f80 ? std::uint16_t{0x7fc0} : amax;  // one NaN for every NaN
    meta[2 * b + 1] = amin;
  }
  for (std::int64_t start = 0; start < hidden; start += chunk) {
    const std::int64_t n = std::min(chunk, hidden - start);
    bool castable = true;
    for (std::int64_t b = start / kBlock; b < (start + n) / kBlock; ++b)
      castable = castable && block_code(meta[2 * b], meta[2 * b + 1]).castable;
    if (!castable) {
      std::memcpy(body, bf16 + start, static_cast<std::size_t>(n) * 2);
      body += n * 2;
      continue;
    }
    for (std::int64_t g = start; g < start + n; g += 16) {
      const BlockCode c = block_code(meta[2 * (g / kBlock)], meta[2 * (g / kBlock) + 1]);
      std::uint32_t words[5] = {0, 0, 0, 0, 0};
      for (int i = 0; i < 16; ++i) {
        const std::uint16_t x = bf16[g + i];
        const std::uint32_t code = encode_value(bf16_to_float(x & 0x7fff), c);
        const int bit = 9 * i;
        words[bit / 32] |= code << (bit % 32);
        if (bit % 32 > 23) words[bit / 32 + 1] |= code >> (32 - bit % 32);
        words[4] |= static_cast<std::uint32_t>(x >> 15) << (16 + i);
      }
      std::memcpy(body, words, sizeof words);
      body += sizeof words;
    }
  }
  return body - out;
}

std::int64_t logfmt_decode_row(const std::byte* in, std::int64_t hidden, float* out) {
  const std::int64_t blocks = hidden / kBlock, chunk = chunk_elements(hidden);
  const std::byte* body = in + 4 * blocks;
  for (std::int64_t start = 0; start < hidden; start += chunk) {
    const std::int64_t n = std::min(chunk, hidden - start);
    std::uint16_t meta[2 * 8];
    const std::int64_t first = start / kBlock, count = n / kBlock;
    std::memcpy(meta, in + 4 * first, static_cast<std::size_t>(4 * count));
    BlockCode c[8];
    bool castable = true;
    for (std::int64_t b = 0; b < count; ++b) {
      c[b] = block_code(meta[2 * b], meta[2 * b + 1]);
      castable = castable && c[b].castable;
    }
    if (!castable) {
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t x;
        std::memcpy(&x, body + 2 * i, 2);
        out[start + i] = bf16_to_float(x);
      }
      body += n * 2;
      continue;
    }
    for (std::int64_t g = 0; g < n; g += 16) {
      const BlockCode& bc = c[g / kBlock];
      std::uint32_t words[5];
      std::memcpy(words, body, sizeof words);
      body += sizeof words;
      for (int i = 0; i < 16; ++i) {
        const int bit = 9 * i;
        std::uint32_t code = words[bit / 32] >> (bit % 32);
        if (bit % 32 > 23) code |= words[bit / 32 + 1] << (32 - bit % 32);
        code &= 0x1ffu;
        const float v = decode_value(code, bc);
        out[start + g + i] = (words[4] >> (16 + i)) & 1u ? -v : v;
      }
    }
  }
  return body - in;
}

}  // namespace moe_ep::core
