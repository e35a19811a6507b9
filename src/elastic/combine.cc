// ElasticBuffer::combine. Reduction order and rounding: docs/semantics.md ("Combine").
//
// A token's contributions are grouped into units, each keyed by a top-k position (its master
// lane), and summed in ascending key order after the biases, in FP32 with one BF16 rounding:
//  - compact layout: one unit per destination rank (the row that rank returned);
//  - expanded layout with multiple reduction: one unit per destination rank, itself the sum of
//    that rank's lanes in ascending order, rounded to BF16 (level 1);
//  - expanded layout without multiple reduction: one unit per lane;
//  - hybrid with multiple reduction: one unit per destination node, the sum of that node's rank
//    units in ascending master-lane order, rounded to BF16 (level 2).
// Units with a single input are passed through unchanged.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "comm/agreement.hh"
#include "core/checks.hh"
#include "core/reduce.hh"
#include "elastic/buffer_core.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::elastic {
namespace {

constexpr std::int64_t kTokensPerTask = 8;

// Per-thread rows for intermediate sums: at most one per rank unit (level 1) and one per node
// unit (level 2) of a token, so 2 * kMaxTopk + 2 rows. Sized before a token is reduced, so the
// rows never move while pointers to them are live.
constexpr int kScratchRows = 2 * kMaxTopk + 2;
thread_local std::vector<std::uint16_t> scratch_rows;

void prepare_scratch(std::int64_t hidden) {
  const std::size_t need = static_cast<std::size_t>(kScratchRows) * static_cast<std::size_t>(hidden);
  if (scratch_rows.size() < need) scratch_rows.resize(need);
}

std::uint16_t* scratch_row(int index, std::int64_t hidden) {
  return scratch_rows.data() + static_cast<std::size_t>(index) * static_cast<std::size_t>(hidden);
}

struct Unit {
  int key;
  const std::uint16_t* row;
};

class Combine final : public CombineOperation {
 public:
  Combine(BufferCore& core, const CombineArgs& args, std::uint64_t sequence)
      : core_(core), args_(args), sequence_(sequence), ctx_(core.context("combine")) {
    previous_event = args.previous_event;
    try {
      validate();
    } catch (...) {
      local_error = std::current_exception();
    }
  }

  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override;
  void run(const std::function<void()>& outputs_ready) override;

 private:
  void validate();
  void put_contributions();
  void wait_contributions();
  void reduce_tokens();

  // Row r of rank d's combine input (d on this node).
  const std::uint16_t* row_of(int d, std::int32_t r) const {
    const PeerTensors& p = peers_[static_cast<size_t>(d)];
    return reinterpret_cast<const std::uint16_t*>(
        static_cast<const std::byte*>(core_.transport().node_address(d, p.x)) + r * p.x_row_bytes);
  }
  // The weight that lane j's rank (on this node) returned for the token: column j of the rank's
  // row at its master lane (compact), or the weight of lane j's expanded row.
  float lane_weight(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int j) const {
    const int d = geo_.rank_of_expert(ids[j]);
    const PeerTensors& p = peers_[static_cast<size_t>(d)];
    const float* w = static_cast<const float*>(core_.transport().node_address(d, p.weights));
    if (expand_) return w[expanded[j]];
    for (int l = k_ - 1; l >= 0; --l)
      if (ids[l] >= 0 && geo_.rank_of_expert(ids[l]) == d) return w[rows[l] * p.weights_row + j];
    return 0.0f;
  }
  // The unit of destination rank d (on this node) for a token: its row, or the level-1 sum of
  // its lanes (expanded layout). rows/expanded: the token's rows at the lanes' ranks.
  const std::uint16_t* rank_unit(int d, const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded,
                                 int& scratch) const;
  // Fills `units` with the units of the token's destinations on this node, for combine targets
  // selected by `take(rank)`; keys are master lanes (or lanes without multiple reduction).
  int node_units(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int node,
                 std::array<Unit, kMaxTopk>& units, int& scratch) const;
  // Level 2: the sum of a node's rank units in ascending master-lane order (null if none).
  const std::uint16_t* node_sum(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded,
                                int node, int& scratch) const;
  std::byte* combine_record(int key, std::int32_t token) {
    return core_.memory().local() + (static_cast<std::int64_t>(key) * max_tokens_ + token) * record_.bytes;
  }
  void put_record(int peer, int key, std::int32_t token, const std::uint16_t* payload, const float* weights);

