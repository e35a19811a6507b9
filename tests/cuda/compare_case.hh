// The comparison of a device provider with the built-in one on random cases (docs/cuda.md): every
// output of dispatch, cached dispatch and combine, bit for bit. Used by the host run of the CUDA
// provider's algorithm (elastic_device_sim_test) and by the GPU test (gpu/). The built-in
// provider is the independent reference: the two share no routing, planning or reduction code.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "reference/dense_reference.hh"
#include "support/elastic_harness.hh"

namespace moe_ep::testing {

std::uint16_t combine_value(int rank, std::int64_t row, std::int64_t h) {
  std::uint64_t z = (static_cast<std::uint64_t>(rank) << 40) ^ (static_cast<std::uint64_t>(row) << 20) ^
                    static_cast<std::uint64_t>(h);
  z = (z ^ (z >> 31)) * 0x9e3779b97f4a7c15ull;
  z ^= z >> 29;
  // Finite BF16 values of mixed sign and magnitude (exponents 100..150), so sums round.
  const auto exponent = static_cast<std::uint16_t>(100 + (z >> 8) % 51);
  return static_cast<std::uint16_t>(((z & 1) << 15) | (exponent << 7) | ((z >> 16) & 0x7f));
}

// Compares the first `rows` rows of two tensors of the same dtype and columns, byte for byte.
void expect_rows_equal(std::vector<std::string>& problems, const char* name, const TensorView& cpu, const TensorView& dev,
                       std::int64_t rows) {
  if (cpu.defined() != dev.defined()) {
    problems.push_back(fmt::format("{}: defined {} (cpu) vs {} (cuda)", name, cpu.defined(), dev.defined()));
    return;
  }
  if (!cpu.defined()) return;
  if (cpu.dtype() != dev.dtype() || cpu.ndim() != dev.ndim()) {
    problems.push_back(fmt::format("{}: {} (cpu) vs {} (cuda)", name, cpu.describe(), dev.describe()));
    return;
  }
  for (int d = 0; d < cpu.ndim(); ++d)
    if (cpu.size(d) != dev.size(d) || cpu.stride(d) != dev.stride(d)) {
      problems.push_back(fmt::format("{}: {} (cpu) vs {} (cuda)", name, cpu.describe(), dev.describe()));
      return;
    }
  const std::int64_t cols = cpu.ndim() > 1 ? cpu.size(1) : 1;
  const std::size_t es = element_size(cpu.dtype());
  for (std::int64_t r = 0; r < std::min(rows, cpu.ndim() ? cpu.size(0) : 1); ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t off = r * cpu.stride(0) + (cpu.ndim() > 1 ? c * cpu.stride(1) : 0);
      if (std::memcmp(static_cast<const std::byte*>(cpu.data()) + off * static_cast<std::int64_t>(es),
                      static_cast<const std::byte*>(dev.data()) + off * static_cast<std::int64_t>(es), es) != 0) {
        problems.push_back(fmt::format("{}: element [{}, {}] differs", name, r, c));
        return;
      }
    }
}

struct CaseFlags {
  bool cpu_sync = true;
  bool zero_padding = false;
  bool col_major = false;
  bool handle_copy = true;
};

// One case on in-process ranks: the built-in provider and the one `make` builds (an object with
// dispatch, combine and destroy), same inputs; `Mover` puts host views on the device (in) and
// brings device tensors back (out), keeping what it allocated until it is destroyed. Returns every
// rank's mismatches.
// Long: one case's every output, in the order of the result structs, on every rank.
template <class Mover, class Make>
std::vector<std::string> compare_case(const reference::CaseSpec& spec, const CaseFlags& flags, Make make) {
  std::vector<std::string> all;
  std::mutex mu;
  LocalWorld world(spec.ranks);
  world.run([&](Group& group) {
    std::vector<std::string> problems;
    const int rank = group.rank();
    const reference::RankInputs in = reference::make_inputs(spec, rank);
    ElasticBufferConfig config;
    config.num_max_tokens_per_rank = spec.max_tokens;
    config.hidden = spec.hidden;
    config.num_topk = spec.k;
    config.use_fp8_dispatch = spec.fp8;
    config.allow_multiple_reduction = spec.multi;
    config.num_cpu_timeout_secs = 60;
    ElasticBuffer cpu(group, config);
    auto dev_owner = make(group, config);
    auto& dev = *dev_owner;
    Mover mover;
    const int n = in.num_tokens, k = spec.k;
    const DType x_dtype = spec.fp8 ? DType::kFP8E4M3
                          : spec.payload_element_bytes == 1 ? DType::kUInt8
                          : spec.payload_element_bytes == 4 ? DType::kFP32
                                                            : DType::kBF16;
    std::vector<std::uint8_t> x = in.x;
    std::vector<std::uint32_t> scales = in.scales;
    std::vector<std::int64_t> topk = in.topk;
    std::vector<float> weights = in.weights;
    std::vector<std::int32_t> stats_cpu(static_cast<size_t>(spec.experts_per_rank()), 7), stats_dev = stats_cpu;
    const std::int64_t H = spec.hidden;
    DispatchArgs args;
    args.x = TensorView(x.data(), x_dtype, {n, H});
    if (spec.fp8) args.x_scales = TensorView(scales.data(), DType::kFP32, {n, spec.scale_cols});
    args.topk_idx = TensorView(topk.data(), DType::kInt64, {n, k});
    if (spec.weights) args.topk_weights = TensorView(weights.data(), DType::kFP32, {n, k});
    args.num_experts = spec.num_experts;
    args.expert_alignment = spec.alignment;
    args.do_expand = spec.expand;
    args.do_cpu_sync = flags.cpu_sync;
    args.do_zero_padding = flags.zero_padding;
    args.use_tma_aligned_col_major_sf = flags.col_major;
    args.do_handle_copy = flags.handle_copy;
    DispatchArgs dargs = args;
    // Each rank calls on its own stream where the mover has one (a GPU: docs/cuda.md, Streams).
    std::uintptr_t stream = 0;
    if constexpr (requires { mover.stream(); }) stream = mover.stream();
    dargs.stream = stream;
    auto on_dev = [&](const TensorView& v) { return v.defined() ? mover.in(v) : v; };
    dargs.x = on_dev(args.x);
    dargs.x_scales = on_dev(args.x_scales);
    dargs.topk_idx = on_dev(args.topk_idx);
    dargs.topk_weights = on_dev(args.topk_weights);
    args.cumulative_local_expert_recv_stats = TensorView(stats_cpu.data(), DType::kInt32, {spec.experts_per_rank()});
    dargs.cumulative_local_expert_recv_stats =
        mover.in(TensorView(stats_dev.data(), DType::kInt32, {spec.experts_per_rank()}));
    const DispatchResult a = cpu.dispatch(args);
    DispatchResult b = dev.dispatch(dargs);
    mover.read_back(dargs.cumulative_local_expert_recv_stats, stats_dev.data());
    const std::shared_ptr<EPHandle> device_handle = b.handle;
    b = mover.out(b);
    const EPHandle& ha = *a.handle;
    const EPHandle& hb = *b.handle;
    auto scalar = [&](const char* name, std::int64_t x1, std::int64_t x2) {
      if (x1 != x2) problems.push_back(fmt::format("{}: {} (cpu) vs {} (cuda)", name, x1, x2));
    };
    scalar("num_recv_tokens", ha.num_recv_tokens, hb.num_recv_tokens);
    scalar("num_expanded_tokens", ha.num_expanded_tokens, hb.num_expanded_tokens);
    if (ha.num_recv_tokens_per_expert_list != hb.num_recv_tokens_per_expert_list)
      problems.push_back("num_recv_tokens_per_expert_list differs");
    const TensorView& unaligned = ha.num_unaligned_recv_tokens_per_expert;
    std::int64_t real_rows = 0, real_expanded = 0;
    expect_rows_equal(problems, "num_unaligned_recv_tokens_per_expert", unaligned, hb.num_unaligned_recv_tokens_per_expert, 1 << 30);
    expect_rows_equal(problems, "psum_num_recv_tokens_per_expert", ha.psum_num_recv_tokens_per_expert,
                      hb.psum_num_recv_tokens_per_expert, 1 << 30);
    expect_rows_equal(problems, "psum_num_recv_tokens_per_scaleup_rank", ha.psum_num_recv_tokens_per_scaleup_rank,
                      hb.psum_num_recv_tokens_per_scaleup_rank, 1 << 30);
    real_rows = ha.psum_num_recv_tokens_per_scaleup_rank.data_as<std::int32_t>()[spec.ranks - 1];
    for (int l = 0; l < spec.experts_per_rank(); ++l)
      real_expanded += (unaligned.data_as<std::int32_t>()[l] + spec.alignment - 1) / spec.alignment * spec.alignment;
    const std::int64_t out_rows = spec.expand ? (flags.zero_padding ? real_expanded : 0) : real_rows;
    if (spec.expand && !flags.zero_padding) {
      // Padding rows are uninitialised: compare the rows each expert holds.
      const auto* start = ha.psum_num_recv_tokens_per_expert.data_as<std::int32_t>();
      for (int l = 0; l < spec.experts_per_rank(); ++l) {
        const std::int64_t c = unaligned.data_as<std::int32_t>()[l];
        const std::int64_t first = start[l] - c;
        for (std::int64_t r = first; r < start[l]; ++r) {
          auto row = [&](const TensorView& t) {
            return t.ndim() == 2 ? TensorView(static_cast<std::byte*>(t.data()) + r * t.stride(0) * static_cast<std::int64_t>(element_size(t.dtype())),
                                              t.dtype(), {1, t.size(1)})
                                 : TensorView(static_cast<std::byte*>(t.data()) + r * static_cast<std::int64_t>(element_size(t.dtype())), t.dtype(), {1});
          };
          expect_rows_equal(problems, "recv_x (expanded)", row(a.recv_x), row(b.recv_x), 1);
          if (spec.weights) expect_rows_equal(problems, "recv_topk_weights (expanded)", row(a.recv_topk_weights), row(b.recv_topk_weights), 1);
        }
      }
      if (spec.fp8 && !flags.col_major) {
        for (int l = 0; l < spec.experts_per_rank(); ++l) {
          const std::int64_t c = unaligned.data_as<std::int32_t>()[l], first = start[l] - c;
          TensorView sa(static_cast<std::uint32_t*>(a.recv_x_scales.data()) + first * spec.scale_cols, DType::kFP32, {c, spec.scale_cols});
          TensorView sb(static_cast<std::uint32_t*>(b.recv_x_scales.data()) + first * spec.scale_cols, DType::kFP32, {c, spec.scale_cols});
          expect_rows_equal(problems, "recv_x_scales (expanded)", sa, sb, c);
        }
      }
    } else {
      expect_rows_equal(problems, "recv_x", a.recv_x, b.recv_x, out_rows);
      if (!flags.col_major) expect_rows_equal(problems, "recv_x_scales", a.recv_x_scales, b.recv_x_scales, out_rows);
      expect_rows_equal(problems, "recv_topk_weights", a.recv_topk_weights, b.recv_topk_weights, out_rows);
    }
    if (spec.fp8 && flags.col_major && !spec.expand) {
      for (std::int64_t r = 0; r < real_rows; ++r)
        for (int p = 0; p < spec.scale_cols; ++p)
          if (a.recv_x_scales.data_as<std::uint32_t>()[p * a.recv_x_scales.stride(1) + r] !=
              b.recv_x_scales.data_as<std::uint32_t>()[p * b.recv_x_scales.stride(1) + r])
            problems.push_back(fmt::format("recv_x_scales (column-major) [{}, {}] differs", r, p));
      scalar("recv_x_scales column stride", a.recv_x_scales.stride(1), b.recv_x_scales.stride(1));
    }
    // Every row of these, past the real count too (-1 there).
    expect_rows_equal(problems, "recv_topk_idx", a.recv_topk_idx, b.recv_topk_idx, 1 << 30);
    expect_rows_equal(problems, "recv_src_metadata", ha.recv_src_metadata, hb.recv_src_metadata, 1 << 30);
    expect_rows_equal(problems, "dst_buffer_slot_idx", ha.dst_buffer_slot_idx, hb.dst_buffer_slot_idx, 1 << 30);
    expect_rows_equal(problems, "topk_idx (handle)", ha.topk_idx, hb.topk_idx, 1 << 30);
    if (stats_cpu != stats_dev) problems.push_back("cumulative_local_expert_recv_stats differ");
    if (device_handle->topk_idx.device().device_type != kDLCUDA)
      problems.push_back("the handle's topk_idx is not a device tensor");

    // Cached replay with new inputs.
    for (auto& v : x) v = static_cast<std::uint8_t>(v * 7 + 3);
    for (auto& w : weights) w = w * 0.5f + 1.0f;
    DispatchArgs cargs;
    cargs.x = args.x;
    cargs.x_scales = args.x_scales;
    cargs.topk_weights = args.topk_weights;
    cargs.expert_alignment = spec.alignment;
    cargs.do_expand = spec.expand;
    cargs.handle = a.handle;
    DispatchArgs cdargs = cargs;
    cdargs.stream = stream;
    cdargs.x = on_dev(cargs.x);
    cdargs.x_scales = on_dev(cargs.x_scales);
    cdargs.topk_weights = on_dev(cargs.topk_weights);
    cdargs.handle = device_handle;
    const DispatchResult ca = cpu.dispatch(cargs);
    const DispatchResult cb = mover.out(dev.dispatch(cdargs));
    if (!spec.expand) {
      expect_rows_equal(problems, "cached recv_x", ca.recv_x, cb.recv_x, real_rows);
      expect_rows_equal(problems, "cached recv_topk_weights", ca.recv_topk_weights, cb.recv_topk_weights, real_rows);
      expect_rows_equal(problems, "cached recv_topk_idx", ca.recv_topk_idx, cb.recv_topk_idx, 1 << 30);
    }

    // Combine: the same expert outputs for both.
    const std::int64_t rows = spec.expand ? ha.num_expanded_tokens : ha.num_recv_tokens;
    std::vector<std::uint16_t> y(static_cast<size_t>(rows * H));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t h = 0; h < H; ++h) y[static_cast<size_t>(r * H + h)] = combine_value(rank, r, h);
    std::vector<float> cw(static_cast<size_t>(spec.expand ? rows : rows * k));
    for (std::size_t i = 0; i < cw.size(); ++i) cw[i] = static_cast<float>(i % 13) * 0.25f - 1.0f;
    std::vector<std::vector<std::uint16_t>> bias = in.bias;
    CombineArgs c1;
    c1.x = TensorView(y.data(), DType::kBF16, {rows, H});
    c1.handle = a.handle;
    if (spec.weights)
      c1.topk_weights = spec.expand ? TensorView(cw.data(), DType::kFP32, {rows}) : TensorView(cw.data(), DType::kFP32, {rows, k});
    for (auto& bb : bias) c1.bias.push_back(TensorView(bb.data(), DType::kBF16, {n, H}));
    CombineArgs c2 = c1;
    c2.handle = device_handle;
    c2.stream = stream;
    c2.x = on_dev(c1.x);
    c2.topk_weights = on_dev(c1.topk_weights);
    for (auto& v : c2.bias) v = on_dev(v);
    const CombineResult ra = cpu.combine(c1);
    const CombineResult rb = mover.out(dev.combine(c2));
    expect_rows_equal(problems, "combined_x", ra.combined_x, rb.combined_x, n);
    expect_rows_equal(problems, "combined_topk_weights", ra.combined_topk_weights, rb.combined_topk_weights, n);
    dev.destroy();
    std::lock_guard<std::mutex> lock(mu);
    for (auto& p : problems) all.push_back(fmt::format("rank {}: {}", rank, p));
  });
  return all;
}


