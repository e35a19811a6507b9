// Providers as probed, per path list (dispatcher-internal; the public view is ProbeReport).
#pragma once

#include <cstddef>
#include <string>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::dispatcher {

inline constexpr const char* kBuiltinEntry = "cpu";

// Provider names are 1 to kMaxProviderName printable ASCII characters; an init failure message
// is shown up to kMaxInitMessage characters.
inline constexpr std::size_t kMaxProviderName = 64;
inline constexpr std::size_t kMaxInitMessage = 4096;

// Checks a provider table that `entry` (a path list entry) handed out: ABI version and table
// size, the name, then runs its init. Fills `probe` (entry, name and offered generations, or
// the error) and returns whether the provider is usable. Never throws; reads nothing of the
// table beyond its first two fields unless they match this library's ABI.
bool accept_table(const std::string& entry, const provider::Table* table, ProviderProbe& probe);

// The table that serves `generation` for `path_list` (null when unavailable; the reason is in
// probe_providers(path_list)[generation]).
const provider::Table* provider_for(const std::string& path_list, Generation generation);

// The device provider for a caller that moves device tensors itself (the Python ElasticBuffer):
// when `path_list` is non-empty, the V2 provider it resolves to (as the dispatcher resolves it),
// used only when that provider is the one named "cuda"; when empty, libmoe_ep_cuda.so beside this
// library (the build tree's, or the installed one). `table` is null when none is usable, and
// `reason` then says why (no library, an init that found no device, another provider first).
struct DeviceProvider {
  const provider::Table* table = nullptr;
  std::string origin;  // the library's path
  std::string reason;
};
DeviceProvider find_cuda_provider(const std::string& path_list);

// The ElasticBuffer behind a backend the built-in provider made (providers that hand out the
// built-in tables' objects included), or null for another provider's backend.
ElasticBuffer* builtin_elastic_buffer(provider::ElasticBackend* backend);

}  // namespace moe_ep::dispatcher
