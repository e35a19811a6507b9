#include "core/logfmt_rows.hh"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "core/cpu_features.hh"
#include "core/logfmt_kernels.hh"

namespace moe_ep::core {
namespace {

using logfmt::kBlock;
using logfmt::Kernels;
using logfmt::Mode;

std::int64_t chunk_elements(std::int64_t hidden) { return 256 * (hidden % 1024 == 0 ? 4 : 2); }
std::int64_t castable_bytes(std::int64_t n) { return n / 16 * logfmt::kGroupBytes; }

const Kernels* widest() {
#ifdef MOE_EP_X86_DISPATCH
  if (has_avx512()) return &logfmt::kAvx512Kernels;
  if (has_avx2()) return &logfmt::kAvx2Kernels;
#endif
  return &logfmt::kScalarKernels;
}

std::atomic<const Kernels*> selected{nullptr};

const Kernels& kernels() {
  const Kernels* k = selected.load(std::memory_order_relaxed);
  if (k == nullptr) {
    k = widest();
    selected.store(k, std::memory_order_relaxed);
  }
  return *k;
}

// The blocks of one row: meta pairs, parameters and castable flags.
struct RowBlocks {
  std::vector<std::uint16_t> meta;
  std::vector<logfmt::Params> params;
  std::vector<std::uint8_t> castable;
  void resize(std::size_t blocks) {
    meta.resize(2 * blocks);
    params.resize(blocks);
    castable.resize(blocks);
  }
  // Whether every block of [first, first + count) is castable.
  bool chunk_castable(std::int64_t first, std::int64_t count) const {
    std::uint8_t all = 1;
    for (std::int64_t b = first; b < first + count; ++b) all &= castable[static_cast<std::size_t>(b)];
    return all != 0;
  }
};

// Parameters of `rows` rows of `blocks` blocks whose meta is in place.
void fill_params(const Kernels& k, RowBlocks& rb, std::int64_t blocks) {
  k.params(rb.meta.data(), blocks, rb.params.data(), rb.castable.data());
}

}  // namespace

std::int64_t logfmt_max_row_bytes(std::int64_t hidden) { return 2 * hidden + 4 * (hidden / kBlock); }

std::int64_t logfmt_encode_row(const std::uint16_t* bf16, std::int64_t hidden, std::byte* out) {
  const Kernels& k = kernels();
  const std::int64_t blocks = hidden / kBlock, chunk = chunk_elements(hidden);
  thread_local RowBlocks rb;
  rb.resize(static_cast<std::size_t>(blocks));
  k.meta(bf16, blocks, rb.meta.data());
  fill_params(k, rb, blocks);
  std::memcpy(out, rb.meta.data(), static_cast<std::size_t>(4 * blocks));
  std::byte* body = out + 4 * blocks;
  for (std::int64_t start = 0; start < hidden; start += chunk) {
    const std::int64_t n = std::min(chunk, hidden - start), first = start / kBlock;
    if (rb.chunk_castable(first, n / kBlock)) {
      k.encode(bf16 + start, rb.params.data() + first, static_cast<int>(n / kBlock), body);
      body += castable_bytes(n);
    } else {
      std::memcpy(body, bf16 + start, static_cast<std::size_t>(n) * 2);
      body += n * 2;
    }
  }
  return body - out;
}

std::int64_t logfmt_decode_row(const std::byte* in, std::int64_t hidden, float* out) {
  const Kernels& k = kernels();
  const std::int64_t blocks = hidden / kBlock, chunk = chunk_elements(hidden);
  thread_local RowBlocks rb;
  rb.resize(static_cast<std::size_t>(blocks));
  std::memcpy(rb.meta.data(), in, static_cast<std::size_t>(4 * blocks));
  fill_params(k, rb, blocks);
  const std::byte* body = in + 4 * blocks;
  for (std::int64_t start = 0; start < hidden; start += chunk) {
    const std::int64_t n = std::min(chunk, hidden - start), first = start / kBlock;
    if (rb.chunk_castable(first, n / kBlock)) {
      k.decode(body, rb.params.data() + first, static_cast<int>(n / kBlock), 1.0f, Mode::kStore, out + start);
      body += castable_bytes(n);
    } else {
      k.plain(reinterpret_cast<const std::uint16_t*>(body), n, 1.0f, Mode::kStore, out + start);
      body += n * 2;
    }
  }
  return body - in;
}

namespace {

// One chunk of every row: the meta pairs of its blocks (row r's at r * blocks; read from the head of
// an encoded row, found in a BF16 row), then their parameters in one pass. The next chunk of the
// BF16 rows is prefetched meanwhile: it arrives while this chunk is computed.
void chunk_params(const Kernels& k, std::span<const LogfmtRow> rows, std::int64_t start, std::int64_t n,
                  std::int64_t hidden, RowBlocks& rb) {
  const std::int64_t blocks = n / kBlock;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::uint16_t* meta = rb.meta.data() + 2 * static_cast<std::int64_t>(r) * blocks;
    if (rows[r].encoded) {
      std::memcpy(meta, rows[r].encoded + 4 * (start / kBlock), static_cast<std::size_t>(4 * blocks));
      continue;
    }
    k.meta(rows[r].bf16 + start, blocks, meta);
    const std::int64_t next = std::min(start + n, hidden), end = std::min(next + n, hidden);
    for (std::int64_t h = next; h < end; h += 32) __builtin_prefetch(rows[r].bf16 + h);
  }
  k.params(rb.meta.data(), static_cast<std::int64_t>(rows.size()) * blocks, rb.params.data(), rb.castable.data());
}

}  // namespace

