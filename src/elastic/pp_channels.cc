#include "elastic/pp_channels.hh"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "comm/peer_failure.hh"
#include "core/arith.hh"
#include "core/checks.hh"
#include "core/v2_contract.hh"
#include "elastic/collective_call.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::elastic {
namespace {

using Wide = __int128;

constexpr std::int64_t kAlign = 32;  // DeepEP's unit of PP sizes (TMA copies)

// What starts every slot: the byte count and the message's number on its channel.
struct Header {
  std::uint64_t bytes;
  std::uint64_t number;
  std::uint64_t reserved[2];
};
static_assert(sizeof(Header) == kAlign, "the data after the header stays 32-byte aligned");

// What each rank publishes in pp_set_config: its counts per neighbour (PpChannels::Counts).
struct Published {
  std::uint64_t sent[2];
  std::uint64_t received[2];
};


// Every message sent has been received: else StateError naming the first pair that has some in flight.
void check_drained(const std::string& ctx, const std::vector<Published>& all) {
  const int R = static_cast<int>(all.size());
  // Rank r's messages to its next are its slot 1 (0 when prev == next); the next keeps them as
  // those of its prev (slot 0). Those to its prev are its slot 0, the prev's slot 1 (0 when R <= 2).
  const int far = R <= 2 ? 0 : 1;
  for (int r = 0; r < R; ++r) {
    const int n = (r + 1) % R, p = (r - 1 + R) % R;
    const std::pair<std::uint64_t, std::uint64_t> pairs[2] = {
        {all[static_cast<size_t>(r)].sent[far], all[static_cast<size_t>(n)].received[0]},
        {all[static_cast<size_t>(r)].sent[0], all[static_cast<size_t>(p)].received[far]}};
    const int receivers[2] = {n, p};
    for (int i = 0; i < 2; ++i)
      if (pairs[i].first != pairs[i].second)
        throw StateError(fmt::format("{}: {} message(s) from rank {} to rank {} are not received yet (sent {}, received "
                                     "{}); receive them before pp_set_config replaces the receive slots",
                                     ctx, pairs[i].first - pairs[i].second, r, receivers[i], pairs[i].first,
                                     pairs[i].second));
  }
}

}  // namespace

PpChannels::~PpChannels() = default;

std::int64_t PpChannels::size_hint(std::int64_t num_max_tensor_bytes, std::int64_t num_max_inflight_tensors) {
  const char* ctx = "get_pp_buffer_size_hint";
  if (num_max_tensor_bytes < 0 || num_max_inflight_tensors < 0)
    throw InvalidArgument(fmt::format("{}: num_max_tensor_bytes = {} and num_max_inflight_tensors = {} must not be "
                                      "negative", ctx, num_max_tensor_bytes, num_max_inflight_tensors));
  const Wide slot = core::round_up<Wide>(num_max_tensor_bytes, kAlign);
  const Wide bytes = core::round_up<Wide>(slot * num_max_inflight_tensors * 4, kBufferAlignment);
  if (bytes > INT64_MAX)
    throw InvalidArgument(fmt::format("{}: {} x {} messages do not fit in 64 bits", ctx, num_max_tensor_bytes,
                                      num_max_inflight_tensors));
  return static_cast<std::int64_t>(bytes);
}

void PpChannels::set_config(std::int64_t bytes, std::int64_t inflight, std::int64_t buffer_bytes,
                            const std::string& rejection) {
  const engine::EngineFacts& f = engine_.facts;
  CollectiveCall call;
  call.rejection = rejection;
  call.validate = [&](const std::string& ctx) {
    if (bytes <= 0 || inflight <= 0)
      core::fail(ctx, "num_max_tensor_bytes = {} and num_max_inflight_tensors = {} must be positive", bytes, inflight);
    const Wide need = Wide{bytes} * inflight * 4;
    if (need > buffer_bytes)
      core::fail(ctx, "num_max_tensor_bytes * num_max_inflight_tensors * 4 = {} * {} * 4 = {} exceeds num_bytes = {}",
                 bytes, inflight, static_cast<std::int64_t>(need), buffer_bytes);
  };
  call.describe = [&](comm::Agreement& a) {
    a.field("num_max_tensor_bytes", bytes).field("num_max_inflight_tensors", inflight);
  };
  call.publish = [&] {
    const Published mine{{counts_.sent[0], counts_.sent[1]}, {counts_.received[0], counts_.received[1]}};
    const auto* p = reinterpret_cast<const std::byte*>(&mine);
    return std::vector<std::byte>(p, p + sizeof mine);
  };
  call.run = [&](const Payloads& payloads, const InStep& in_step) {
    const std::string ctx = f.context("pp_set_config");
    in_step([&] { check_drained(ctx, engine::payload_per_rank<Published>(payloads, ctx)); });
    const int R = f.num_ranks;
    rebuild(Config{static_cast<std::int64_t>(core::round_up<Wide>(bytes, kAlign)), inflight, (f.rank - 1 + R) % R,
                   (f.rank + 1) % R});
  };
  run_collective(engine_, "pp_set_config", std::move(call));
}

