// `moe-ep bench --provider cuda`: finds the CUDA provider library (the first entry of
// MOE_EP_PROVIDER_PATH that exports the bench entry, else the library built with this tool), and
// runs its bench (src/cuda/bench_entry.hh) with the bench's shape options.
#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.hh"
#include "cuda/bench_entry.hh"

namespace moe_ep::tools {

namespace {

using Entry = int (*)(const MoeEpCudaBenchOptions*);

std::vector<std::string> candidates() {
  std::vector<std::string> out;
  if (const char* list = std::getenv("MOE_EP_PROVIDER_PATH")) {
    const std::string s = list;
    for (std::size_t start = 0; start <= s.size();) {
      const std::size_t end = std::min(s.find(':', start), s.size());
      if (end > start && s.substr(start, end - start) != "cpu") out.push_back(s.substr(start, end - start));
      start = end + 1;
    }
  }
#ifdef MOE_EP_CUDA_PROVIDER_BUILT
  out.push_back(MOE_EP_CUDA_PROVIDER_BUILT);
#endif
  return out;
}

}  // namespace

int cuda_bench_command(const BenchOptions& o) {
  std::string tried;
  for (const std::string& path : candidates()) {
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      tried += fmt::format("\n  {}: {}", path, why ? why : "cannot load");
      continue;
    }
    auto entry = reinterpret_cast<Entry>(dlsym(library, kMoeEpCudaBenchSymbol));
    if (entry == nullptr) {
      tried += fmt::format("\n  {}: no {} (not the CUDA provider)", path, kMoeEpCudaBenchSymbol);
      continue;
    }
    const MoeEpCudaBenchOptions options{o.ranks, o.hidden, o.experts, o.topk, o.prefill_tokens, o.decode_tokens,
                                        o.prefill_iterations, o.decode_iterations, o.seed};
    const int rc = entry(&options);
    if (rc == 77) {
      std::fprintf(stderr, "moe-ep bench --provider cuda: no CUDA device on this machine\n");
      return 1;
    }
    return rc;
  }
  std::fprintf(stderr,
               "moe-ep bench --provider cuda: no CUDA provider library found (build with CUDA: docs/cuda.md, or name "
               "libmoe_ep_cuda.so in MOE_EP_PROVIDER_PATH)%s\n",
               tried.c_str());
  return 1;
}

}  // namespace moe_ep::tools