// Chunk by chunk: the parameters of every row's blocks of the chunk (chunk_params), then every
// row's values of the chunk accumulated into `acc` in row order, then rounded.
void logfmt_weighted_sum(std::span<const LogfmtRow> rows, std::span<const float> weights, std::uint16_t* out,
                         std::int64_t hidden) {
  if (rows.empty()) {
    std::memset(out, 0, static_cast<std::size_t>(hidden) * sizeof(std::uint16_t));
    return;
  }
  const Kernels& k = kernels();
  const std::int64_t chunk = chunk_elements(hidden);
  thread_local RowBlocks rb;
  thread_local std::vector<const std::byte*> body;  // where each encoded row's next chunk starts
  rb.resize(rows.size() * logfmt::kMaxChunkBlocks);
  body.resize(rows.size());
  for (std::size_t r = 0; r < rows.size(); ++r)
    if (rows[r].encoded) body[r] = rows[r].encoded + 4 * (hidden / kBlock);
  alignas(64) float acc[logfmt::kMaxChunk];
  for (std::int64_t start = 0; start < hidden; start += chunk) {
    const std::int64_t n = std::min(chunk, hidden - start);
    const int blocks = static_cast<int>(n / kBlock);
    chunk_params(k, rows, start, n, hidden, rb);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      const Mode mode = r == 0 ? Mode::kFirst : Mode::kAdd;
      const std::int64_t first = static_cast<std::int64_t>(r) * blocks;
      const bool castable = rb.chunk_castable(first, blocks);
      const logfmt::Params* p = rb.params.data() + first;
      if (rows[r].encoded) {
        const std::byte* in = body[r];
        body[r] += castable ? castable_bytes(n) : 2 * n;
        if (castable)
          k.decode(in, p, blocks, weights[r], mode, acc);
        else
          k.plain(reinterpret_cast<const std::uint16_t*>(in), n, weights[r], mode, acc);
      } else if (castable) {
        k.round_trip(rows[r].bf16 + start, p, blocks, weights[r], mode, acc);
      } else {
        k.plain(rows[r].bf16 + start, n, weights[r], mode, acc);
      }
    }
    k.narrow(acc, n, out + start);
  }
}

bool logfmt_select_isa(LogfmtIsa isa) {
  const Kernels* k = nullptr;
  switch (isa) {
    case LogfmtIsa::kAuto: k = widest(); break;
    case LogfmtIsa::kScalar: k = &logfmt::kScalarKernels; break;
#ifdef MOE_EP_X86_DISPATCH
    case LogfmtIsa::kAvx2: k = has_avx2() ? &logfmt::kAvx2Kernels : nullptr; break;
    case LogfmtIsa::kAvx512: k = has_avx512() ? &logfmt::kAvx512Kernels : nullptr; break;
#else
    default: break;
#endif
  }
  if (k == nullptr) return false;
  selected.store(k, std::memory_order_relaxed);
  return true;
}

}  // namespace moe_ep::core
