// Dispatcher internals: the buffer cache's state (its channel, the current buffer and its key)
// and the agreement every dispatcher call starts with.
#pragma once

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.hh"
#include "moe_ep/dispatcher.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::dispatcher {

// What a buffer was built for; equal keys share the buffer (docs/dispatcher.md §3).
struct BufferKey {
  Generation generation = Generation::kV1;
  std::string provider;  // path list entry ("cpu" = built-in)
  int world = 0;
  int hidden = 0;
  int topk = 0;
  int cap = 0;
  int prefill_cap = 0;
  bool fp8 = false;
  bool nvfp4 = false;  // V2: sized for BF16 rows, any hidden per call (NVFP4 rows are H/2 + H/16 bytes)
  bool hybrid = true;
  bool multiple_reduction = true;
  bool low_latency = false;  // V1: low_latency_mode
  int experts = 0;           // V1 only (its low-latency pool depends on it); 0 for V2
  double timeout_secs = 0;
  bool operator==(const BufferKey&) const = default;
};

// One call's view of every rank, after its agreement.
struct Agreed {
  bool rebuild = false;  // the key differs from the cached buffer's (same on every rank)
};

class CacheState {
 public:
  explicit CacheState(Group& group);
  ~CacheState();

  // The agreement of a dispatcher call (collective). Publishes this rank's error (if any), the
  // operation's fields, the provider and whether this rank holds handles; on return every rank
  // has the same view, else every rank has thrown.
  Agreed agree(const char* operation, const std::vector<std::pair<const char*, std::int64_t>>& fields,
               const BufferKey* key, std::exception_ptr local_error);

  // Makes the cached buffer match `key` (collective; only after agree() said rebuild).
  void rebuild(const BufferKey& key, const provider::Table& table);
  // Collective: destroys the current buffer, if any.
  void destroy_buffer();

  provider::LegacyBackend* legacy() { return legacy_.get(); }
  provider::ElasticBackend* elastic() { return elastic_.get(); }
  std::uint64_t buffer_id() const { return buffer_id_; }
  void check_usable(const char* call) const;

  Group& group;
  // Serialises the calls of the cache and of every TokenDispatcher on it (docs/semantics.md,
  // "Concurrent calls"): they share this state and its buffer.
  std::recursive_mutex calls;
  std::unique_ptr<comm::Transport> channel;  // the cache's own collective sequence
  std::optional<BufferKey> key;
  BufferCacheStats stats;
  int holders = 0;               // micro-batch slots holding a handle of the current buffer
  bool normal_since_clean = false;  // V1: normal mode used the pool since the last clean
  std::string broken;            // why the channel is out of step (then every call refuses)

 private:
  std::unique_ptr<provider::LegacyBackend> legacy_;
  std::unique_ptr<provider::ElasticBackend> elastic_;
  std::uint64_t buffer_id_ = 0;
};

}  // namespace moe_ep::dispatcher
