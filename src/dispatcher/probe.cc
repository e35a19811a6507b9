// Loading providers (dlopen + a versioned entry symbol, as NCCL loads its network plugins) and
// probing which generations they offer. Nothing here throws: failures become reasons.
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <unistd.h>

#include "core/log.hh"
#include "dispatcher/provider_registry.hh"
#include "moe_ep/dispatcher.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::dispatcher {
namespace {

using Entry = const provider::Table* (*)();

std::vector<std::string> split_path_list(const std::string& list) {
  std::vector<std::string> entries;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t end = std::min(list.find(':', start), list.size());
    if (end > start) entries.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  if (entries.empty()) entries.push_back(kBuiltinEntry);
  return entries;
}

std::string offers(bool v1, bool v2) {
  if (v1 && v2) return "V1 and V2";
  if (v1) return "V1 only";
  if (v2) return "V2 only";
  return "neither V1 nor V2";
}

// Loads one entry; fills `probe` and returns the table when the provider is usable.
const provider::Table* load(const std::string& entry, ProviderProbe& probe) {
  probe.entry = entry;
  const provider::Table* table = nullptr;
  if (entry == kBuiltinEntry) {
    table = &provider::builtin();
  } else {
    dlerror();
    void* library = dlopen(entry.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      probe.error = fmt::format("{}: cannot load library: {}", entry, why ? why : "unknown error");
      return nullptr;
    }
    auto symbol = reinterpret_cast<Entry>(dlsym(library, provider::kEntrySymbol));
    if (symbol == nullptr) {
      std::string other;
      for (int abi = 0; abi < 16; ++abi) {
        if (static_cast<std::uint32_t>(abi) == provider::kAbiVersion) continue;
        const std::string name = fmt::format("moe_ep_provider_abi_{}", abi);
        if (dlsym(library, name.c_str()) != nullptr) other = fmt::format(" (it exports {}: built for ABI {})", name, abi);
      }
      probe.error = fmt::format("{}: missing symbol {}{}", entry, provider::kEntrySymbol,
                                other.empty() ? " (not a moe-ep provider)" : other);
      return nullptr;  // the library stays loaded: unloading foreign code is not always safe
    }
    table = symbol();
  }
  return accept_table(entry, table, probe) ? table : nullptr;
}

struct Probed {
  ProbeReport report;
  const provider::Table* v1 = nullptr;
  const provider::Table* v2 = nullptr;
};

Probed probe(const std::string& path_list) {
  Probed p;
  const std::vector<std::string> entries = split_path_list(path_list);
  p.report.path_list = path_list.empty() ? kBuiltinEntry : path_list;
  std::vector<std::string> v1_reasons, v2_reasons;
  for (const std::string& entry : entries) {
    ProviderProbe probe;
    const provider::Table* table = load(entry, probe);
    const std::string origin = entry == kBuiltinEntry ? "builtin" : entry;
    auto take = [&](GenerationProbe& g, const provider::Table*& slot, bool offered, std::vector<std::string>& reasons) {
      if (slot != nullptr) return;
      if (table != nullptr && offered) {
        slot = table;
        g = {true, probe.name, origin, ""};
      } else {
        reasons.push_back(table == nullptr ? probe.error
                                           : fmt::format("{} (provider '{}'): offers {}", entry, probe.name,
                                                         offers(probe.offers_v1, probe.offers_v2)));
      }
    };
    take(p.report.v1, p.v1, probe.offers_v1, v1_reasons);
    take(p.report.v2, p.v2, probe.offers_v2, v2_reasons);
    if (table == nullptr) {
      core::warn(core::Subsys::kInit, "dispatcher: provider {} skipped: {}", entry, probe.error);
    } else {
      core::info(core::Subsys::kInit, "dispatcher: provider {} ('{}') offers {}", origin, probe.name,
                 offers(probe.offers_v1, probe.offers_v2));
    }
    p.report.providers.push_back(std::move(probe));
  }
  auto join = [](const std::vector<std::string>& reasons) {
    std::string all;
    for (const auto& r : reasons) all += (all.empty() ? "" : "; ") + r;
    return all;
  };
  if (p.v1 == nullptr) p.report.v1.reason = join(v1_reasons);
  if (p.v2 == nullptr) p.report.v2.reason = join(v2_reasons);
  for (const auto* g : {&p.report.v1, &p.report.v2})
    if (g->available)
      core::info(core::Subsys::kInit, "dispatcher: {} from provider '{}' ({})", g == &p.report.v1 ? "V1" : "V2",
                 g->provider, g->origin);
  return p;
}

std::mutex& probe_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::unique_ptr<Probed>>& probes() {
  static auto* m = new std::map<std::string, std::unique_ptr<Probed>>();  // lives as long as the libraries
  return *m;
}

const Probed& probed(const std::string& path_list) {
  std::lock_guard lock(probe_mutex());
  auto& slot = probes()[path_list];
  if (!slot) {
    try {
      slot = std::make_unique<Probed>(probe(path_list));
    } catch (const std::exception& e) {  // out of memory and the like: still no throw
      slot = std::make_unique<Probed>();
      slot->report.path_list = path_list;
      slot->report.v1.reason = slot->report.v2.reason = fmt::format("probe failed: {}", e.what());
    }
  }
  return *slot;
}

}  // namespace

