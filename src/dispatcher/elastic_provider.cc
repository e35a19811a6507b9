// make_elastic_backend: the provider agreement of a V2 buffer built outside the token dispatcher
// (moe_ep/elastic_provider.hpp), then the buffer.
#include "moe_ep/elastic_provider.hpp"

#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "core/timeout.hh"
#include "dispatcher/provider_registry.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::dispatcher {
namespace {

constexpr std::size_t kNameBytes = 72;  // a provider name (at most kMaxProviderName) and its NUL
constexpr std::size_t kWhyBytes = 240;
static_assert(kNameBytes > kMaxProviderName);

// What each rank publishes in the agreement.
struct Published {
  char provider[kNameBytes];
  char why_host[kWhyBytes];  // (truncated) why a rank without cuda has none
};

std::string text_of(const char* field, std::size_t bytes) { return std::string(field, strnlen(field, bytes)); }

// Every rank learns every rank's provider; a rank's local error raises on every rank (its own
// error here, PeerError naming it elsewhere), and so do ranks that would use different providers.
void agree(Group& group, const ElasticBufferConfig& config, const ElasticProviderRequest& request,
           const provider::Table& wanted, std::exception_ptr local) {
  const std::string ctx = fmt::format("[rank {}] ElasticBuffer: provider choice", group.rank());
  Published mine{};
  std::strncpy(mine.provider, wanted.name, kNameBytes - 1);
  if (!request.cuda) std::strncpy(mine.why_host, request.why_host.c_str(), kWhyBytes - 1);
  comm::Agreement agreement(ctx, "ElasticBuffer provider");
  agreement.local_error(local);
  const double timeout = core::checked_timeout(ctx, "num_cpu_timeout_secs", config.num_cpu_timeout_secs);
  const auto blocks = agreement.exchange(group.transport(), comm::Scope::kWorld, {"ElasticBuffer: provider", timeout},
                                         {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  std::vector<std::string> providers;
  std::string why;
  for (std::size_t r = 0; r < blocks.size(); ++r) {
    Published p;
    std::memcpy(&p, blocks[r].data(), sizeof p);
    providers.push_back(text_of(p.provider, kNameBytes));
    const std::string reason = text_of(p.why_host, kWhyBytes);
    if (why.empty() && !reason.empty()) why = fmt::format("rank {}: {}", r, reason);
  }
  check_one_provider(ctx, "", providers, group.rank(),
                     fmt::format("{}every rank needs the CUDA provider, or none", why.empty() ? "" : why + "; "));
}

}  // namespace

ElasticProvider make_elastic_backend(Group& group, const ElasticBufferConfig& config,
                                     const ElasticProviderRequest& request) {
  const provider::Table* table = &provider::builtin();
  std::exception_ptr local;
  if (!request.refusal.empty()) {
    local = std::make_exception_ptr(InvalidArgument(request.refusal));
  } else if (request.cuda) {
    const DeviceProvider found = find_cuda_provider(request.path_list);
    if (found.table != nullptr) {
      table = found.table;
    } else {
      local = std::make_exception_ptr(StateError(
          fmt::format("[rank {}] ElasticBuffer: the CUDA provider is not usable: {}", group.rank(), found.reason)));
    }
  }
  // With an error on any rank every rank raises it (or PeerError naming the rank) in the
  // agreement, before providers are compared.
  agree(group, config, request, *table, local);
  ElasticProvider out;
  out.table = table;
  out.backend.reset(table->create_elastic(group, config));
  return out;
}

}  // namespace moe_ep::dispatcher
