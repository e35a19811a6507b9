// All-gather sessions: the bookkeeping of AgrsState and its three engine operations (the
// configuration, the end of a session, all_gather), plus the release of the region.
#include "elastic/agrs_sessions.hh"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <map>

#include "comm/agreement.hh"
#include "comm/disagreement.hh"
#include "core/arith.hh"
#include "core/checks.hh"
#include "core/log.hh"
#include "engine/engine.hh"
#include "engine/operation.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::elastic {
namespace {

constexpr const char* kNotEnough = "Not enough session buffer size. Did you forget to flush session?";

// x rounded up to a multiple of `to` (x >= 0, to > 0), or -1 when that overflows.
std::int64_t round_up(std::int64_t x, std::int64_t to) {
  std::int64_t r = 0;
  if (x < 0 || __builtin_add_overflow(x, to - 1, &r)) return -1;
  return core::round_up(x, to);
}

// a * b (both >= 0), or -1 when that overflows.
std::int64_t times(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? -1 : r;
}

// a + b (both >= 0), or -1 when that overflows.
std::int64_t plus(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  return a < 0 || b < 0 || __builtin_add_overflow(a, b, &r) ? -1 : r;
}

// The bytes of `shape`'s elements (InvalidArgument for a negative size, too many dimensions or a
// count beyond int64).
std::int64_t shape_bytes(const std::string& ctx, const std::string& name, const AgrsShape& shape, DType dtype) {
  if (shape.size() > static_cast<std::size_t>(kMaxTensorDims - 1))
    core::fail(ctx, "{} = ({}) has {} dimensions; all_gather adds one and tensors have at most {}", name,
               fmt::join(shape, ", "), shape.size(), kMaxTensorDims);
  std::int64_t bytes = static_cast<std::int64_t>(element_size(dtype));
  for (std::int64_t size : shape) {
    if (size < 0) core::fail(ctx, "{} = ({}) has a negative size {}", name, fmt::join(shape, ", "), size);
    bytes = bytes < 0 ? -1 : times(bytes, size);
  }
  if (bytes < 0) core::fail(ctx, "{} = ({}): its byte count does not fit in int64", name, fmt::join(shape, ", "));
  return bytes;
}

// One input's block: a(bytes * R, 32) bytes, or -1 when that overflows.
std::int64_t block_bytes(std::int64_t bytes, int num_ranks) {
  const std::int64_t all = times(bytes, num_ranks);
  return all < 0 ? -1 : round_up(all, kAgrsAlignment);
}

std::string input_name(std::size_t i, std::size_t count, const char* what) {
  return count == 1 ? std::string(what) : fmt::format("{}[{}]", what, i);
}

// The session needs a configuration and an open session.
void check_ready(const AgrsState& s, const std::string& ctx) {
  if (!s.configured()) throw StateError(fmt::format("{}: call agrs_set_config first (no session region yet)", ctx));
  if (s.open_session() == 0)
    throw StateError(fmt::format("{}: no session is open (create_agrs_session or agrs_new_session first)", ctx));
}

// Both limits of a session: `end` bytes (checked per input by the callers) and one more slot.
void check_slot(const AgrsState& s, const std::string& ctx) {
  if (s.slots_used() >= s.max_slots())
    throw StateError(fmt::format("{}: {} session {} already made {} all_gather calls, the limit "
                                 "(num_max_all_gathers_per_session)",
                                 ctx, kNotEnough, s.open_session(), s.max_slots()));
}

[[noreturn]] void out_of_bytes(const AgrsState& s, const std::string& ctx, const std::string& name, std::int64_t offset,
                               std::int64_t need) {
  const std::string end = need < 0 ? std::string("beyond int64") : std::to_string(need);
  throw CapacityError(fmt::format("{}: {} {} needs session bytes [{}, {}), but the session region holds {} "
                                  "(num_max_session_bytes rounded up to {}); {} bytes are taken by this session's "
                                  "earlier all_gather calls",
                                  ctx, kNotEnough, name, offset, end, s.session_bytes(), kAgrsAlignment, s.cursor()),
                      need < 0 ? INT64_MAX : need, s.session_bytes());
}

// Every rank publishes whether tensors of its region are still alive (a byte); true if any does.
bool kept_anywhere(const std::vector<std::span<const std::byte>>& payloads, const std::string& ctx) {
  bool kept = false;
  for (std::uint8_t flag : engine::payload_per_rank<std::uint8_t>(payloads, ctx)) kept = kept || flag != 0;
  return kept;
}

class SyncOperation : public engine::Operation {
 public:
  SyncOperation(AgrsState& state, const char* operation, const char* name, std::uint64_t sequence)
      : Operation(state.engine().facts.context(operation), name, std::string(operation) + ": agreement"),
        state_(state),
        sequence_(sequence) {}
  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {}

