// The FP8 scales of the V1 low-latency dispatch, on in-process ranks (one node, and two nodes so
// that rows also travel as messages), against DeepEP's formula written out here in plain FP32
// arithmetic from the source rows: scale_inv = max(amax, 1e-4) * (1.0f / 448.0f), one product;
// with round_scale 2^ceil(log2(that product)), with use_ue8m0 its exponent byte. The inputs'
// blocks span forty binades; the test counts the received blocks where amax / 448 would have
// given other bits, so that the quotient cannot pass it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "moe_ep/legacy_buffer.hpp"
#include "reference/numeric_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace legacy_fp8_scales_test {
namespace {

constexpr int kRanks = 4, kTokens = 12, kHidden = 1024, kExperts = 8, kTopk = 3, kBlocks = kHidden / 128;

// Rank r's BF16 input: each 128-element block scaled into one binade of [-20, 20).
std::vector<std::uint16_t> input_of(int rank) {
  std::mt19937 rng(1000 + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-20, 19);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(kTokens) * kHidden);
  for (std::size_t b = 0; b < x.size() / 128; ++b) {
    const int e = binade(rng);
    for (std::size_t i = 0; i < 128; ++i)
      x[b * 128 + i] = reference::bf16_from_float(normal(rng) * std::ldexp(1.0f, e));
  }
  return x;
}

// Token t of every rank goes to experts (t + j * 3) % 8, j < 3: every rank receives rows from
// every rank.
std::vector<std::int64_t> topk_of() {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(kTokens) * kTopk);
  for (int t = 0; t < kTokens; ++t)
    for (int j = 0; j < kTopk; ++j) ids[static_cast<std::size_t>(t * kTopk + j)] = (t + j * 3) % kExperts;
  return ids;
}

// Block b of a BF16 row as DeepEP's kernel scales it: the stored word (FP32 bits, or with
// round_scale the power of two whose exponent byte UE8M0 keeps); `differs` when amax / 448 is
// another float than amax * (1 / 448).
std::uint32_t deepep_scale(const std::uint16_t* row, int b, bool round_scale, bool& differs) {
  float amax = 0.0f;
  for (int i = b * 128; i < (b + 1) * 128; ++i) amax = std::max(amax, std::fabs(reference::float_from_bf16(row[i])));
  if (amax < 1e-4f) amax = 1e-4f;
  const float product = amax * (1.0f / 448.0f);
  differs = reference::bits_of(amax / 448.0f) != reference::bits_of(product);
  if (!round_scale) return reference::bits_of(product);
  int e = 0;
  const float m = std::frexp(product, &e);  // product = m * 2^e, m in [0.5, 1)
  return reference::bits_of(std::ldexp(1.0f, m == 0.5f ? e - 1 : e));
}

// Checks every received row's scales; returns the number of blocks whose quotient differs.
int check_scales(const LowLatencyDispatchResult& d, bool round_scale, bool ue8m0, std::vector<std::string>& bad) {
  const std::vector<std::uint16_t> inputs[kRanks] = {input_of(0), input_of(1), input_of(2), input_of(3)};
  const TensorView& sc = d.recv_x_scales;
  const int El = kExperts / kRanks;
  int differ = 0;
  for (int i = 0; i < El; ++i)
    for (int src = 0; src < kRanks; ++src) {
      const std::int64_t range = d.handle->packed_recv_layout_range.data_as<std::int64_t>()[i * kRanks + src];
      const std::int64_t begin = range >> 32, count = range & 0xffffffff;
      for (std::int64_t row = begin; row < begin + count; ++row) {
        const int token = d.handle->packed_recv_src_info.data_as<std::int32_t>()[i * kRanks * kTokens + row];
        const std::uint16_t* x = inputs[src].data() + static_cast<std::size_t>(token) * kHidden;
        for (int b = 0; b < kBlocks; ++b) {
          bool differs = false;
          const std::uint32_t want = deepep_scale(x, b, round_scale, differs);
          differ += differs ? 1 : 0;
          std::uint32_t got;
          if (ue8m0) {
            const auto word = static_cast<std::uint32_t>(
                sc.data_as<std::int32_t>()[i * sc.stride(0) + row * sc.stride(1) + (b / 4) * sc.stride(2)]);
            got = ((word >> (8 * (b % 4))) & 0xffu) << 23;  // the exponent byte as the float it encodes
          } else {
            got = sc.data_as<std::uint32_t>()[i * sc.stride(0) + row * sc.stride(1) + b * sc.stride(2)];
          }
          if (got != want)
            bad.push_back(fmt::format("expert {} row {} (rank {} token {}) block {}: scale {:#010x}, expected {:#010x}",
                                      i, row, src, token, b, got, want));
        }
      }
    }
  return differ;
}

void run(int scaleout, bool round_scale, bool ue8m0) {
  const auto failures = testing::collect_on_ranks(
      kRanks, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
        const std::int64_t bytes = Buffer::get_low_latency_rdma_size_hint(kTokens, kHidden, kRanks, kExperts);
        Buffer buffer(g, {.num_rdma_bytes = bytes, .low_latency_mode = true, .num_cpu_timeout_secs = 60});
        std::vector<std::uint16_t> x = input_of(g.rank());
        std::vector<std::int64_t> ids = topk_of();
        LowLatencyDispatchResult d = buffer.low_latency_dispatch(
            {.x = TensorView(x.data(), DType::kBF16, {kTokens, kHidden}),
             .topk_idx = TensorView(ids.data(), DType::kInt64, {kTokens, kTopk}),
             .num_max_dispatch_tokens_per_rank = kTokens, .num_experts = kExperts,
             .use_fp8 = true, .round_scale = round_scale, .use_ue8m0 = ue8m0});
        d.event.wait();
        const int differ = check_scales(d, round_scale, ue8m0, bad);
        // amax / 448 would store other scales: about half of the received blocks tell them apart.
        if (!round_scale && differ == 0) bad.push_back("no received block tells amax / 448 from amax * (1 / 448)");
      });
  testing::report_problems(failures, {.context = fmt::format("{} node(s), round_scale {}, use_ue8m0 {}", scaleout,
                                                             round_scale, ue8m0),
                                      .name_rank = true, .max_per_rank = 8});
}

TEST(LegacyFp8Scales, LowLatencyDispatchStoresAmaxTimesTheFloatReciprocal) {
  run(1, false, false);
  run(2, false, false);
}

TEST(LegacyFp8Scales, RoundedScalesAndUe8m0BytesComeFromTheSameProduct) {
  run(1, true, false);
  run(2, true, true);
}

}  // namespace
}  // namespace legacy_fp8_scales_test
}  // namespace moe_ep
