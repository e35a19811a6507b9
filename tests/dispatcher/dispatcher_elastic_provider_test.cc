// make_elastic_backend (moe_ep/elastic_provider.hpp): the provider of a V2 buffer built outside
// the token dispatcher, agreed by every rank. The built-in provider when no rank asks for CUDA
// (its backend answers with the ElasticBuffer behind it); a provider library named "cuda" (built
// by the test suite, its own backend class over the built-in buffer) when every rank does; ranks
// that would use different providers, a rank's refusal and a CUDA provider a rank cannot use
// fail on every rank, naming the ranks.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "moe_ep/elastic_provider.hpp"
#include "moe_ep/error.hpp"
#include "support/dispatcher_fixture.hh"
#include "support/text.hh"

namespace moe_ep::testing {
namespace {

const std::string kCudaNamed = MOE_EP_TEST_provider_cuda_named;

ElasticBufferConfig small_config(bool allow_hybrid_mode = true) {
  return {.num_max_tokens_per_rank = 8, .hidden = 256, .num_topk = 2, .allow_hybrid_mode = allow_hybrid_mode,
          .explicitly_destroy = true};
}

void expect(bool ok, const std::string& what, std::vector<std::string>& bad) {
  if (!ok) bad.push_back(what);
}

TEST(ElasticProvider, BuiltinWhenNoRankAsksForCuda) {
  for (const bool hybrid : {true, false}) {
    run_ranks(4, Topology{2, 2}, [&](Group& g, std::vector<std::string>& bad) {
      dispatcher::ElasticProvider p = dispatcher::make_elastic_backend(g, small_config(hybrid), {.why_host = "none"});
      expect(p.table == &provider::builtin(), "not the built-in table", bad);
      ElasticBuffer* buffer = dispatcher::builtin_elastic_buffer(p.backend.get());
      expect(buffer != nullptr, "no built-in ElasticBuffer behind the backend", bad);
      // Two nodes of two ranks: the hybrid path spans both nodes, the direct one is one domain.
      const std::pair<int, int> logical = hybrid ? std::pair{2, 2} : std::pair{1, 4};
      expect(p.backend->get_logical_domain_size() == logical, "logical domain", bad);
      if (buffer != nullptr) {
        expect(p.backend->num_allocated_qps() == buffer->num_allocated_qps(), "num_allocated_qps", bad);
        expect(p.backend->get_theoretical_num_qps(3) == buffer->get_theoretical_num_qps(3), "theoretical qps", bad);
        expect(p.backend->get_theoretical_num_sms(8, 2, 0, 1, 1, 1, 1) ==
                   buffer->get_theoretical_num_sms(8, 2, 0, 1, 1, 1, 1),
               "theoretical sms", bad);
      }
      p.backend->barrier();
      p.backend->destroy();
    });
  }
}

TEST(ElasticProvider, TheCudaProviderWhenEveryRankAsks) {
  run_ranks(2, {}, [&](Group& g, std::vector<std::string>& bad) {
    dispatcher::ElasticProvider p =
        dispatcher::make_elastic_backend(g, small_config(), {.cuda = true, .path_list = kCudaNamed});
    expect(p.table != nullptr && std::string(p.table->name) == "cuda", "not the provider named cuda", bad);
    expect(dispatcher::builtin_elastic_buffer(p.backend.get()) == nullptr, "its backend is not the built-in one", bad);
    expect(p.backend->get_logical_domain_size() == std::pair{1, 2}, "logical domain", bad);
    p.backend->barrier();
    p.backend->destroy();
  });
}

TEST(ElasticProvider, RanksThatWouldUseDifferentProvidersFailOnEveryRank) {
  run_ranks(3, {}, [&](Group& g, std::vector<std::string>& bad) {
    dispatcher::ElasticProviderRequest request{.cuda = true, .path_list = kCudaNamed};
    if (g.rank() == 1) request = {.why_host = "no device on this host"};
    const Caught c = catch_error([&] { dispatcher::make_elastic_backend(g, small_config(), request); });
    const std::string expected =
        "[rank " + std::to_string(g.rank()) +
        "] ElasticBuffer: provider choice: ranks disagree on the provider: 'cpu' on rank [1], 'cuda' on ranks "
        "[0, 2]; rank 1: no device on this host; every rank needs the CUDA provider, or none";
    const std::vector<int> blamed = g.rank() == 1 ? std::vector<int>{0, 2} : std::vector<int>{1};
    if (c.type != "PeerError" || c.message != expected || c.ranks != blamed) bad.push_back(c.type + ": " + c.message);
  });
}

TEST(ElasticProvider, ARefusalOrAnUnusableCudaProviderFailsEveryRank) {
  run_ranks(2, {}, [&](Group& g, std::vector<std::string>& bad) {
    const std::string refusal = "[rank 0] ElasticBuffer: torch's current device is cuda:1, not cuda:0";
    const Caught c = catch_error([&] {
      dispatcher::make_elastic_backend(
          g, small_config(), {.cuda = true, .refusal = g.rank() == 0 ? refusal : "", .path_list = kCudaNamed});
    });
    if (g.rank() == 0 && (c.type != "InvalidArgument" || c.message != refusal))
      bad.push_back("refusal: " + c.type + ": " + c.message);
    if (g.rank() == 1 && (c.type != "PeerError" || c.ranks != std::vector<int>{0} || !contains(c.message, refusal)))
      bad.push_back("refusal, peer: " + c.type + ": " + c.message);
  });
  run_ranks(2, {}, [&](Group& g, std::vector<std::string>& bad) {
    // MOE_EP_PROVIDER_PATH=cpu resolves V2 to the built-in provider: no CUDA provider for rank 1.
    dispatcher::ElasticProviderRequest request{.why_host = "asked for none"};
    if (g.rank() == 1) request = {.cuda = true, .path_list = "cpu"};
    const Caught c = catch_error([&] { dispatcher::make_elastic_backend(g, small_config(), request); });
    const std::string reason = "[rank 1] ElasticBuffer: the CUDA provider is not usable: MOE_EP_PROVIDER_PATH = 'cpu' "
                               "gives V2 to provider 'cpu'";
    if (g.rank() == 1 && (c.type != "StateError" || !contains(c.message, reason)))
      bad.push_back("unusable: " + c.type + ": " + c.message);
    if (g.rank() == 0 && (c.type != "PeerError" || c.ranks != std::vector<int>{1} || !contains(c.message, reason)))
      bad.push_back("unusable, peer: " + c.type + ": " + c.message);
  });
}

}  // namespace
}  // namespace moe_ep::testing