// After the agreement: every rank replaces its channels and slots in the same order.
void PpChannels::rebuild(const Config& config) {
  const engine::EngineFacts& f = engine_.facts;
  slots_.reset();
  data_.reset();
  credits_.reset();
  self_slots_ = Tensor();
  configured_ = false;
  config_ = config;
  const auto slots = static_cast<std::int64_t>(slot_bytes()) * config.depth;
  if (f.num_ranks == 1) {
    self_slots_ = Tensor::empty({slots}, DType::kUInt8);
  } else {
    data_ = engine_.transport().duplicate(f.wait("pp_set_config: data channel"));
    credits_ = engine_.transport().duplicate(f.wait("pp_set_config: credit channel"));
    const int areas = f.num_ranks <= 2 ? 1 : 2;  // messages of prev and of next (one area when they are one rank)
    slots_ = data_->allocate_symmetric(static_cast<std::size_t>(slots * areas), f.wait("pp_set_config: receive slots"),
                                       false);
    data_->set_inflight_limit(static_cast<int>(std::min<std::int64_t>(config.depth + 1, INT_MAX)));
  }
  // Nothing is in flight (check_drained): every message sent was received and credited.
  counts_.credited = counts_.sent;
  base_received_ = counts_.received;
  base_credited_ = counts_.credited;
  closed_.clear();
  configured_ = true;
}

void PpChannels::retire() { comm::retire(std::move(slots_)); }

std::size_t PpChannels::slot_bytes() const { return static_cast<std::size_t>(kAlign + config_.message_bytes); }

std::size_t PpChannels::slot_offset(int sender, int receiver, std::uint64_t count) const {
  const int R = engine_.facts.num_ranks;
  const int area = R <= 2 || sender == (receiver - 1 + R) % R ? 0 : 1;
  const auto D = static_cast<std::uint64_t>(config_.depth);
  return static_cast<std::size_t>((static_cast<std::uint64_t>(area) * D + count % D) * slot_bytes());
}

std::byte* PpChannels::slot_memory(int peer, std::uint64_t count) {
  const engine::EngineFacts& f = engine_.facts;
  if (f.num_ranks == 1) return static_cast<std::byte*>(self_slots_.data()) + slot_offset(peer, f.rank, count);
  return slots_->local() + slot_offset(peer, f.rank, count);
}

int PpChannels::neighbour(const std::string& ctx, const char* argument, int peer) const {
  if (peer == config_.prev) return 0;
  if (peer == config_.next) return 1;
  core::fail(ctx, "{} = {} is not a ring neighbour of rank {}: PP messages go to or come from prev = {} or next = {}",
             argument, peer, engine_.facts.rank, config_.prev, config_.next);
}

void PpChannels::check_open(const std::string& ctx) const {
  if (!configured_) throw StateError(fmt::format("{}: PP is not configured: call pp_set_config first", ctx));
  if (!closed_.empty())
    throw StateError(fmt::format("{}: the PP channels were closed after a failure ({}); pp_set_config sets them up "
                                 "again", ctx, closed_));
}

void PpChannels::check_tensor(const std::string& ctx, const TensorView& t, int num_sms) const {
  core::v2::check_call(ctx, num_sms, false);
  if (!t.defined()) core::fail(ctx, "t is required (a contiguous host tensor)");
  core::expect_device(ctx, "t", t, {kDLCPU, 0});
  core::expect_contiguous(ctx, "t", t);
  const auto bytes = static_cast<std::int64_t>(t.nbytes());
  if (bytes > config_.message_bytes)
    throw CapacityError(fmt::format("{}: t {} has {} bytes, more than num_max_tensor_bytes rounded up to 32 = {}", ctx,
                                    t.describe(), bytes, config_.message_bytes),
                        bytes, config_.message_bytes);
  if (bytes % kAlign != 0)
    core::fail(ctx, "t {} has {} bytes, not a multiple of 32 (DeepEP's PP moves whole 32-byte units)", t.describe(),
               bytes);
}

