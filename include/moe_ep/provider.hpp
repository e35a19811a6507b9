// Providers: implementations of the buffer generations that the dispatcher can load.
//
// A provider offers V1 (the legacy Buffer), V2 (ElasticBuffer) or both, behind the abstract
// interfaces below, which take the same argument and result types as the built-in classes. The
// built-in provider "cpu" is part of this library; others are shared libraries that export
//     extern "C" const moe_ep::provider::Table* moe_ep_provider_abi_6();
// and link against this library for its types. The symbol's name carries the ABI version and the
// table repeats it (with its size): a library built for another ABI is refused, never called.
// Any change to these interfaces or to the argument structs they take bumps kAbiVersion.
// Factories return owned objects (delete through the virtual destructor) and report failures by
// throwing moe_ep::Error; init reports a failure by returning a message (null on success).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "moe_ep/version.hpp"

namespace moe_ep::provider {

inline constexpr std::uint32_t kAbiVersion = MOE_EP_PROVIDER_ABI_VERSION;
inline constexpr const char* kEntrySymbol = "moe_ep_provider_abi_6";
static_assert(kAbiVersion == 6, "kEntrySymbol names the ABI version: change both");

// A V1 buffer (every call collective, as moe_ep::Buffer).
class LegacyBackend {
 public:
  virtual ~LegacyBackend() = default;
  virtual DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts) = 0;
  virtual LegacyDispatchResult dispatch(const LegacyDispatchArgs& args) = 0;
  virtual CombineResult combine(const LegacyCombineArgs& args) = 0;
  virtual LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args) = 0;
  virtual LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args) = 0;
  virtual void clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) = 0;
  virtual void destroy() = 0;  // collective
};

// A V2 buffer (every call collective, as moe_ep::ElasticBuffer). The getters answer what
// ElasticBuffer's getters of the same names answer, for this provider's data path.
class ElasticBackend {
 public:
  virtual ~ElasticBackend() = default;
  virtual DispatchResult dispatch(const DispatchArgs& args) = 0;
  virtual CombineResult combine(const CombineArgs& args) = 0;
  virtual std::int64_t num_bytes() const = 0;
  virtual void destroy() = 0;  // collective
  // Collective: returns once every rank entered it (ElasticBuffer::barrier).
  virtual void barrier() = 0;
  // (scale-out, scale-up) ranks of the path the rows take: (1, ranks) for a direct path.
  virtual std::pair<int, int> get_logical_domain_size() const = 0;
  virtual int num_allocated_qps() const = 0;
  // 0: the provider sizes its launches itself.
  virtual int get_theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk, double rdma_gbs,
                                      double nvlink_gbs, double sm_read_gbs, double sm_write_gbs) const = 0;
  virtual int get_theoretical_num_qps(int num_sms) const = 0;
};

struct Table {
  std::uint32_t abi_version;  // kAbiVersion
  std::uint32_t table_bytes;  // sizeof(Table)
  const char* name;
  const char* (*init)();  // null result = ready; else why the provider cannot run here
  // Null when the generation is not offered. Both are collective over `group`.
  LegacyBackend* (*create_legacy)(Group& group, const BufferConfig& config);
  ElasticBackend* (*create_elastic)(Group& group, const ElasticBufferConfig& config);
  // V1 low-latency pool size for (cap, hidden, ranks, experts); null = DeepEP's formula.
  std::int64_t (*low_latency_rdma_size_hint)(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks,
                                             int num_experts);
};

// The built-in provider's table ("cpu"), for libraries that wrap or re-export it.
const Table& builtin();

}  // namespace moe_ep::provider