 protected:
  AgrsState& state_;
  std::uint64_t sequence_;
};

class SetConfig final : public SyncOperation {
 public:
  SetConfig(AgrsState& state, std::int64_t bytes, int count, std::string rejection, std::uint64_t sequence)
      : SyncOperation(state, "agrs_set_config", "agrs_set_config", sequence),
        bytes_(bytes),
        count_(count),
        rejection_(std::move(rejection)) {}

 private:
  void validate() override {
    const engine::EngineFacts& f = state_.engine().facts;
    const std::string& ctx = context();
    if (!rejection_.empty()) core::fail(ctx, "{}", rejection_);
    if (f.num_ranks < 2) core::fail(ctx, "needs a group of at least 2 ranks; this one has {}", f.num_ranks);
    if (f.physical.num_scaleout > 1)
      core::fail(ctx, "needs every rank in one shared-memory domain (one node); the group spans {} nodes of {} ranks",
                 f.physical.num_scaleout, f.physical.num_scaleup);
    if (bytes_ <= 0 || bytes_ > f.config.pool_bytes)
      core::fail(ctx, "num_max_session_bytes = {} is outside [1, num_bytes = {}]", bytes_, f.config.pool_bytes);
    if (count_ <= 0 || count_ > kMaxAgrsAllGathersPerSession)
      core::fail(ctx, "num_max_all_gathers_per_session = {} is outside [1, {}]", count_, kMaxAgrsAllGathersPerSession);
    if (state_.open_session() != 0)
      throw StateError(fmt::format("{}: session {} is open; the configuration changes between sessions only "
                                   "(destroy_agrs_session first)",
                                   ctx, state_.open_session()));
  }
  std::vector<std::byte> prepare() override { return {std::byte{state_.region_kept() ? std::uint8_t{1} : std::uint8_t{0}}}; }
  void describe(comm::Agreement& a) const override {
    a.field("operation number", static_cast<std::int64_t>(sequence_))
        .field("num_max_session_bytes", bytes_)
        .field("num_max_all_gathers_per_session", count_);
  }
  void run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>&) override {
    state_.drop_region(kept_anywhere(payloads, context()));
    engine::Engine& e = state_.engine();
    const std::int64_t bytes = round_up(bytes_, kAgrsAlignment);  // <= num_bytes + 31: no overflow
    auto memory = e.transport().allocate_symmetric(static_cast<std::size_t>(bytes), e.facts.wait("agrs_set_config: allocation"),
                                                   bytes <= engine::kPrefaultLimit);
    state_.install_region(std::move(memory), bytes, count_);
    core::info(core::Subsys::kInit, "ElasticBuffer #{}: all-gather session region of {} bytes per rank, {} all_gather "
               "calls per session", e.facts.id, bytes, count_);
  }

  std::int64_t bytes_;
  int count_;
  std::string rejection_;
};

// destroy_agrs_session: the session ends here at once; the agreement is the barrier after which
// no rank writes the next session into a rank still reading this one.
class EndSession final : public SyncOperation {
 public:
  EndSession(AgrsState& state, std::uint64_t sequence)
      : SyncOperation(state, "destroy_agrs_session", "destroy_agrs_session", sequence) {}

