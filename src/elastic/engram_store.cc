#include "elastic/engram_store.hh"

#include <fmt/format.h>

#include <climits>
#include <cstring>

#include "core/arith.hh"
#include "core/checks.hh"
#include "elastic/collective_call.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::elastic {
namespace {

using Wide = __int128;

// x rounded up to a multiple of a (a > 0), in 128 bits (the caller checks the result's range).

std::int64_t narrow(const char* context, const char* what, Wide value) {
  if (value > INT64_MAX)
    throw InvalidArgument(fmt::format("{}: {} does not fit in 64 bits", context, what));
  return static_cast<std::int64_t>(value);
}

// This rank's arguments of engram_write (docs/engram-pp.md, "engram_write").
void check_write(const std::string& ctx, const TensorView& storage, const TensorView& sf, std::int64_t capacity,
                 int num_ranks) {
  if (capacity == 0)
    core::fail(ctx, "the buffer has no Engram storage: num_cpu_bytes = 0 (construct the buffer with num_cpu_bytes > 0)");
  if (!storage.defined()) core::fail(ctx, "storage is required (a [num_entries, hidden] tensor)");
  if (storage.dtype() != DType::kBF16 && storage.dtype() != DType::kFP8E4M3)
    core::fail(ctx, "storage has dtype {}; expected bfloat16 or float8_e4m3fn", dtype_name(storage.dtype()));
  core::expect_tensor(ctx, "storage", storage, storage.dtype(), {-1, -1});
  core::expect_contiguous(ctx, "storage", storage);
  if (storage.size(0) < 1 || storage.size(1) < 1 || storage.size(1) > kMaxHidden)
    core::fail(ctx, "storage has shape [{}, {}]; expected num_entries >= 1 and hidden in [1, {}]", storage.size(0),
               storage.size(1), kMaxHidden);
  const auto bytes = static_cast<std::int64_t>(storage.nbytes());
  if (bytes > capacity)
    throw CapacityError(fmt::format("{}: storage {} has {} bytes, more than num_cpu_bytes = {}", ctx,
                                    storage.describe(), bytes, capacity),
                        bytes, capacity);
  const bool fp8 = storage.dtype() == DType::kFP8E4M3;
  if (fp8 && !sf.defined())
    core::fail(ctx, "storage is float8_e4m3fn, so sf (its scales, [num_ranks * num_entries, P]) is required");
  if (!fp8 && sf.defined())
    core::fail(ctx, "sf is given, but storage is bfloat16: scales go with float8_e4m3fn storage only");
  if (!fp8) return;
  if (sf.dtype() != DType::kFP32 && sf.dtype() != DType::kInt32)
    core::fail(ctx, "sf has dtype {}; expected float32 or int32 (4-byte scales)", dtype_name(sf.dtype()));
  core::expect_tensor(ctx, "sf", sf, sf.dtype(), {-1, -1});
  core::expect_contiguous(ctx, "sf", sf);
  if (sf.size(0) != num_ranks * storage.size(0) || sf.size(1) < 1)
    core::fail(ctx, "sf has shape [{}, {}]; expected [num_ranks * num_entries = {} * {} = {}, P >= 1] (the scales of "
               "every rank's entries)", sf.size(0), sf.size(1), num_ranks, storage.size(0),
               num_ranks * storage.size(0));
}

}  // namespace

EngramStore::EngramStore(engine::Engine& engine, std::int64_t num_cpu_bytes)
    : engine_(engine), capacity_(num_cpu_bytes) {
  if (num_cpu_bytes <= 0) return;
  const engine::EngineFacts& f = engine.facts;
  channel_ = engine.transport().duplicate(f.wait("construction: Engram channel"));
  storage_ = channel_->allocate_symmetric(static_cast<std::size_t>(num_cpu_bytes),
                                          f.wait("construction: Engram storage"), false);
  replica_signals_.assign(static_cast<std::size_t>(f.num_ranks), 0);
}

EngramStore::~EngramStore() = default;

void EngramStore::retire() {
  comm::retire(std::move(replicas_));
  comm::retire(std::move(storage_));
}

