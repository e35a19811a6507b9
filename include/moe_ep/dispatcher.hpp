// The MoE token dispatcher: what inference and training engines call (docs/dispatcher.md).
//
// probe_providers() finds which buffer generations (V1 Buffer, V2 ElasticBuffer) the configured
// providers offer; it never throws and keeps the reason a generation is missing. A BufferCache
// (one per group and rank) owns at most one buffer, shared by every TokenDispatcher (layer) on
// it: equal key -> reuse, changed key -> rebuild, failed constructor -> nothing published. A
// TokenDispatcher resolves each batch's mode (normal, low-latency, or auto by batch kind),
// validates before touching the buffer, and returns one output format per mode whichever
// generation ran. Dispatch and combine are split into a/b halves guarded by a per-micro-batch
// stage machine; every call is collective, and every failure reaches every rank as an error
// that names the ranks involved. A TokenDispatcher must not outlive its BufferCache.
// Threads: a BufferCache and every TokenDispatcher on it serialise their calls with one lock
// (recursive), held for each whole call: the halves, the fused calls with their hooks (run on the
// calling thread), add_hook, stats, destroy and the destructors; the option getters take none.
// Every rank must still make the same sequence of calls (docs/semantics.md, "Concurrent calls").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe_ep/group.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {

namespace dispatcher {
class CacheState;
class DispatcherState;
}  // namespace dispatcher

enum class Generation { kV1, kV2 };
enum class DispatchMode { kNormal, kLowLatency, kAuto };
enum class BatchKind { kPrefill, kDecode };  // prefill/extend vs decode
enum class OutputFormat { kNormal, kLowLatency, kV2Expanded, kHybridEp };
// The layout of V2 normal-mode batches (docs/dispatcher.md §4).
enum class V2NormalLayout { kCompact, kExpanded, kHybridEp };
// kNVFP4: the low-latency wire format (normal-mode batches travel BF16; docs/dispatcher.md §5).
enum class WireDType { kBF16, kFP8, kNVFP4 };

const char* generation_name(Generation g);  // "V1", "V2"
const char* mode_name(DispatchMode m);      // "normal", "low_latency", "auto"
const char* format_name(OutputFormat f);    // "normal", "low_latency", "v2_expanded", "hybrid_ep"
const char* v2_normal_layout_name(V2NormalLayout l);  // "compact", "expanded", "hybrid_ep"
const char* wire_dtype_name(WireDType d);   // "bf16", "fp8", "nvfp4"
const char* batch_kind_name(BatchKind k);   // "prefill", "decode"

// The values those names (and the spellings noted) name: what MOE_EP_MODE, MOE_EP_DISPATCH_DTYPE,
// the Python module and the tool accept. Any other value is InvalidArgument naming the argument,
// the value and the accepted ones: "mode = 'fast' is not one of normal | low_latency | auto".
DispatchMode parse_mode(std::string_view value, std::string_view argument = "mode");
WireDType parse_wire_dtype(std::string_view value, std::string_view argument = "dispatch_dtype");  // also "bfloat16"
BatchKind parse_batch_kind(std::string_view value, std::string_view argument = "kind");  // also "extend" (prefill)
V2NormalLayout parse_v2_normal_layout(std::string_view value, std::string_view argument = "v2_normal_layout");

// ---- Probe ----------------------------------------------------------------------------------

struct GenerationProbe {
  bool available = false;
  std::string provider;  // name of the provider that offers it
  std::string origin;    // its library path, or "builtin"
  std::string reason;    // why it is unavailable (empty when available)
};

struct ProviderProbe {
  std::string entry;  // the path list entry
  std::string name;   // empty when the library could not be used
  bool offers_v1 = false;
  bool offers_v2 = false;
  std::string error;  // why the entry is unusable (empty when usable)
};

struct ProbeReport {
  std::string path_list;  // as probed ("cpu" when none was given)
  std::vector<ProviderProbe> providers;
  GenerationProbe v1, v2;
  const GenerationProbe& operator[](Generation g) const { return g == Generation::kV1 ? v1 : v2; }
};

// Probes the providers of `path_list` (colon-separated library paths; "cpu" = the built-in
// provider; empty = "cpu"). Each distinct list is probed once per process. Never throws.
const ProbeReport& probe_providers(const std::string& path_list);

// ---- Options --------------------------------------------------------------------------------