 private:
  void validate() override {
    if (state_.open_session() == 0)
      throw StateError(fmt::format("{}: no session is open (create_agrs_session first)", context()));
    state_.close_session();
  }
  void describe(comm::Agreement& a) const override {
    a.field("operation number", static_cast<std::int64_t>(sequence_));
  }
  void run(const std::vector<std::span<const std::byte>>&, const std::function<void()>&) override {}
};

// The collective release of the region (destroy, destruction).
class Release final : public SyncOperation {
 public:
  Release(AgrsState& state, const char* operation, std::uint64_t sequence)
      : SyncOperation(state, operation, "agrs region release", sequence) {}

 private:
  std::vector<std::byte> prepare() override { return {std::byte{state_.region_kept() ? std::uint8_t{1} : std::uint8_t{0}}}; }
  void describe(comm::Agreement& a) const override {
    a.field("operation number", static_cast<std::int64_t>(sequence_));
  }
  void run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>&) override {
    state_.drop_region(kept_anywhere(payloads, context()));
  }
};

class Gather final : public SyncOperation {
 public:
  Gather(AgrsState& state, std::span<const TensorView> tensors, std::string rejection, std::uint64_t sequence)
      : SyncOperation(state, "all_gather", "all_gather", sequence),
        tensors_(tensors.begin(), tensors.end()),
        rejection_(std::move(rejection)) {}

  AllGatherResult result;

 private:
  struct Planned {
    std::int64_t bytes = 0, offset = 0;
    bool in_place = false;
  };

  void validate() override;
  void plan_input(std::size_t i, std::int64_t& cursor);
  std::vector<std::byte> prepare() override {
    std::vector<std::byte> payload(planned_.size() * sizeof(std::int64_t));
    for (std::size_t i = 0; i < planned_.size(); ++i)
      std::memcpy(payload.data() + i * sizeof(std::int64_t), &planned_[i].bytes, sizeof(std::int64_t));
    return payload;
  }
  void describe(comm::Agreement& a) const override {
    a.field("operation number", static_cast<std::int64_t>(sequence_))
        .field("session offset", start_)
        .field("session slot", slot_)
        .field("number of tensors", static_cast<std::int64_t>(tensors_.size()))
        .field("total input bytes", total_);
  }
  void run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>&) override;
  void check_sizes(const std::vector<std::span<const std::byte>>& payloads) const;
  void write();

  std::vector<TensorView> tensors_;
  std::string rejection_;
  std::vector<Planned> planned_;
  std::uint64_t session_ = 0;
  std::int64_t start_ = 0, end_ = 0, slot_ = 0, total_ = 0;
};

void Gather::validate() {
  const std::string& ctx = context();
  if (!rejection_.empty()) core::fail(ctx, "{}", rejection_);
  check_ready(state_, ctx);
  session_ = state_.open_session();
  start_ = state_.cursor();
  slot_ = state_.slots_used();
  if (tensors_.empty()) core::fail(ctx, "needs at least one tensor (got 0)");
  std::int64_t cursor = start_;
  for (std::size_t i = 0; i < tensors_.size(); ++i) plan_input(i, cursor);
  check_slot(state_, ctx);
  end_ = cursor;
}

