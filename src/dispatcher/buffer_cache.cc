// The buffer cache: one buffer per group and key, built, reused, rebuilt and destroyed
// collectively (docs/dispatcher.md §3).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>

#include "comm/agreement.hh"
#include "comm/disagreement.hh"
#include "core/arith.hh"
#include "core/log.hh"
#include "core/timeout.hh"
#include "dispatcher/provider_registry.hh"
#include "dispatcher/state.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"

namespace moe_ep {
namespace dispatcher {
namespace {

constexpr std::size_t kProviderBytes = 200;

// What every rank publishes besides the agreement's fields.
struct Published {
  std::uint32_t holders;     // slots holding handles of this rank's current buffer
  std::uint32_t has_buffer;  // this rank's cache holds a buffer
  std::uint32_t matches;     // ...and it was built for the requested key
  char provider[kProviderBytes];
};

double default_timeout() { return core::timeout_from_env(); }

// V1 pools (DeepEP's sizing; docs/dispatcher.md §3).
BufferConfig legacy_config(const BufferKey& key, const provider::Table& table, const Group& group) {
  BufferConfig c;
  const std::int64_t hidden_bytes = std::int64_t{key.hidden} * 2;  // FP8 sizes like BF16
  const Config dispatch = Buffer::get_dispatch_config(key.world), combine = Buffer::get_combine_config(key.world);
  c.num_nvl_bytes = std::max(dispatch.get_nvl_buffer_size_hint(hidden_bytes, key.world),
                             combine.get_nvl_buffer_size_hint(hidden_bytes, key.world));
  if (group.num_scaleout() > 1) {
    c.num_rdma_bytes = std::max(dispatch.get_rdma_buffer_size_hint(hidden_bytes, key.world),
                                combine.get_rdma_buffer_size_hint(hidden_bytes, key.world));
    // Normal-mode tokens cross nodes through this pool: room for one batch of the prefill cap.
    c.num_rdma_bytes = std::max(c.num_rdma_bytes, ElasticBuffer::get_buffer_size_hint(
                                                      group, key.prefill_cap, key.hidden, key.topk, key.fp8));
  }
  if (key.low_latency) {
    auto hint = table.low_latency_rdma_size_hint != nullptr ? table.low_latency_rdma_size_hint
                                                            : &Buffer::get_low_latency_rdma_size_hint;
    c.num_rdma_bytes = std::max(c.num_rdma_bytes, hint(key.cap, key.hidden, key.world, key.experts));
  }
  c.num_rdma_bytes = core::round_up(c.num_rdma_bytes, 128);
  c.num_nvl_bytes = core::round_up(c.num_nvl_bytes, 128);
  c.low_latency_mode = key.low_latency;
  // DeepEP's queue-pair count: the normal config's SMs, or one per local expert in low-latency
  // mode (the larger of both when both are used).
  c.num_qps_per_rank = key.low_latency ? std::max(dispatch.num_sms, key.experts / key.world) : dispatch.num_sms;
  c.explicitly_destroy = true;
  c.num_cpu_timeout_secs = key.timeout_secs;
  return c;
}

ElasticBufferConfig elastic_config(const BufferKey& key, const Group& group) {
  if (key.nvfp4)  // low-latency rows of H/2 value bytes and H/16 scale bytes, combine rows of H: sized for BF16
    return {.num_bytes = ElasticBuffer::get_buffer_size_hint(group, std::max(key.cap, key.prefill_cap), key.hidden,
                                                             key.topk, false, key.hybrid, key.multiple_reduction),
            .num_max_tokens_per_rank = std::max(key.cap, key.prefill_cap),
            .num_topk = key.topk,
            .allow_hybrid_mode = key.hybrid,
            .allow_multiple_reduction = key.multiple_reduction,
            .num_cpu_timeout_secs = key.timeout_secs,
            .explicitly_destroy = true};
  return {.num_max_tokens_per_rank = std::max(key.cap, key.prefill_cap),
          .hidden = key.hidden,
          .num_topk = key.topk,
          .use_fp8_dispatch = key.fp8,
          .allow_hybrid_mode = key.hybrid,
          .allow_multiple_reduction = key.multiple_reduction,
          .num_cpu_timeout_secs = key.timeout_secs,
          .explicitly_destroy = true};
}

}  // namespace

void check_one_provider(const std::string& context, const std::string& purpose,
                        const std::vector<std::string>& provider_of_rank, int me, const std::string& note) {
  std::map<int, std::string> held;
  for (std::size_t r = 0; r < provider_of_rank.size(); ++r)
    held[static_cast<int>(r)] = fmt::format("'{}'", provider_of_rank[r]);
  if (auto e = comm::disagreement(context, fmt::format("the provider{}", purpose), held, me, note)) throw *e;
}

CacheState::CacheState(Group& g) : group(g) {
  channel = group.transport().duplicate({"BufferCache: channel setup", default_timeout()});
}

CacheState::~CacheState() = default;

void CacheState::check_usable(const char* call) const {
  if (!broken.empty())
    throw StateError(fmt::format("dispatcher: {}: the buffer cache is unusable after a failed collective ({}); "
                                 "build a new BufferCache",
                                 call, broken));
}

Agreed CacheState::agree(const char* operation, const std::vector<std::pair<const char*, std::int64_t>>& fields,
                         const BufferKey* want, std::exception_ptr local_error) {
  check_usable(operation);
  comm::Agreement agreement("dispatcher", operation);
  for (const auto& [name, value] : fields) agreement.field(name, value);
  if (want != nullptr) {
    agreement.field("generation", static_cast<std::int64_t>(want->generation))
        .field("hidden", want->hidden)
        .field("num_topk", want->topk)
        .field("num_max_dispatch_tokens_per_rank", want->cap)
        .field("num_max_prefill_tokens_per_rank", want->prefill_cap)
        .field("fp8_dispatch", want->fp8)
        .field("nvfp4_dispatch", want->nvfp4)
        .field("allow_hybrid_mode", want->hybrid)
        .field("allow_multiple_reduction", want->multiple_reduction)
        .field("low_latency_pool", want->low_latency)
        .field("num_experts", want->experts);
  }
  agreement.local_error(local_error);
  Published mine{};
  mine.holders = static_cast<std::uint32_t>(holders);
  mine.has_buffer = key.has_value();
  mine.matches = want != nullptr && key.has_value() && *key == *want;
  if (want != nullptr) std::strncpy(mine.provider, want->provider.c_str(), kProviderBytes - 1);
  const double timeout = want != nullptr ? want->timeout_secs : default_timeout();
  std::vector<std::span<const std::byte>> all;
  try {
    all = agreement.exchange(*channel, comm::Scope::kWorld, {operation, timeout},
                             {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  } catch (const std::exception& e) {
    if (!agreement.gathered()) broken = e.what();
    throw;
  }
  std::vector<Published> peers(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) std::memcpy(&peers[r], all[r].data(), sizeof(Published));
  const int me = channel->rank();
  Agreed agreed;
  if (want == nullptr) return agreed;

  // One provider for everyone.
  std::vector<std::string> providers;
  for (const Published& p : peers) providers.emplace_back(p.provider, strnlen(p.provider, kProviderBytes));
  check_one_provider(fmt::format("dispatcher: {}", operation), fmt::format(" for {}", generation_name(want->generation)),
                     providers, me);
  // The same cached buffer everywhere (a constructor that failed on some ranks only breaks this):
  // a disagreement here leaves the channel out of step (StateError).
  const std::string context = fmt::format("dispatcher: {}", operation);
  std::map<int, std::string> holding;
  std::vector<int> busy;
  for (std::size_t r = 0; r < peers.size(); ++r) {
    holding[static_cast<int>(r)] = peers[r].matches ? "yes" : "no";
    if (peers[r].holders > 0) busy.push_back(static_cast<int>(r));
  }
  if (auto e = comm::disagreement(context, "whether they hold the requested buffer", holding, me)) {
    broken = e->what();
    throw StateError(broken);
  }
  agreed.rebuild = mine.matches == 0;  // the same on every rank (agreed above)
  if (agreed.rebuild) {
    bool any_buffer = false;
    for (const auto& p : peers) any_buffer |= p.has_buffer != 0;
    if (any_buffer && !busy.empty())
      throw StateError(fmt::format("dispatcher: {}: the buffer key changed while micro-batches still hold handles of "
                                   "the current buffer on {} (combine them first)",
                                   operation, comm::rank_list(busy)));
  }
  return agreed;
}

void CacheState::destroy_buffer() {
  if (!key) return;
  key.reset();
  normal_since_clean = false;
  stats.buffer_bytes = 0;
  stats.current_generation.reset();
  stats.current_provider.clear();
  ++stats.destroys;
  // Both halves are collective; the memory goes when every rank is done with it.
  std::unique_ptr<provider::LegacyBackend> legacy = std::move(legacy_);
  std::unique_ptr<provider::ElasticBackend> elastic = std::move(elastic_);
  if (legacy) legacy->destroy();
  if (elastic) elastic->destroy();
}

void CacheState::rebuild(const BufferKey& want, const provider::Table& table) {
  destroy_buffer();
  ++buffer_id_;
  if (want.generation == Generation::kV1) {
    const BufferConfig config = legacy_config(want, table, group);
    core::info(core::Subsys::kInit,
               "dispatcher: building V1 Buffer (provider '{}'): num_nvl_bytes={} num_rdma_bytes={} "
               "low_latency_mode={} num_qps_per_rank={}",
               table.name, config.num_nvl_bytes, config.num_rdma_bytes, config.low_latency_mode,
               config.num_qps_per_rank);
    legacy_.reset(table.create_legacy(group, config));
    stats.buffer_bytes = config.num_nvl_bytes + config.num_rdma_bytes;
  } else {
    const ElasticBufferConfig config = elastic_config(want, group);
    static std::atomic<bool> logged{false};
    if (group.rank() == 0 && !logged.exchange(true))
      std::fprintf(stderr,
                   "moe-ep: dispatcher uses V2 (ElasticBuffer, provider '%s'): num_max_tokens_per_rank=%d hidden=%d "
                   "num_topk=%d use_fp8_dispatch=%d allow_hybrid_mode=%d allow_multiple_reduction=%d\n",
                   table.name, config.num_max_tokens_per_rank, config.hidden, config.num_topk,
                   config.use_fp8_dispatch, config.allow_hybrid_mode, config.allow_multiple_reduction);
    core::info(core::Subsys::kInit,
               "dispatcher: building V2 ElasticBuffer (provider '{}'): num_max_tokens_per_rank={} hidden={} "
               "num_topk={} use_fp8_dispatch={} allow_hybrid_mode={} allow_multiple_reduction={}",
               table.name, config.num_max_tokens_per_rank, config.hidden, config.num_topk, config.use_fp8_dispatch,
               config.allow_hybrid_mode, config.allow_multiple_reduction);
    elastic_.reset(table.create_elastic(group, config));
    stats.buffer_bytes = elastic_->num_bytes();
  }
  key = want;
  ++stats.builds;
  stats.current_generation = want.generation;
  stats.current_provider = table.name;
}

}  // namespace dispatcher

// ---- BufferCache -----------------------------------------------------------------------------

BufferCache::BufferCache(Group& group) : state_(std::make_unique<dispatcher::CacheState>(group)) {}

BufferCache::~BufferCache() {
  try {
    destroy();
  } catch (const std::exception& e) {
    core::warn(core::Subsys::kAlloc, "BufferCache: destroy failed in the destructor ({}); the buffer is released "
               "without it", e.what());
  }
}

void BufferCache::destroy() {
  std::lock_guard lock(state_->calls);
  if (!state_->key) return;
  if (state_->holders > 0)
    throw StateError(fmt::format("BufferCache::destroy: {} micro-batch(es) still hold handles of the buffer (combine "
                                 "them first)",
                                 state_->holders));
  if (!state_->broken.empty()) {  // peers are out of step: release locally, no collective
    state_->key.reset();
    return;
  }
  state_->destroy_buffer();
}

BufferCacheStats BufferCache::stats() const {
  std::lock_guard lock(state_->calls);
  return state_->stats;
}
Group& BufferCache::group() const { return state_->group; }

}  // namespace moe_ep