  BufferCore& core_;
  CombineArgs args_;
  std::uint64_t sequence_;
  std::string ctx_;
  const HandleState* plan_ = nullptr;
  bool expand_ = false, multi_ = true, has_weights_ = false;
  int N_ = 0, H_ = 0, k_ = 0, max_tokens_ = 0;
  CombineRecord record_{1, 1};
  routing::Geometry geo_;
  std::vector<PeerTensors> peers_;
};

void Combine::validate() {
  const auto& a = args_;
  if (!a.handle) core::fail(ctx_, "handle is missing");
  const EPHandle& h = *a.handle;
  if (!h.state || h.state->buffer_id != core_.id)
    core::fail(ctx_, "handle was created by another buffer (buffer id {}, this buffer {})",
               h.state ? h.state->buffer_id : 0, core_.id);
  plan_ = h.state.get();
  expand_ = h.do_expand;
  multi_ = core_.config.allow_multiple_reduction;
  N_ = h.num_tokens;
  H_ = h.hidden;
  k_ = h.num_topk;
  max_tokens_ = h.num_max_tokens_per_rank;
  geo_ = routing::Geometry{core_.num_ranks, h.num_experts, core_.logical_scaleout};
  const std::int64_t rows = expand_ ? h.num_expanded_tokens : h.num_recv_tokens;
  core::expect_tensor(ctx_, "x", a.x, DType::kBF16, {-1, -1});
  core::expect_rows_contiguous(ctx_, "x", a.x);
  if (a.x.size(0) != rows)
    core::fail(ctx_, "x has {} rows, the handle's {} layout has {}", a.x.size(0), expand_ ? "expanded" : "compact", rows);
  if (a.x.size(1) != H_) core::fail(ctx_, "x has hidden size {}, the handle was made for {}", a.x.size(1), H_);
  has_weights_ = a.topk_weights.defined();
  if (has_weights_) {
    if (expand_) {
      core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {rows});
    } else {
      core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {rows, k_});
    }
    core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  }
  if (a.bias.size() > 2) core::fail(ctx_, "{} bias tensors given, at most 2 are accepted", a.bias.size());
  for (std::size_t b = 0; b < a.bias.size(); ++b) {
    const std::string name = fmt::format("bias[{}]", b);
    core::expect_tensor(ctx_, name, a.bias[b], DType::kBF16, {N_, H_});
    core::expect_rows_contiguous(ctx_, name, a.bias[b]);
  }
  if (a.num_sms < 0 || a.num_sms > 1024) core::fail(ctx_, "num_sms = {} is outside [0, 1024]", a.num_sms);
  core_.check_num_qps(ctx_, a.num_qps);
  record_ = CombineRecord(H_, k_);
  const RegionSizes need = region_sizes(core_.paths, max_tokens_, H_, 0, 0, k_, multi_);
  if (need.combine_bytes > core_.num_bytes)
    throw CapacityError(fmt::format("{}: this call needs {} bytes of buffer (num_max_tokens_per_rank = {}, hidden = {}, "
                                    "k = {}), the buffer holds {}", ctx_, align_to(need.combine_bytes, kBufferAlignment),
                                    max_tokens_, H_, k_, core_.num_bytes),
                        align_to(need.combine_bytes, kBufferAlignment), core_.num_bytes);
}