// Checks input i, places its block at `cursor` and moves the cursor past it.
void Gather::plan_input(std::size_t i, std::int64_t& cursor) {
  const std::string& ctx = context();
  const std::string name = input_name(i, tensors_.size(), "t");
  const TensorView& t = tensors_[i];
  const engine::EngineFacts& f = state_.engine().facts;
  if (!t.defined()) core::fail(ctx, "{} is not a tensor (undefined)", name);
  core::expect_device(ctx, name, t, {kDLCPU, 0});
  core::expect_contiguous(ctx, name, t);
  if (t.ndim() > kMaxTensorDims - 1)
    core::fail(ctx, "{} is {}: {} dimensions; the result adds one and tensors have at most {}", name, t.describe(),
               t.ndim(), kMaxTensorDims);
  Planned p;
  p.bytes = static_cast<std::int64_t>(t.nbytes());
  p.offset = cursor;
  const std::int64_t block = block_bytes(p.bytes, f.num_ranks);
  const std::int64_t end = block < 0 ? -1 : plus(cursor, block);
  if (end < 0 || end > state_.session_bytes()) out_of_bytes(state_, ctx, name, cursor, end);
  // An input inside the region is in place: exactly where this rank's row of its block lies.
  const auto address = reinterpret_cast<std::uintptr_t>(t.data());
  const auto low = reinterpret_cast<std::uintptr_t>(state_.base());
  const auto high = low + static_cast<std::uintptr_t>(state_.session_bytes());
  if (p.bytes > 0 && address < high && address + static_cast<std::uintptr_t>(p.bytes) > low) {
    const std::int64_t expected = p.offset + p.bytes * f.rank;  // < end: no overflow
    const auto at = static_cast<std::int64_t>(address - low);
    if (address < low || at != expected)
      core::fail(ctx, "{} lies in the session region at byte offset {}, but an input there must be at its in-place "
                 "position {} (its block's offset {} + {} bytes x rank {}; agrs_get_inplace_tensor gives it)",
                 name, address < low ? -static_cast<std::int64_t>(low - address) : at, expected, p.offset, p.bytes,
                 f.rank);
    p.in_place = true;
  }
  total_ = plus(total_, p.bytes);
  planned_.push_back(p);
  cursor = end;
}

// Every rank's input i has the same byte count (the count of inputs and their total were agreed).
void Gather::check_sizes(const std::vector<std::span<const std::byte>>& payloads) const {
  for (std::size_t i = 0; i < planned_.size(); ++i) {
    std::map<int, std::string> held;
    for (std::size_t r = 0; r < payloads.size(); ++r) {
      std::int64_t bytes = -1;
      if (payloads[r].size() == planned_.size() * sizeof(std::int64_t))
        std::memcpy(&bytes, payloads[r].data() + i * sizeof(std::int64_t), sizeof bytes);
      held[static_cast<int>(r)] = fmt::format("{} bytes", bytes);
    }
    if (auto e = comm::disagreement(context(), fmt::format("the size of {}", input_name(i, planned_.size(), "t")), held,
                                    state_.engine().facts.rank,
                                    "every rank must make the same all_gather calls with the same byte sizes"))
      throw *e;
  }
}

void Gather::run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>&) {
  in_step([&] { check_sizes(payloads); });
  engine::Engine& e = state_.engine();
  state_.advance(end_);
  write();
  e.transport().barrier(comm::Scope::kWorld, e.facts.wait("all_gather: arrival"));
  const std::int64_t num_ranks = e.facts.num_ranks;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    std::vector<std::int64_t> shape{num_ranks};
    shape.insert(shape.end(), tensors_[i].shape().begin(), tensors_[i].shape().end());
    result.gathered.push_back(state_.view(planned_[i].offset, tensors_[i].dtype(), shape));
  }
  result.handle = AgrsHandle(state_.weak_from_this(), session_, e.facts.rank);
  core::trace(core::Subsys::kColl, "{}: {} tensor(s), {} bytes, session {} bytes [{}, {}), slot {}", context(),
              tensors_.size(), total_, session_, start_, end_, slot_);
}

// This rank's row of every block, on every rank (itself too unless the input is in place).
void Gather::write() {
  engine::Engine& e = state_.engine();
  const int rank = e.facts.rank, num_ranks = e.facts.num_ranks;
  comm::PeerReads section(e.transport(), "all_gather: writes");
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Planned& p = planned_[i];
    if (p.bytes == 0) continue;
    for (int k = 1; k <= num_ranks; ++k) {
      const int peer = (rank + k) % num_ranks;  // this rank last
      if (peer == rank && p.in_place) continue;
      std::byte* base = peer == rank ? state_.base() : state_.peer_base(peer);
      std::memcpy(base + p.offset + p.bytes * rank, tensors_[i].data(), static_cast<std::size_t>(p.bytes));
    }
  }
}

}  // namespace