// The random cases of the host and GPU tests: ranks 1 to 8, every layout and dtype the seeds
// draw, CPU sync, zero padding, column-major scales and handle copies varied by case number.
template <class Mover, class Make>
void expect_random_cases_match(Make make, int cases = 60) {
  for (int c = 0; c < cases; ++c) {
    RunOptions options;
    const int ranks = 1 + c % 8;
    reference::CaseSpec spec = random_case(0xC0DA0000u + static_cast<std::uint64_t>(c), ranks, 1, &options);
    CaseFlags flags;
    flags.cpu_sync = c % 3 != 2;
    flags.zero_padding = spec.expand && c % 4 == 1;
    flags.col_major = spec.fp8 && c % 5 == 3;
    flags.handle_copy = c % 6 != 4;
    const std::vector<std::string> problems = compare_case<Mover>(spec, flags, make);
    std::string all;
    for (std::size_t i = 0; i < problems.size() && i < 12; ++i) all += problems[i] + "\n";
    EXPECT_TRUE(problems.empty()) << "case " << c << " (" << describe(spec, options) << ", cpu_sync " << flags.cpu_sync
                                  << ", zero_padding " << flags.zero_padding << ", col_major " << flags.col_major
                                  << "):\n"
                                  << all;
  }
}

}  // namespace moe_ep::testing