template <class Fn>
void PpChannels::guarded_wait(Fn fn) {
  try {
    fn();
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    closed_ = comm::message_of(error);
    const std::vector<int> culprits = comm::culprits_of(error);
    if (data_) data_->abandon(closed_, culprits);
    if (credits_) credits_->abandon(closed_, culprits);
    throw;
  }
}

void PpChannels::send(const TensorView& t, int dst, int num_sms) {
  const engine::EngineFacts& f = engine_.facts;
  const std::string ctx = f.context("pp_send");
  engine_.check_usable("pp_send");
  check_open(ctx);
  const int i = neighbour(ctx, "dst_rank_idx", dst);
  check_tensor(ctx, t, num_sms);
  const std::uint64_t n = counts_.sent[static_cast<size_t>(i)];
  const auto D = static_cast<std::uint64_t>(config_.depth);
  if (n - counts_.credited[static_cast<size_t>(i)] >= D) {
    if (f.num_ranks == 1)
      throw StateError(fmt::format("{}: send: receive buffer full: {} messages to rank {} (this rank) are unreceived, "
                                   "and only this rank receives them", ctx, D, dst));
    const std::uint64_t credits = n - D + 1;
    const std::string phase = fmt::format("pp_send: send: receive buffer full (rank {} has not received {} messages "
                                          "from rank {})", dst, D, f.rank);
    const int peers[] = {dst};
    const std::uint64_t targets[] = {credits - base_credited_[static_cast<size_t>(i)]};
    guarded_wait([&] { credits_->wait_signals(peers, targets, f.wait(phase.c_str())); });
    counts_.credited[static_cast<size_t>(i)] = credits;
  }
  const Header header{t.nbytes(), n, {0, 0}};
  auto form = [&](std::byte* to) {
    std::memcpy(to, &header, sizeof header);
    if (t.nbytes() > 0) std::memcpy(to + sizeof header, t.data(), t.nbytes());
  };
  if (f.num_ranks == 1) {
    form(slot_memory(f.rank, n));
  } else {
    guarded_wait([&] {
      data_->put_formed(dst, *slots_, slot_offset(f.rank, dst, n), sizeof header + t.nbytes(), form);
      data_->signal(dst);
    });
  }
  counts_.sent[static_cast<size_t>(i)] = n + 1;
}

void PpChannels::recv(const TensorView& t, int src, int num_sms) {
  const engine::EngineFacts& f = engine_.facts;
  const std::string ctx = f.context("pp_recv");
  engine_.check_usable("pp_recv");
  check_open(ctx);
  const int i = neighbour(ctx, "src_rank_idx", src);
  check_tensor(ctx, t, num_sms);
  const std::uint64_t n = counts_.received[static_cast<size_t>(i)];
  if (f.num_ranks == 1) {
    if (counts_.sent[0] == n)
      throw StateError(fmt::format("{}: receive buffer empty: no message from rank {} (this rank) is queued, and only "
                                   "this rank sends to itself", ctx, src));
  } else {
    const std::string phase = fmt::format("pp_recv: receive buffer empty (no message from rank {})", src);
    const int peers[] = {src};
    const std::uint64_t targets[] = {n + 1 - base_received_[static_cast<size_t>(i)]};
    guarded_wait([&] { data_->wait_signals(peers, targets, f.wait(phase.c_str())); });
  }
  const std::byte* slot = slot_memory(src, n);
  Header header;
  std::memcpy(&header, slot, sizeof header);
  if (header.number != n)
    throw StateError(fmt::format("{}: the slot of message {} from rank {} holds message {}: the ranks are out of step",
                                 ctx, n, src, header.number));
  if (header.bytes != t.nbytes())
    core::fail(ctx, "the next message from rank {} has {} bytes, but t {} has {} bytes (the message stays queued)", src,
               header.bytes, t.describe(), t.nbytes());
  if (t.nbytes() > 0) std::memcpy(t.data(), slot + sizeof header, t.nbytes());
  counts_.received[static_cast<size_t>(i)] = n + 1;
  if (f.num_ranks == 1) {
    counts_.credited[0] = n + 1;
  } else {
    guarded_wait([&] { credits_->signal(src); });
  }
}

}  // namespace moe_ep::elastic