std::pair<std::int64_t, std::int64_t> EngramStore::size_hint(std::int64_t num_entries, std::int64_t hidden,
                                                             std::int64_t num_max_tokens_per_rank, DType dtype) {
  const char* ctx = "get_engram_storage_size_hint";
  if (num_entries < 0 || hidden < 0 || num_max_tokens_per_rank < 0)
    throw InvalidArgument(fmt::format("{}: num_entries = {}, hidden = {} and num_max_tokens_per_rank = {} must not be "
                                      "negative", ctx, num_entries, hidden, num_max_tokens_per_rank));
  const Wide per = core::round_up<Wide>(Wide{hidden} * static_cast<Wide>(element_size(dtype)), 32);
  const Wide gpu = core::round_up<Wide>(per * num_max_tokens_per_rank, kBufferAlignment);
  const Wide cpu = core::round_up<Wide>(per * num_entries, kBufferAlignment);
  return {narrow(ctx, "the GPU part (rows x row bytes)", gpu), narrow(ctx, "the CPU part (entries x row bytes)", cpu)};
}

void EngramStore::write(const TensorView& storage, const Tensor& sf, const std::string& rejection) {
  const int R = engine_.facts.num_ranks;
  CollectiveCall call;
  call.rejection = rejection;
  call.validate = [&](const std::string& ctx) { check_write(ctx, storage, sf, capacity_, R); };
  const bool two_d = storage.ndim() == 2, sf_two_d = sf.ndim() == 2;
  call.describe = [&](comm::Agreement& a) {
    a.field("num_entries (storage.size(0))", two_d ? storage.size(0) : -1)
        .field("hidden (storage.size(1))", two_d ? storage.size(1) : -1)
        .field("storage dtype", storage.defined() ? std::optional<DType>(storage.dtype()) : std::nullopt)
        .field("sf dtype", sf.defined() ? std::optional<DType>(sf.dtype()) : std::nullopt)
        .field("P (sf.size(1))", sf.defined() && sf_two_d ? sf.size(1) : 0);
  };
  call.run = [&](const Payloads&, const InStep&) {
    Layout layout;
    layout.num_entries = storage.size(0);
    layout.hidden = static_cast<int>(storage.size(1));
    layout.dtype = storage.dtype();
    layout.row_bytes = storage.size(1) * static_cast<std::int64_t>(element_size(storage.dtype()));
    store(storage, layout);
    sf_ = sf;
  };
  run_collective(engine_, "engram_write", std::move(call));
}

// After the agreement (every rank is in the write: no fetch of the last one is running): the
// copy, the replicas of other nodes, and a barrier after which every shard is in place.
void EngramStore::store(const TensorView& storage, const Layout& layout) {
  const engine::EngineFacts& f = engine_.facts;
  layout_.reset();
  std::memcpy(storage_->local(), storage.data(), storage.nbytes());
  if (channel_->node_size() < f.num_ranks) replicate(static_cast<std::int64_t>(storage.nbytes()));
  engine_.transport().barrier(comm::Scope::kWorld, f.wait("engram_write: barrier after the copy"));
  layout_ = layout;
}

std::int64_t EngramStore::replica_slot(int source, int receiver) const {
  const int S = channel_->node_size();
  const int first = receiver / S * S;  // the receiver's node: ranks first .. first + S - 1
  return source < first ? source : source - S;
}

void EngramStore::replicate(std::int64_t shard_bytes) {
  const engine::EngineFacts& f = engine_.facts;
  const int R = f.num_ranks, remote = R - channel_->node_size();
  const auto bytes = static_cast<std::size_t>(remote) * static_cast<std::size_t>(shard_bytes);
  if (!replicas_ || replicas_->bytes() != bytes) {
    replicas_.reset();  // every rank replaces its region in the same call
    replicas_ = channel_->allocate_symmetric(bytes, f.wait("engram_write: replica allocation"), false);
  }
  std::vector<int> sources;
  std::vector<std::uint64_t> targets;
  for (int r = 0; r < R; ++r) {
    if (channel_->same_node(r)) continue;
    channel_->put_retained(r, *replicas_, static_cast<std::size_t>(replica_slot(f.rank, r) * shard_bytes),
                           storage_->local(), static_cast<std::size_t>(shard_bytes));
    channel_->signal(r);
    sources.push_back(r);
    targets.push_back(++replica_signals_[static_cast<std::size_t>(r)]);
  }
  channel_->finish_retained(f.wait("engram_write: replica sends"));
  channel_->wait_signals(sources, targets, f.wait("engram_write: replicas from the other nodes"));
}

