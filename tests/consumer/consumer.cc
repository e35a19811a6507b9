// Consumer of an installed moe-ep: a 2-rank in-process ElasticBuffer dispatch + combine checked
// against the sum over top-k (consumer_case.hpp), the provider agreement of a V2 buffer built
// outside the dispatcher (moe_ep/elastic_provider.hpp: the built-in provider when no rank asks for
// CUDA), and the version the headers and the library report. Prints "consumer: ... OK" and exits 0
// on success.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>

#include <moe_ep/elastic_provider.hpp>
#include <moe_ep/group.hpp>
#include <moe_ep/version.hpp>

#include "consumer_case.hpp"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], MOE_EP_VERSION_STRING) != 0) {
    std::fprintf(stderr, "consumer: headers are version %s, expected %s\n", MOE_EP_VERSION_STRING, argv[1]);
    return 1;
  }
  if (std::strcmp(moe_ep::version(), MOE_EP_VERSION_STRING) != 0) {
    std::fprintf(stderr, "consumer: library version %s, headers %s\n", moe_ep::version(), MOE_EP_VERSION_STRING);
    return 1;
  }
  std::atomic<int> mismatches{0};
  try {
    moe_ep::LocalWorld world(2);
    world.run([&](moe_ep::Group& group) { mismatches += consumer::run_case(group); });
    world.run([&](moe_ep::Group& group) {
      const moe_ep::ElasticBufferConfig config{.num_max_tokens_per_rank = 4, .hidden = 128, .explicitly_destroy = true};
      moe_ep::dispatcher::ElasticProvider made =
          moe_ep::dispatcher::make_elastic_backend(group, config, {.why_host = "the consumer asks for none"});
      if (std::strcmp(made.table->name, "cpu") != 0 || moe_ep::dispatcher::builtin_elastic_buffer(made.backend.get()) == nullptr)
        ++mismatches;
      made.backend->destroy();
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  if (mismatches != 0) {
    std::fprintf(stderr, "consumer: %d mismatching elements\n", mismatches.load());
    return 1;
  }
  std::printf("consumer: moe-ep %s, 2 ranks, dispatch + combine, provider agreement: OK\n", moe_ep::version());
  return 0;
}