// Unset fields take their environment variable (docs/dispatcher.md §2).
struct DispatcherOptions {
  int hidden = 0;
  int num_experts = 0;
  int num_topk = 0;
  std::optional<bool> use_v2;                            // MOE_EP_USE_V2
  std::optional<DispatchMode> mode;                      // MOE_EP_MODE
  std::optional<int> num_max_dispatch_tokens_per_rank;   // MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK
  std::optional<int> num_max_prefill_tokens_per_rank;    // MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK
  std::optional<WireDType> dispatch_dtype;               // MOE_EP_DISPATCH_DTYPE
  std::optional<int> num_workers;                        // MOE_EP_NUM_WORKERS
  std::optional<bool> allow_hybrid_mode;                 // MOE_EP_V2_ALLOW_HYBRID_MODE
  std::optional<bool> allow_multiple_reduction;          // MOE_EP_V2_ALLOW_MULTIPLE_REDUCTION
  std::optional<V2NormalLayout> v2_normal_layout;       // MOE_EP_V2_NORMAL_LAYOUT
  std::optional<double> timeout_secs;                    // MOE_EP_TIMEOUT_SECS
  std::optional<std::string> provider_path;              // MOE_EP_PROVIDER_PATH
  bool round_scale = false;  // FP8: power-of-two scales
  bool use_ue8m0 = false;    // FP8: UE8M0-packed scales (needs round_scale)
  float nvfp4_global_scale = 1.0f;  // NVFP4: the global scale gs (positive, finite)
  bool nvfp4_use_ue8m0 = false;     // NVFP4: UE8M0 block scales (gs unused)
  int expert_alignment = 1;  // normal and expanded layouts
};

// ---- Buffer cache -----------------------------------------------------------------------------

struct BufferCacheStats {
  int builds = 0;       // buffers constructed
  int reuses = 0;       // dispatches that found the buffer they needed
  int destroys = 0;     // buffers destroyed (key change or destroy())
  int clean_calls = 0;  // V1 clean_low_latency_buffer calls
  std::int64_t buffer_bytes = 0;  // of the current buffer (V1: both pools), 0 when none
  std::string current_provider;
  std::optional<Generation> current_generation;
};

class BufferCache {
 public:
  explicit BufferCache(Group& group);  // collective
  ~BufferCache();                      // destroys the buffer (collective)
  BufferCache(const BufferCache&) = delete;
  BufferCache& operator=(const BufferCache&) = delete;

  void destroy();  // collective; later dispatches build a new buffer
  BufferCacheStats stats() const;
  Group& group() const;

 private:
  friend class TokenDispatcher;
  std::unique_ptr<dispatcher::CacheState> state_;
};

// ---- Dispatcher -------------------------------------------------------------------------------

struct DispatchOutput {
  OutputFormat format = OutputFormat::kNormal;
  Generation generation = Generation::kV1;
  DispatchMode mode = DispatchMode::kNormal;  // resolved: kNormal or kLowLatency
  std::string provider;
  int micro_batch = 0;
  Tensor hidden_states;        // kNormal [M, H]; kV2Expanded, kHybridEp [M_exp, H]; kLowLatency [El, R*cap, H]
  Tensor hidden_states_scale;  // FP8 only (docs/dispatcher.md §5)
  Tensor topk_ids;             // kNormal: int64 [M, k] local ids or -1
  Tensor topk_weights;         // kNormal: float32 [M, k]; kV2Expanded, kHybridEp: [M_exp]
  std::vector<int> num_recv_tokens_per_expert;  // kNormal, kV2Expanded, kHybridEp: aligned counts
  Tensor masked_m;             // kLowLatency, kV2Expanded, kHybridEp: int32 [El] real rows
  int expected_m = 0;          // kLowLatency
};

enum class HookPoint { kAfterDispatchA, kAfterCombineA };
struct HookInfo {
  HookPoint point;
  int micro_batch;
  DispatchMode mode;  // resolved
};

class TokenDispatcher {
 public:
  static constexpr int kMicroBatches = 2;

  // Resolves the options (env for unset fields) and validates them; builds nothing.
  TokenDispatcher(BufferCache& cache, const DispatcherOptions& options);
  ~TokenDispatcher();
  TokenDispatcher(const TokenDispatcher&) = delete;
  TokenDispatcher& operator=(const TokenDispatcher&) = delete;

  // Fused: dispatch_a, the kAfterDispatchA hooks, dispatch_b.
  DispatchOutput dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, BatchKind kind,
                          int micro_batch = 0);
  // Fused: combine_a, the kAfterCombineA hooks, combine_b. Returns bfloat16 [N, H].
  Tensor combine(const Tensor& expert_output, int micro_batch = 0);

  void dispatch_a(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights, BatchKind kind,
                  int micro_batch = 0);
  DispatchOutput dispatch_b(int micro_batch = 0);
  void combine_a(const Tensor& expert_output, int micro_batch = 0);
  Tensor combine_b(int micro_batch = 0);

  void add_hook(HookPoint point, std::function<void(const HookInfo&)> hook);

  Generation generation() const;
  DispatchMode mode() const;  // as configured
  DispatchMode resolve(BatchKind kind) const;
  // The options after resolution (every optional set).
  const DispatcherOptions& options() const;

 private:
  std::unique_ptr<dispatcher::DispatcherState> state_;
};

}  // namespace moe_ep