const std::byte* EngramStore::shard_of(int owner) {
  const engine::EngineFacts& f = engine_.facts;
  if (owner == f.rank) return storage_->local();
  if (channel_->same_node(owner)) return storage_->node_peer(owner);
  return replicas_->local() + replica_slot(owner, f.rank) * layout_->num_entries * layout_->row_bytes;
}

void EngramStore::check_indices(const std::string& ctx, const TensorView& indices) const {
  core::expect_tensor(ctx, "indices", indices, DType::kInt32, {-1, -1});
  core::expect_contiguous(ctx, "indices", indices);
  const std::int64_t limit = engine_.facts.num_ranks * layout_->num_entries;
  const std::int64_t n = indices.numel(), K = indices.size(1);
  const auto* idx = indices.data_as<const std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= limit)
      core::fail(ctx, "indices[{}, {}] = {} is outside [0, num_ranks * num_entries = {} * {} = {})", i / K, i % K,
                 idx[i], engine_.facts.num_ranks, layout_->num_entries, limit);
}

EngramFetchResult EngramStore::fetch(const TensorView& indices, int num_qps, bool col_major_sf) {
  const engine::EngineFacts& f = engine_.facts;
  const std::string ctx = f.context("engram_fetch");
  engine_.check_usable("engram_fetch");
  if (!layout_)
    throw StateError(fmt::format("{}: nothing to fetch: engram_write has not stored a table yet{}", ctx,
                                 capacity_ == 0 ? " (and the buffer has no Engram storage: num_cpu_bytes = 0)" : ""));
  f.check_num_qps(ctx, num_qps);
  check_indices(ctx, indices);
  const Layout& L = *layout_;
  const std::int64_t T = indices.size(0), K = indices.size(1);
  const Wide need = Wide{T} * K * L.row_bytes;
  const std::int64_t pool = f.config.pool_bytes;
  if (need > pool)
    throw CapacityError(fmt::format("{}: {} x {} rows of {} bytes need {} bytes, more than the {} bytes of the buffer's "
                                    "pool (num_bytes - num_cpu_bytes)", ctx, T, K, L.row_bytes,
                                    static_cast<std::int64_t>(need), pool),
                        static_cast<long long>(need), pool);
  EngramFetchResult out;
  out.data = Tensor::empty({T, K * L.hidden}, L.dtype);
  auto* dst = static_cast<std::byte*>(out.data.data());
  const auto* idx = indices.data_as<const std::int32_t>();
  {
    std::optional<comm::PeerReads> reads;
    if (channel_->node_size() > 1) reads.emplace(*channel_, "engram_fetch: node peers' shards");
    for (std::int64_t i = 0; i < T * K; ++i) {
      const std::int64_t g = idx[i];
      const std::byte* shard = shard_of(static_cast<int>(g / L.num_entries));
      std::memcpy(dst + i * L.row_bytes, shard + (g % L.num_entries) * L.row_bytes, static_cast<size_t>(L.row_bytes));
    }
  }
  if (sf_.defined()) out.sf = gather_scales(indices, col_major_sf);
  return out;
}

// sf_out[t, k * P + p] = sf[indices[t, k], p]: strides (K * P, 1), or column-major (1, T rounded
// up to 4) over storage [K * P, that] whose padding is zero.
Tensor EngramStore::gather_scales(const TensorView& indices, bool col_major) const {
  const std::int64_t T = indices.size(0), K = indices.size(1), P = sf_.size(1), KP = K * P;
  const DType dt = sf_.dtype();
  Tensor out;
  std::int64_t row_stride = KP, col_stride = 1;
  if (col_major) {
    const std::int64_t lead = core::round_up(T, 4);
    Tensor padded = Tensor::zeros({KP, lead}, dt);
    const std::int64_t shape[] = {T, KP}, strides[] = {1, lead};
    out = padded.with_view(TensorView(padded.data(), dt, shape, strides));
    row_stride = 1;
    col_stride = lead;
  } else {
    out = Tensor::empty({T, KP}, dt);
  }
  const auto* idx = indices.data_as<const std::int32_t>();
  const auto* src = sf_.data_as<const std::uint32_t>();
  auto* dst = out.data_as<std::uint32_t>();
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::uint32_t* row = src + static_cast<std::int64_t>(idx[t * K + k]) * P;
      for (std::int64_t p = 0; p < P; ++p) dst[t * row_stride + (k * P + p) * col_stride] = row[p];
    }
  return out;
}

}  // namespace moe_ep::elastic