void Combine::allocate_outputs_early() {
  result.combined_x = Tensor::empty({N_, H_}, DType::kBF16);
  if (has_weights_) result.combined_topk_weights = Tensor::empty({N_, k_}, DType::kFP32);
}

void Combine::run(const std::function<void()>& outputs_ready) {
  // Everything before the agreement reports failure through it (see Dispatch::run).
  std::exception_ptr error = local_error;
  PeerTensors mine;
  if (!error) {
    try {
      core_.wait_for_event(previous_event, ctx_, "previous_event");
      if (!result.combined_x.defined()) allocate_outputs_early();
      core_.resolve_workers(args_.num_sms > 0 ? args_.num_sms : args_.handle->num_sms, geo_.num_experts, k_);
      mine.x = static_cast<const std::byte*>(args_.x.data());
      mine.x_row_bytes = args_.x.stride(0) * 2;
      if (has_weights_) {
        mine.weights = args_.topk_weights.data_as<const float>();
        mine.weights_row = expand_ ? 1 : args_.topk_weights.stride(0);
      }
      mine.num_tokens = N_;
    } catch (...) {
      error = std::current_exception();
    }
  }
  comm::Agreement agreement(ctx_, "combine");
  agreement.local_error(error)
      .field("operation number", static_cast<std::int64_t>(sequence_))
      .field("handle's dispatch number", error ? 0 : static_cast<std::int64_t>(plan_->dispatch_sequence))
      .field("do_expand (handle)", expand_)
      .field("topk_weights given", has_weights_)
      .field("hidden", H_);
  std::vector<std::span<const std::byte>> payloads;
  try {
    payloads = agreement.exchange(core_.transport(), comm::Scope::kWorld, core_.wait("combine: agreement"),
                                  std::as_bytes(std::span(&mine, 1)));
  } catch (...) {
    in_step_failure = agreement.gathered();
    throw;
  }
  peers_.resize(payloads.size());
  for (std::size_t r = 0; r < payloads.size(); ++r) {
    if (payloads[r].size() != sizeof(PeerTensors))
      throw StateError(fmt::format("{}: rank {} published {} bytes, expected {}", ctx_, r, payloads[r].size(),
                                   sizeof(PeerTensors)));
    std::memcpy(&peers_[r], payloads[r].data(), sizeof(PeerTensors));
  }
  outputs_ready();
  core_.wait_for_event(args_.previous_event_before_epilogue, ctx_, "previous_event_before_epilogue");
  put_contributions();
  wait_contributions();
  reduce_tokens();
  core_.transport().barrier(comm::Scope::kNode, core_.wait("combine: exit"));
}

const std::uint16_t* Combine::rank_unit(int d, const std::int64_t* ids, const std::int32_t* rows,
                                        const std::int32_t* expanded, int& scratch) const {
  if (!expand_) {
    for (int j = k_ - 1; j >= 0; --j)
      if (ids[j] >= 0 && geo_.rank_of_expert(ids[j]) == d) return row_of(d, rows[j]);
    return nullptr;
  }
  std::array<const std::uint16_t*, kMaxTopk> lanes;
  int n = 0;
  for (int j = 0; j < k_; ++j)
    if (ids[j] >= 0 && geo_.rank_of_expert(ids[j]) == d) lanes[static_cast<size_t>(n++)] = row_of(d, expanded[j]);
  if (n == 1) return lanes[0];
  std::uint16_t* out = scratch_row(scratch++, H_);
  core::sum_bf16_rows({lanes.data(), static_cast<size_t>(n)}, out, H_);
  return out;
}