bool accept_table(const std::string& entry, const provider::Table* table, ProviderProbe& probe) {
  probe.entry = entry;
  probe.name.clear();
  probe.offers_v1 = probe.offers_v2 = false;
  probe.error.clear();
  if (table == nullptr) {
    probe.error = fmt::format("{}: {} returned no provider table", entry, provider::kEntrySymbol);
    return false;
  }
  // Only the first two fields are read before the version and size are known to match.
  if (table->abi_version != provider::kAbiVersion || table->table_bytes != sizeof(provider::Table)) {
    probe.error = fmt::format("{}: provider ABI mismatch: library built for ABI {} (table of {} bytes), this moe-ep "
                              "speaks ABI {} ({} bytes)",
                              entry, table->abi_version, table->table_bytes, provider::kAbiVersion,
                              sizeof(provider::Table));
    return false;
  }
  // The name is shown in every report and message: printable text of bounded length (read no
  // further than the bound).
  const std::size_t length = table->name != nullptr ? strnlen(table->name, kMaxProviderName + 1) : 0;
  const bool printable = std::all_of(table->name, table->name + length, [](char c) { return c >= 0x20 && c < 0x7f; });
  if (table->name == nullptr || length == 0 || length > kMaxProviderName || !printable) {
    probe.error = fmt::format("{}: the provider table's name is {}: expected 1 to {} printable ASCII characters", entry,
                              table->name == nullptr ? std::string("null")
                              : length > kMaxProviderName
                                  ? fmt::format("longer than {} characters", kMaxProviderName)
                                  : fmt::format("{:?}", std::string_view(table->name, length)),
                              kMaxProviderName);
    return false;
  }
  probe.name.assign(table->name, length);
  if (table->init != nullptr) {
    const char* failure = nullptr;
    try {
      failure = table->init();
    } catch (const std::exception& e) {
      probe.error = fmt::format("{} (provider '{}'): init failed: {}", entry, probe.name, e.what());
      return false;
    } catch (...) {
      probe.error = fmt::format("{} (provider '{}'): init failed", entry, probe.name);
      return false;
    }
    if (failure != nullptr) {
      probe.error = fmt::format("{} (provider '{}'): init failed: {}", entry, probe.name,
                                std::string_view(failure, strnlen(failure, kMaxInitMessage)));
      return false;
    }
  }
  probe.offers_v1 = table->create_legacy != nullptr;
  probe.offers_v2 = table->create_elastic != nullptr;
  return true;
}

const provider::Table* provider_for(const std::string& path_list, Generation generation) {
  const Probed& p = probed(path_list);
  return generation == Generation::kV1 ? p.v1 : p.v2;
}

// The directory of the library this code is part of (libmoe_ep.so), with a trailing '/'.
std::string library_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&find_cuda_provider), &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string path = info.dli_fname;
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string("./") : path.substr(0, slash + 1);
}

DeviceProvider find_cuda_provider(const std::string& path_list) {
  DeviceProvider found;
  std::string list = path_list;
  if (list.empty()) {
    list = library_directory() + "libmoe_ep_cuda.so";
    if (access(list.c_str(), R_OK) != 0) {
      found.reason = fmt::format("no CUDA provider library: MOE_EP_PROVIDER_PATH is unset and {} does not exist "
                                 "(moe-ep was built without CUDA: docs/cuda.md)",
                                 list);
      return found;
    }
  }
  const Probed& p = probed(list);
  if (p.v2 == nullptr) {
    found.reason = fmt::format("no usable CUDA provider in '{}': {}", list, p.report.v2.reason);
  } else if (std::string_view(p.v2->name) != "cuda") {
    found.reason = fmt::format("MOE_EP_PROVIDER_PATH = '{}' gives V2 to provider '{}' ({}), not 'cuda'", list,
                               p.report.v2.provider, p.report.v2.origin);
  } else {
    found.table = p.v2;
    found.origin = p.report.v2.origin;
  }
  return found;
}

}  // namespace moe_ep::dispatcher

namespace moe_ep {

const ProbeReport& probe_providers(const std::string& path_list) { return dispatcher::probed(path_list).report; }

}  // namespace moe_ep