AgrsRegion::~AgrsRegion() {
  if (retire) comm::retire(std::move(memory));
}

AgrsState::AgrsState(engine::Engine& engine) : engine_(engine), rank_(engine.facts.rank) {}

AgrsState::~AgrsState() { release(false, "ElasticBuffer destruction"); }

void AgrsState::set_config(std::int64_t num_max_session_bytes, int num_max_all_gathers_per_session,
                           const std::string& rejection) {
  engine_.check_usable("agrs_set_config");
  engine_.run_sync(std::make_shared<SetConfig>(*this, num_max_session_bytes, num_max_all_gathers_per_session,
                                               rejection, engine_.next_sequence()));
}

void AgrsState::create_session() {
  const std::string ctx = engine_.facts.context("create_agrs_session");
  engine_.check_usable("create_agrs_session");
  if (open_session() != 0)
    throw StateError(fmt::format("{}: session {} is already open (destroy_agrs_session first)", ctx, open_session()));
  cursor_ = 0;
  slots_ = 0;
  open_.store(++sessions_, std::memory_order_release);
}

void AgrsState::destroy_session() {
  engine_.check_usable("destroy_agrs_session");
  engine_.run_sync(std::make_shared<EndSession>(*this, engine_.next_sequence()));
}

std::vector<Tensor> AgrsState::inplace_tensors(std::span<const AgrsShape> shapes, DType dtype) {
  const std::string ctx = engine_.facts.context("agrs_get_inplace_tensor");
  engine_.check_usable("agrs_get_inplace_tensor");
  check_ready(*this, ctx);
  if (shapes.empty()) core::fail(ctx, "needs at least one shape (got 0)");
  std::vector<Tensor> out;
  std::int64_t offset = cursor_;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const std::string name = input_name(i, shapes.size(), "shapes");
    const std::int64_t bytes = shape_bytes(ctx, name, shapes[i], dtype);
    const std::int64_t all = times(bytes, engine_.facts.num_ranks);
    const std::int64_t need = all < 0 ? -1 : plus(offset, all);
    if (need < 0 || need > bytes_) out_of_bytes(*this, ctx, name, offset, need);
    out.push_back(view(offset + bytes * rank_, dtype, shapes[i]));
    offset = round_up(need, kAgrsAlignment);  // need <= S, a multiple of 32: no overflow
  }
  check_slot(*this, ctx);
  return out;
}

AllGatherResult AgrsState::all_gather(std::span<const TensorView> tensors, const std::string& rejection) {
  engine_.check_usable("all_gather");
  auto op = std::make_shared<Gather>(*this, tensors, rejection, engine_.next_sequence());
  engine_.run_sync(op);
  return std::move(op->result);
}

void AgrsState::check_handle(std::uint64_t session) const {
  const std::uint64_t open = open_session();
  if (open != session)
    throw StateError(fmt::format("[rank {}] all_gather handle: called outside its session {} ({}); a handle is valid "
                                 "until its session ends",
                                 rank_, session, open == 0 ? std::string("no session is open")
                                                           : fmt::format("session {} is open", open)));
}

void AgrsState::release(bool collective, const char* operation) {
  close_session();
  if (!region_) return;
  if (!collective) return drop_region(true);  // what peers hold is unknown: as if kept
  engine_.check_usable(operation);
  engine_.run_sync(std::make_shared<Release>(*this, operation, engine_.next_sequence()));
}