int Combine::node_units(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int node,
                        std::array<Unit, kMaxTopk>& units, int& scratch) const {
  int n = 0;
  if (expand_ && !multi_) {
    for (int j = 0; j < k_; ++j)
      if (ids[j] >= 0 && core_.node_of(geo_.rank_of_expert(ids[j])) == node)
        units[static_cast<size_t>(n++)] = {j, row_of(geo_.rank_of_expert(ids[j]), expanded[j])};
    return n;
  }
  std::array<routing::Destination, kMaxTopk> dests;
  const int nd = routing::token_ranks(ids, k_, geo_, dests);
  for (int i = 0; i < nd; ++i) {
    const auto& d = dests[static_cast<size_t>(i)];
    if (core_.node_of(d.target) != node) continue;
    units[static_cast<size_t>(n++)] = {d.master_lane, rank_unit(d.target, ids, rows, expanded, scratch)};
  }
  return n;
}

const std::uint16_t* Combine::node_sum(const std::int64_t* ids, const std::int32_t* rows,
                                       const std::int32_t* expanded, int node, int& scratch) const {
  std::array<Unit, kMaxTopk> units;
  const int n = node_units(ids, rows, expanded, node, units, scratch);
  if (n <= 1) return n == 1 ? units[0].row : nullptr;
  std::array<const std::uint16_t*, kMaxTopk> rows_in;
  for (int i = 0; i < n; ++i) rows_in[static_cast<size_t>(i)] = units[static_cast<size_t>(i)].row;
  std::uint16_t* sum = scratch_row(scratch++, H_);
  core::sum_bf16_rows({rows_in.data(), static_cast<size_t>(n)}, sum, H_);
  return sum;
}

void Combine::put_record(int peer, int key, std::int32_t token, const std::uint16_t* payload, const float* weights) {
  const std::int64_t offset = (static_cast<std::int64_t>(key) * max_tokens_ + token) * record_.bytes;
  core_.transport().put(peer, core_.memory(), static_cast<std::size_t>(offset), payload, static_cast<std::size_t>(H_) * 2);
  core_.transport().put(peer, core_.memory(), static_cast<std::size_t>(offset + record_.weights_offset), weights,
                        sizeof(float) * static_cast<std::size_t>(k_));
}

// Contributions for tokens whose source is on another node: from each destination rank (direct
// mode) or from the forwarder of the destination node (hybrid mode).
void Combine::put_contributions() {
  if (!core_.paths.hybrid() && !core_.paths.direct_remote()) return;
  const int me = core_.rank, my_node = core_.node_of(me);
  std::array<float, kMaxTopk> weights{};
  std::array<Unit, kMaxTopk> units;
  std::vector<bool> signalled(static_cast<size_t>(geo_.num_ranks), false);
  // Weights of the lanes selected by keep (0 elsewhere).
  auto lane_weights = [&](const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, auto keep) {
    weights.fill(0.0f);
    if (!has_weights_) return;
    for (int j = 0; j < k_; ++j)
      if (ids[j] >= 0 && keep(j)) weights[static_cast<size_t>(j)] = lane_weight(ids, rows, expanded, j);
  };
  prepare_scratch(H_);
  auto send_token = [&](int peer, std::int32_t token, const std::int64_t* ids, const std::int32_t* rows,
                        const std::int32_t* expanded, bool node_unit_key) {
    int scratch = 0;
    if (node_unit_key) {
      // Hybrid with multiple reduction: one level-2 unit for this node, keyed by node.
      const std::uint16_t* payload = node_sum(ids, rows, expanded, my_node, scratch);
      if (payload == nullptr) return;
      lane_weights(ids, rows, expanded, [&](int j) { return core_.node_of(geo_.rank_of_expert(ids[j])) == my_node; });
      put_record(peer, core_.routing_node_of(me), token, payload, weights.data());
    } else {
      const int n = node_units(ids, rows, expanded, my_node, units, scratch);
      if (n == 0) return;
      for (int i = 0; i < n; ++i) {
        const int key = units[static_cast<size_t>(i)].key;
        const int unit_rank = geo_.rank_of_expert(ids[key]);
        lane_weights(ids, rows, expanded, [&](int j) {
          return expand_ && !multi_ ? j == key : geo_.rank_of_expert(ids[j]) == unit_rank;
        });
        put_record(peer, key, token, units[static_cast<size_t>(i)].row, weights.data());
      }
    }
    signalled[static_cast<size_t>(peer)] = true;
  };

  if (core_.paths.hybrid()) {
    for (const ForwardPlan& f : plan_->forward) {
      if (f.source < 0) continue;
      for (std::int32_t slot = 0; slot < f.count; ++slot) {
        const std::size_t base = static_cast<size_t>(slot) * k_;
        send_token(f.source, f.token[static_cast<size_t>(slot)], &f.ids[base], &f.rows[base], &f.expanded[base], multi_);
      }
    }
  } else {
    // Direct: this rank returns the rows it received from other nodes' ranks.
    std::array<std::int64_t, kMaxTopk> ids;
    std::array<std::int32_t, kMaxTopk> rows, expanded;
    for (std::size_t i = 0; i < plan_->rows.size(); ++i) {
      const int src = plan_->rows[i].source;
      if (core_.same_node(src)) continue;
      // Rebuild the token's lanes as seen from here: local lanes carry this rank's rows.
      for (int j = 0; j < k_; ++j) {
        const std::int32_t local = plan_->local_ids[i * k_ + j];
        ids[static_cast<size_t>(j)] = local >= 0 ? std::int64_t{me} * geo_.experts_per_rank() + local : -1;
        rows[static_cast<size_t>(j)] = static_cast<std::int32_t>(i);
        expanded[static_cast<size_t>(j)] = expand_ ? plan_->expanded_rows[i * k_ + j] : -1;
      }
      // Keys must be the lanes of the original token: the local lanes are the token's lanes.
      send_token(src, plan_->row_token[i], ids.data(), rows.data(), expanded.data(), false);
    }
  }
  for (int peer = 0; peer < geo_.num_ranks; ++peer)
    if (signalled[static_cast<size_t>(peer)]) core_.transport().signal(peer);
}

