// Weights of experts on the other logical node through the dispatcher's V2 paths (MOE_EP_USE_V2=1,
// two nodes of two ranks, hybrid and direct, with and without multiple reduction, all from the
// environment): in the normal and expanded formats every row received from the other node
// carries its source's weights at the local lanes (0 elsewhere), and in the low-latency format
// the combine applies the weight of every lane, remote ones included — against the references.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/env_scope.hh"
#include "support/dispatcher_fixture.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep::testing {
namespace dispatcher_remote_weights_test {

constexpr int kRanks = 4, kExperts = 8, kTopk = 3, kTokens = 5, kHidden = 256;

// Rank r (node r / 2): experts of d are 2d and 2d + 1. Tokens whose experts are all on the other
// node, mixed ones, and two experts of one remote rank.
std::vector<std::int64_t> routing(int r) {
  const int other = (r / 2 == 0) ? 2 : 0, peer = r ^ 1;
  const std::int64_t o0 = 2 * other, o1 = 2 * (other + 1);  // first expert of each rank of the other node
  return {o0,     o1 + 1, -1,          // all remote
          o1,     2 * r + 1, o0 + 1,   // mixed
          2 * peer, o0,    o1 + 1,     // own node's other rank, then remote
          -1,     o1 + 1, -1,          // one remote lane
          o0 + 1, o0,     o1};         // two experts of one remote rank
}

DispatcherOptions shape() {
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.num_max_dispatch_tokens_per_rank = kTokens;
  o.num_max_prefill_tokens_per_rank = kTokens;
  o.timeout_secs = 60;
  o.provider_path = "cpu";
  return o;
}

TEST(DispatcherV2RemoteWeights, EveryFormatCarriesTheRemoteWeights) {
  ScopedEnvironment v2("MOE_EP_USE_V2", "1");
  const struct {
    const char* mode;
    const char* layout;
    BatchKind kind;
  } formats[] = {{"normal", "compact", BatchKind::kPrefill},
                 {"normal", "expanded", BatchKind::kPrefill},
                 {"low_latency", "compact", BatchKind::kDecode}};
  std::uint64_t seed = 300;
  for (const auto& f : formats)
    for (const char* hybrid : {"1", "0"})
      for (const char* multi : {"1", "0"}) {
        ScopedEnvironment mode("MOE_EP_MODE", f.mode), layout("MOE_EP_V2_NORMAL_LAYOUT", f.layout),
            hybrid_env("MOE_EP_V2_ALLOW_HYBRID_MODE", hybrid), multi_env("MOE_EP_V2_ALLOW_MULTIPLE_REDUCTION", multi);
        const std::string label = fmt::format("{} {} hybrid {} multiple reduction {}", f.mode, f.layout, hybrid, multi);
        CaseSpec s = make_spec(kRanks, 2, kExperts, kTopk, kTokens, kHidden, seed++, [](int) { return kTokens; });
        s.mask_ratio = 0.0;  // every lane's weight drawn
        for (int r = 0; r < kRanks; ++r) s.fixed_topk.push_back(routing(r));
        run_ranks(kRanks, {.num_scaleout = 2}, [&](Group& g, std::vector<std::string>& bad) {
          BufferCache cache(g);
          TokenDispatcher d(cache, shape());
          if (d.generation() != Generation::kV2) bad.push_back(label + ": MOE_EP_USE_V2=1 was not taken");
          std::vector<RankInputs> all = reference::make_all_inputs(s);
          const Inputs in = to_tensors(s, all[static_cast<size_t>(g.rank())]);
          const Expectation e = expectation(d.options());
          const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, f.kind);
          std::vector<std::string> problems;
          check_dispatch(s, e, all, g.rank(), out, problems);
          // The weights of rows from the other node, one by one (check_dispatch covers them too;
          // this makes sure the case has such rows with non-zero weights).
          const int me = g.rank(), El = kExperts / kRanks;
          int remote_weights = 0;
          if (out.format == OutputFormat::kNormal) {
            CaseSpec compact = s;
            compact.allow_hybrid = e.hybrid;
            const auto ref = reference::reference_dispatch(compact, all, me);
            for (std::size_t i = 0; i < ref.rows.size(); ++i) {
              if (ref.rows[i].source / 2 == me / 2) continue;
              for (int j = 0; j < kTopk; ++j) {
                const std::int64_t id = all[static_cast<size_t>(ref.rows[i].source)].topk[static_cast<size_t>(ref.rows[i].token * kTopk + j)];
                const float want = id >= 0 && id / El == me ? all[static_cast<size_t>(ref.rows[i].source)].weights[static_cast<size_t>(ref.rows[i].token * kTopk + j)] : 0.0f;
                const float got = out.topk_weights.data_as<float>()[i * kTopk + static_cast<size_t>(j)];
                if (got != want) problems.push_back(fmt::format("row {} (rank {} token {}) lane {}: weight {}, expected {}", i,
                                                                ref.rows[i].source, ref.rows[i].token, j, got, want));
                remote_weights += want != 0.0f;
              }
            }
          } else if (out.format == OutputFormat::kV2Expanded) {
            CaseSpec expanded = s;
            expanded.expand = true;
            expanded.alignment = e.alignment;
            const auto ref = reference::reference_dispatch(expanded, all, me);
            for (int r = 0; r < ref.expanded_rows; ++r) {
              const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(r)];
              if (owner < 0 || ref.rows[static_cast<size_t>(owner)].source / 2 == me / 2) continue;
              const auto& row = ref.rows[static_cast<size_t>(owner)];
              const float want = all[static_cast<size_t>(row.source)].weights[static_cast<size_t>(row.token * kTopk + lane)];
              if (out.topk_weights.data_as<float>()[r] != want)
                problems.push_back(fmt::format("expanded row {} (rank {} token {} lane {}): weight {}, expected {}", r,
                                               row.source, row.token, lane, out.topk_weights.data_as<float>()[r], want));
              remote_weights += want != 0.0f;
            }
          } else {
            // Low-latency: the weights are applied in combine; count the remote lanes it weights.
            for (int t = 0; t < kTokens; ++t)
              for (int j = 0; j < kTopk; ++j) {
                const std::int64_t id = all[static_cast<size_t>(me)].topk[static_cast<size_t>(t * kTopk + j)];
                remote_weights += id >= 0 && id / El / 2 != me / 2 && all[static_cast<size_t>(me)].weights[static_cast<size_t>(t * kTopk + j)] != 0.0f;
              }
          }
          if (remote_weights == 0) problems.push_back("the case has no non-zero weight of another node's expert");
          const Tensor y = expert_outputs(s, e, all, me, out);
          const Tensor combined = d.combine(y);
          check_combined(expected_combine(s, e, all, me, out), combined, "combined", problems);
          for (auto& p : problems) bad.push_back(label + ": " + p);
        });
      }
}

}  // namespace dispatcher_remote_weights_test
}  // namespace moe_ep::testing
