// The provider behind a V2 buffer that a caller builds itself, outside the token dispatcher: the
// Python ElasticBuffer, which moves host tensors on the built-in provider and CUDA tensors on the
// CUDA provider (docs/python.md, "CUDA tensors").
//
// make_elastic_backend is collective: every rank states which provider it wants (and why not the
// CUDA one, or why it cannot build a buffer at all), the ranks agree, and only then is the buffer
// built, by the agreed provider, on every rank. A rank that cannot build it (its refusal, or a
// CUDA provider it cannot use) raises its own error and every other rank a PeerError naming it;
// ranks that would use different providers all raise PeerError naming which ranks use which, as
// the token dispatcher's buffer cache does (docs/dispatcher.md, "Agreement"). No rank is left
// waiting either way.
#pragma once

#include <memory>
#include <string>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::dispatcher {

// The CUDA provider for a caller that moves device tensors itself: when `path_list` is non-empty,
// the V2 provider it resolves to (as the dispatcher resolves MOE_EP_PROVIDER_PATH), used only
// when that provider is the one named "cuda"; when empty, libmoe_ep_cuda.so beside libmoe_ep.so
// (the build tree's, or the installed one). Never throws: `table` is null when none is usable,
// and `reason` then says why (no library, an init that found no device, another provider first).
struct DeviceProvider {
  const provider::Table* table = nullptr;
  std::string origin;  // the library's path
  std::string reason;
};
DeviceProvider find_cuda_provider(const std::string& path_list);

// What one rank asks of make_elastic_backend.
struct ElasticProviderRequest {
  bool cuda = false;     // the CUDA provider (else the built-in one)
  std::string why_host;  // without cuda: why (quoted when the ranks disagree)
  // Non-empty: this rank cannot build the buffer (the caller's check failed): InvalidArgument with
  // this message here, PeerError naming this rank on the others.
  std::string refusal;
  std::string path_list;  // with cuda: where the CUDA provider is looked for (find_cuda_provider)
};

struct ElasticProvider {
  const provider::Table* table = nullptr;  // the agreed provider (provider::builtin() or the CUDA one)
  std::unique_ptr<provider::ElasticBackend> backend;
};

// Collective over `group`: agrees on the provider (the agreement's wait is bounded by
// config.num_cpu_timeout_secs), then builds the buffer with it (collective too). On return every
// rank has the same provider, and it is the CUDA one exactly where request.cuda was set.
ElasticProvider make_elastic_backend(Group& group, const ElasticBufferConfig& config,
                                     const ElasticProviderRequest& request);

// The ElasticBuffer behind a backend the built-in provider made (providers that hand out the
// built-in table's objects included), or null for another provider's backend. What only the
// built-in buffer offers (Engram storage, PP, all-gather sessions, DispatchExtras and
// CombineExtras) is reached through it.
ElasticBuffer* builtin_elastic_buffer(provider::ElasticBackend* backend);

}  // namespace moe_ep::dispatcher
