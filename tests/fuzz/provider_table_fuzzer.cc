// Fuzzes the checks of a provider table (what a loaded library's entry point returns), without
// loading a library: ABI version, table size, name and the presence of each function come from
// the input; functions are null or fixed stubs. accept_table must never throw, must call init
// only for a table that passed the other checks and never call a factory, and must accept
// exactly the tables an independent reading of the rules accepts, reporting what it found.
//
// Input layout (missing bytes read as 0): abi_version XOR kAbiVersion (uint32 LE), table_bytes
// XOR sizeof(Table) (uint32 LE), flags, then the name's bytes (cut at the first NUL).
// flags: 1 table null, 2 name null, 4/8 init mode (0 null, 4 ready, 8 failure message,
// 12 throws), 16 create_legacy, 32 create_elastic, 64 size hint.
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dispatcher/provider_registry.hh"
#include "moe_ep/provider.hpp"

namespace {

using moe_ep::provider::Table;
namespace dispatcher = moe_ep::dispatcher;

[[noreturn]] void violated(const char* what) {
  fmt::print(stderr, "provider table fuzzer: {}\n", what);
  std::abort();
}

int init_calls = 0;
const char* init_ready() {
  ++init_calls;
  return nullptr;
}
const char* init_failure() {
  ++init_calls;
  return "no device";
}
const char* init_throws() {
  ++init_calls;
  throw std::runtime_error("driver missing");
}
moe_ep::provider::LegacyBackend* create_legacy(moe_ep::Group&, const moe_ep::BufferConfig&) {
  violated("the probe called a factory");
}
moe_ep::provider::ElasticBackend* create_elastic(moe_ep::Group&, const moe_ep::ElasticBufferConfig&) {
  violated("the probe called a factory");
}
std::int64_t size_hint(int, int, int, int) { violated("the probe called the size hint"); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint8_t header[9] = {};
  std::memcpy(header, data, std::min<std::size_t>(size, sizeof header));
  std::uint32_t abi = 0, bytes = 0;
  std::memcpy(&abi, header, 4);
  std::memcpy(&bytes, header + 4, 4);
  const std::uint8_t flags = header[8];
  const std::string name_bytes = size > sizeof header
                                     ? std::string(reinterpret_cast<const char*>(data + sizeof header), size - sizeof header)
                                     : std::string();
  const std::string name = name_bytes.substr(0, name_bytes.find('\0'));  // what a C string holds

  Table table{};
  table.abi_version = abi ^ moe_ep::provider::kAbiVersion;
  table.table_bytes = bytes ^ static_cast<std::uint32_t>(sizeof(Table));
  table.name = (flags & 2) ? nullptr : name.c_str();
  const int init_mode = (flags >> 2) & 3;
  table.init = init_mode == 0 ? nullptr : init_mode == 1 ? &init_ready : init_mode == 2 ? &init_failure : &init_throws;
  table.create_legacy = (flags & 16) ? &create_legacy : nullptr;
  table.create_elastic = (flags & 32) ? &create_elastic : nullptr;
  table.low_latency_rdma_size_hint = (flags & 64) ? &size_hint : nullptr;
  const Table* given = (flags & 1) ? nullptr : &table;

  // The rules, read independently.
  bool printable = !name.empty() && name.size() <= dispatcher::kMaxProviderName;
  for (char c : name) printable &= c >= 0x20 && c <= 0x7e;
  const bool checks_pass = given != nullptr && table.abi_version == moe_ep::provider::kAbiVersion &&
                           table.table_bytes == sizeof(Table) && table.name != nullptr && printable;
  const bool expected = checks_pass && (init_mode == 0 || init_mode == 1);

  init_calls = 0;
  moe_ep::ProviderProbe probe;
  bool result = false;
  try {
    result = dispatcher::accept_table("fuzz.so", given, probe);
  } catch (...) {
    violated("accept_table threw");
  }
  if (result != expected) violated("accepted or refused against the rules");
  if (init_calls != (checks_pass && init_mode != 0 ? 1 : 0)) violated("init ran when it should not, or not once");
  if (probe.entry != "fuzz.so") violated("the entry is not reported");
  if (result) {
    if (!probe.error.empty() || probe.name != name || probe.offers_v1 != ((flags & 16) != 0) ||
        probe.offers_v2 != ((flags & 32) != 0))
      violated("an accepted table is misreported");
  } else {
    if (probe.error.empty() || probe.error.find("fuzz.so") == std::string::npos || probe.offers_v1 || probe.offers_v2)
      violated("a refused table is misreported");
  }
  return 0;
}
