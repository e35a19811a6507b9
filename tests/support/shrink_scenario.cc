#include "support/shrink_scenario.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <set>
#include <thread>

#include "moe_ep/legacy_buffer.hpp"
#include "reference/low_latency_reference.hh"
#include "support/errors.hh"
#include "support/legacy_harness.hh"

namespace moe_ep::testing {
namespace {

using At = ShrinkFailure::At;

// The inputs of the reference: lanes between a failed rank and any other (either side) are -1.
std::vector<reference::RankInputs> kept_inputs(const reference::CaseSpec& s, const std::set<int>& failed) {
  std::vector<reference::RankInputs> kept = reference::make_all_inputs(s);
  const int El = s.num_experts / s.ranks;
  for (int r = 0; r < s.ranks; ++r)
    for (std::int64_t& id : kept[static_cast<size_t>(r)].topk)
      if (id >= 0 && (failed.count(r) != 0 || failed.count(static_cast<int>(id / El)) != 0)) id = -1;
  return kept;
}

class Survivor {
 public:
  Survivor(Group& g, const ShrinkScenario& sc, std::vector<std::string>& bad)
      : g_(g), sc_(sc), s_(sc.spec), bad_(bad), me_(g.rank()),
        buffer_(g, {.num_rdma_bytes = low_latency_rdma_bytes(s_), .low_latency_mode = true, .explicitly_destroy = true,
                    .enable_shrink = true, .num_cpu_timeout_secs = sc.timeout_secs}) {}

  // Runs the rounds, or until this rank fails (it then does what its action says).
  void run() {
    for (int round = 0; round < sc_.rounds; ++round)
      if (!run_round(round)) return;
    if (sc_.survivors_done) sc_.survivors_done->fetch_add(1);
    buffer_.destroy();
  }

 private:
  // Fails here if this rank is the one that fails at `at`; marks every rank failing at `at`.
  bool fails(At at) {
    bool mine = false;
    for (const ShrinkFailure& f : sc_.failures) {
      if (f.at != at || failed_.count(f.rank) != 0) continue;
      failed_.insert(f.rank);
      if (f.rank == me_) {
        mine = true;
        act(f.action);
      }
    }
    return mine;
  }

  void act(FailureAction action) {
    switch (action) {
      case FailureAction::kDestroy:
        buffer_.destroy();
        break;
      case FailureAction::kReturn:
        break;  // the buffer's destructor leaves the exchange
      case FailureAction::kStop: {
        // Until every survivor is through its rounds (they find this rank by their timeout), or a
        // survivor failed and never gets there (the test reports that survivor's error).
        const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(10 * sc_.timeout_secs);
        while (sc_.survivors_done && sc_.survivors_done->load() < s_.ranks - static_cast<int>(sc_.failures.size()) &&
               std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        buffer_.destroy();
        break;
      }
      case FailureAction::kKill:
        std::raise(SIGKILL);
        break;
    }
  }

  void check_mask(const char* after) {
    Tensor status = Tensor::zeros({s_.ranks}, DType::kInt32);
    buffer_.low_latency_query_mask_buffer(status);
    std::set<int> masked;
    for (int r = 0; r < s_.ranks; ++r)
      if (status.data_as<std::int32_t>()[r] != 0) masked.insert(r);
    if (masked != failed_)
      bad_.push_back(fmt::format("after {}: the mask is [{}], expected [{}]", after, fmt::join(masked, ", "),
                                 fmt::join(failed_, ", ")));
  }

  bool run_round(int round) {
    reference::CaseSpec s = s_;
    s.seed = s_.seed + static_cast<std::uint64_t>(round);
    RankCall call(s, me_);
    if (fails(At::kDispatch)) return false;
    const std::vector<reference::RankInputs> at_dispatch = kept_inputs(s, failed_);
    LowLatencyDispatchResult d;
    for (int times = 0; times < 1 + round % 2; ++times)
      d = buffer_.low_latency_dispatch({.x = call.x, .topk_idx = call.topk, .num_max_dispatch_tokens_per_rank = s.max_tokens,
                                        .num_experts = s.num_experts, .use_fp8 = false});
    const std::int64_t rows = std::int64_t{s.ranks} * s.max_tokens;
    reference::check_slab(s, {.rows_per_expert = rows}, at_dispatch, me_, d.recv_x, d.recv_x_scales, d.packed_recv_count,
                          bad_);
    check_mask(fmt::format("dispatch of round {}", round).c_str());
    if (fails(At::kCombine)) return false;
    const Tensor y = reference::slab_expert_outputs(s, at_dispatch, me_, rows);
    const bool zero_copy = round % 2 == 1;
    if (zero_copy) {
      Tensor slab = buffer_.get_next_low_latency_combine_buffer(*d.handle);
      for (std::int64_t i = 0; i < y.size(0); ++i)
        for (std::int64_t r = 0; r < rows; ++r)
          std::memcpy(slab.data_as<std::uint16_t>() + i * slab.stride(0) + r * slab.stride(1),
                      y.data_as<const std::uint16_t>() + (i * rows + r) * s.hidden, static_cast<size_t>(s.hidden) * 2);
    }
    const LowLatencyCombineResult c = buffer_.low_latency_combine(
        {.x = y, .topk_idx = call.topk, .topk_weights = call.weights, .handle = d.handle, .zero_copy = zero_copy});
    const auto expected = reference::low_latency_combine_reference(s, kept_inputs(s, failed_)[static_cast<size_t>(me_)], me_);
    if (call.n > 0 && std::memcmp(c.combined_x.data(), expected.data(), expected.size() * 2) != 0)
      bad_.push_back(fmt::format("round {}: combined_x differs from the reference without ranks [{}]", round,
                                 fmt::join(failed_, ", ")));
    check_mask(fmt::format("combine of round {}", round).c_str());
    if (fails(At::kClean)) return false;
    buffer_.clean_low_latency_buffer(s.max_tokens, s.hidden, s.num_experts);
    check_mask(fmt::format("clean of round {}", round).c_str());
    return true;
  }

  Group& g_;
  const ShrinkScenario& sc_;
  const reference::CaseSpec& s_;
  std::vector<std::string>& bad_;
  int me_;
  Buffer buffer_;
  std::set<int> failed_;  // the ranks failed so far, as every survivor must see them
};

}  // namespace

void run_shrink_scenario(Group& g, const ShrinkScenario& scenario, std::vector<std::string>& bad) {
  const Caught c = catch_error([&] {
    Survivor(g, scenario, bad).run();
  });
  if (!c.type.empty()) bad.push_back(fmt::format("{}: {}", c.type, c.message));
}

}  // namespace moe_ep::testing
