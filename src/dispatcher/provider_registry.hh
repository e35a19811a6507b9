// Providers as probed, per path list (dispatcher-internal; the public view is ProbeReport), and the
// rule that every rank uses one provider.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/elastic_provider.hpp"
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

// Throws PeerError when the ranks would use different providers (`provider_of_rank`: each rank's
// provider, by rank; `me`: this rank): comm::disagreement's text, "<context>: ranks disagree on
// the provider<purpose>: '<a>' on rank [0], '<b>' on ranks [1, 2][; <note>]", naming the ranks
// whose provider is not this rank's. The one rule of the buffer cache's agreement and
// make_elastic_backend's.
void check_one_provider(const std::string& context, const std::string& purpose,
                        const std::vector<std::string>& provider_of_rank, int me, const std::string& note = {});

}  // namespace moe_ep::dispatcher