void AgrsState::drop_region(bool kept) {
  if (!region_) return;
  // Memory freed collectively (MPI windows) is freed now on every rank when no rank holds a
  // tensor of it; else it stays mapped. Other memory goes with its last tensor.
  if (kept && !region_->free_alone) region_->retire = true;
  region_.reset();
  bytes_ = 0;
  slots_limit_ = 0;
}

void AgrsState::install_region(std::unique_ptr<comm::SymmetricMemory> memory, std::int64_t bytes, int slots) {
  const bool free_alone = engine_.transport().ranks_share_address_space() || memory->peers_hold_own_mappings();
  region_ = std::make_shared<AgrsRegion>(std::move(memory), free_alone);
  bytes_ = bytes;
  slots_limit_ = slots;
}

Tensor AgrsState::view(std::int64_t offset, DType dtype, std::span<const std::int64_t> shape) const {
  std::byte* base = region_->memory->local();
  const Tensor all = Tensor::adopt(std::shared_ptr<void>(region_), base, static_cast<std::size_t>(bytes_));
  return all.with_view(TensorView(base + offset, dtype, shape));
}

}  // namespace moe_ep::elastic

namespace moe_ep {

void AgrsHandle::operator()() const {
  const std::shared_ptr<const elastic::AgrsState> state = state_.lock();
  if (!state) throw StateError(fmt::format("[rank {}] all_gather handle: its buffer no longer exists", rank_));
  state->check_handle(session_);
}

std::int64_t ElasticBuffer::get_agrs_num_max_session_bytes(const Group& group, std::span<const AgrsShape> shapes,
                                                           DType dtype) {
  const std::string ctx = fmt::format("[rank {}] get_agrs_num_max_session_bytes", group.rank());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const std::string name = elastic::input_name(i, shapes.size(), "shapes");
    const std::int64_t block = elastic::block_bytes(elastic::shape_bytes(ctx, name, shapes[i], dtype), group.size());
    total = block < 0 ? -1 : elastic::plus(total, block);
    if (total < 0) core::fail(ctx, "the session bytes of {} do not fit in int64", name);
  }
  return total;
}

std::int64_t ElasticBuffer::get_agrs_buffer_size_hint(const Group& group, std::int64_t num_max_session_bytes) {
  const std::int64_t hint = elastic::round_up(num_max_session_bytes, kBufferAlignment);
  if (num_max_session_bytes < 0 || hint < 0)
    core::fail(fmt::format("[rank {}] get_agrs_buffer_size_hint", group.rank()),
               "num_max_session_bytes = {} is outside [0, {}]", num_max_session_bytes, INT64_MAX - kBufferAlignment + 1);
  return hint;
}

elastic::AgrsState& ElasticBuffer::agrs_state() {
  if (!agrs_) agrs_ = std::make_shared<elastic::AgrsState>(*engine_);
  return *agrs_;
}

void ElasticBuffer::release_agrs(bool collective, const char* operation) {
  std::lock_guard lock(calls_);
  if (agrs_) agrs_->release(collective, operation);
}

void ElasticBuffer::agrs_set_config(std::int64_t num_max_session_bytes, int num_max_all_gathers_per_session,
                                    const std::string& rejection) {
  std::lock_guard lock(calls_);
  agrs_state().set_config(num_max_session_bytes, num_max_all_gathers_per_session, rejection);
}

void ElasticBuffer::create_agrs_session() {
  std::lock_guard lock(calls_);
  agrs_state().create_session();
}

void ElasticBuffer::destroy_agrs_session() {
  std::lock_guard lock(calls_);
  agrs_state().destroy_session();
}

std::vector<Tensor> ElasticBuffer::agrs_get_inplace_tensor(std::span<const AgrsShape> shapes, DType dtype) {
  std::lock_guard lock(calls_);
  return agrs_state().inplace_tensors(shapes, dtype);
}

AllGatherResult ElasticBuffer::all_gather(std::span<const TensorView> tensors, const std::string& rejection) {
  std::lock_guard lock(calls_);
  return agrs_state().all_gather(tensors, rejection);
}

}  // namespace moe_ep