void Combine::wait_contributions() {
  if (!core_.paths.hybrid() && !core_.paths.direct_remote()) return;
  const auto& layout = plan_->layout;
  const int me = core_.rank;
  std::vector<int> peers;
  std::vector<std::uint64_t> targets;
  if (core_.paths.hybrid()) {
    const int my_node = core_.routing_node_of(me), SU = core_.logical_scaleup;
    for (int node = 0; node < geo_.num_nodes; ++node) {
      if (node == my_node || layout.node_count(me, node) == 0) continue;
      const int forwarder = node * SU + me % SU;
      peers.push_back(forwarder);
      targets.push_back(core_.expect_signal(forwarder));
    }
  } else {
    for (int d = 0; d < geo_.num_ranks; ++d) {
      if (core_.same_node(d) || layout.count(me, d) == 0) continue;
      peers.push_back(d);
      targets.push_back(core_.expect_signal(d));
    }
  }
  if (!peers.empty()) core_.transport().wait_signals(peers, targets, core_.wait("combine: scale-out contributions"));
}

void Combine::reduce_tokens() {
  const HandleState& plan = *plan_;
  const int my_node = core_.node_of(core_.rank);
  const std::int64_t* topk = plan.topk.data_as<const std::int64_t>();
  const std::int64_t topk_row = plan.topk.defined() ? plan.topk.stride(0) : k_;
  auto* out = result.combined_x.data_as<std::uint16_t>();
  auto* out_w = has_weights_ ? result.combined_topk_weights.data_as<float>() : nullptr;
  const bool hybrid = core_.paths.hybrid();

  core_.pool().parallel_for((N_ + kTokensPerTask - 1) / kTokensPerTask, [&](std::int64_t task) {
    prepare_scratch(H_);
    const int end = static_cast<int>(std::min<std::int64_t>(N_, (task + 1) * kTokensPerTask));
    std::array<Unit, kMaxTopk> units;
    std::array<const std::uint16_t*, kMaxTopk + 2> inputs;
    std::array<routing::Destination, kMaxTopk> dests;
    for (int t = static_cast<int>(task * kTokensPerTask); t < end; ++t) {
      const std::int64_t* ids = topk + t * topk_row;
      const std::int32_t* rows = &plan.dst_row[static_cast<size_t>(t) * k_];
      const std::int32_t* expanded = &plan.dst_expanded[static_cast<size_t>(t) * k_];
      int scratch = 0, n = 0;
      float* w = out_w ? out_w + static_cast<std::int64_t>(t) * k_ : nullptr;
      if (w) std::fill(w, w + k_, 0.0f);
      auto take_remote_weights = [&](const std::byte* record, auto keep) {
        if (!w) return;
        const auto* rw = reinterpret_cast<const float*>(record + record_.weights_offset);
        for (int j = 0; j < k_; ++j)
          if (ids[j] >= 0 && keep(j)) w[j] = rw[j];
      };
      if (hybrid && multi_) {
        const int nn = routing::token_nodes(ids, k_, geo_, dests);
        for (int i = 0; i < nn; ++i) {
          const int node = dests[static_cast<size_t>(i)].target;
          if (node == my_node) {
            units[static_cast<size_t>(n++)] = {dests[static_cast<size_t>(i)].master_lane,
                                               node_sum(ids, rows, expanded, node, scratch)};
          } else {
            const std::byte* record = combine_record(node, t);
            units[static_cast<size_t>(n++)] = {dests[static_cast<size_t>(i)].master_lane,
                                               reinterpret_cast<const std::uint16_t*>(record)};
            take_remote_weights(record, [&](int j) { return geo_.node_of_rank(geo_.rank_of_expert(ids[j])) == node; });
          }
        }
      } else {
        // Units on this node are read in place; units of other nodes arrived as records.
        n = node_units(ids, rows, expanded, my_node, units, scratch);
        if (expand_ && !multi_) {
          for (int j = 0; j < k_; ++j) {
            if (ids[j] < 0 || core_.node_of(geo_.rank_of_expert(ids[j])) == my_node) continue;
            const std::byte* record = combine_record(j, t);
            units[static_cast<size_t>(n++)] = {j, reinterpret_cast<const std::uint16_t*>(record)};
            take_remote_weights(record, [&](int l) { return l == j; });
          }
        } else {
          const int nd = routing::token_ranks(ids, k_, geo_, dests);
          for (int i = 0; i < nd; ++i) {
            const auto& d = dests[static_cast<size_t>(i)];
            if (core_.node_of(d.target) == my_node) continue;
            const std::byte* record = combine_record(d.master_lane, t);
            units[static_cast<size_t>(n++)] = {d.master_lane, reinterpret_cast<const std::uint16_t*>(record)};
            take_remote_weights(record, [&](int j) { return geo_.rank_of_expert(ids[j]) == d.target; });
          }
        }
        std::sort(units.begin(), units.begin() + n, [](const Unit& a, const Unit& b) { return a.key < b.key; });
      }
      // Weights of lanes served on this node.
      for (int j = 0; j < k_ && w; ++j)
        if (ids[j] >= 0 && core_.node_of(geo_.rank_of_expert(ids[j])) == my_node) w[j] = lane_weight(ids, rows, expanded, j);
      int count = 0;
      for (const TensorView& b : args_.bias)
        inputs[static_cast<size_t>(count++)] = b.data_as<const std::uint16_t>() + t * b.stride(0);
      for (int u = 0; u < n; ++u) inputs[static_cast<size_t>(count++)] = units[static_cast<size_t>(u)].row;
      core::sum_bf16_rows({inputs.data(), static_cast<size_t>(count)}, out + static_cast<std::int64_t>(t) * H_, H_);
    }
  });
}

}  // namespace

std::shared_ptr<CombineOperation> make_combine(BufferCore& core, const CombineArgs& args, std::uint64_t sequence) {
  return std::make_shared<Combine>(core, args, sequence);
}

}  // namespace moe_ep::elastic
