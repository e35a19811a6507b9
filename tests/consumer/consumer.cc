// Consumer of an installed moe-ep: a 2-rank in-process ElasticBuffer dispatch + combine checked
// against the sum over top-k (consumer_case.hpp), and the version the headers and the library
// report. Prints "consumer: OK" and exits 0 on success.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>

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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  if (mismatches != 0) {
    std::fprintf(stderr, "consumer: %d mismatching elements\n", mismatches.load());
    return 1;
  }
  std::printf("consumer: moe-ep %s, 2 ranks, dispatch + combine: OK\n", moe_ep::version());
  return 0;
}
