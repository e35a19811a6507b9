#include "shared_window_baseline.hh"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "comm/wait.hh"
#include "core/reduce.hh"
#include "core/timeout.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::bench {
namespace {

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw StateError(fmt::format("shared-window baseline: {} failed (error {})", call, rc));
}

// Completes a nonblocking call within MOE_EP_TIMEOUT_SECS (a rank that never takes part is a
// TimeoutError, not a hang).
void complete(MPI_Request& request, const char* call, int rank) {
  comm::Backoff backoff(core::timeout_from_env());
  for (;;) {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), call);
    if (done) return;
    if (!backoff.pause())
      throw TimeoutError(fmt::format("[rank {}] shared-window baseline: {} did not complete within {:.1f} s: some rank "
                                     "did not take part",
                                     rank, call, backoff.elapsed_secs()),
                         {});
  }
}

Tensor rows_of(Tensor* kept, std::int64_t rows, std::int64_t cols, DType dtype) {
  if (!kept->defined() || kept->size(0) < rows || kept->size(1) != cols || kept->dtype() != dtype)
    *kept = Tensor::empty({std::max<std::int64_t>(1, rows + rows / 4), cols}, dtype);
  return kept->with_view(TensorView(kept->data(), dtype, {rows, cols}));
}

constexpr std::size_t kAlign = 64;
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void SharedWindowBaseline::Window::free() {
  if (window != MPI_WIN_NULL) {
    MPI_Win_unlock_all(window);
    MPI_Win_free(&window);
  }
  segment_bytes = 0;
}

SharedWindowBaseline::SharedWindowBaseline(MPI_Comm comm) {
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Comm_idup(comm, &comm_, &request), "MPI_Comm_idup");
  MPI_Comm_rank(comm, &rank_);
  complete(request, "MPI_Comm_idup", rank_);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Comm node = MPI_COMM_NULL;
  check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  MPI_Comm_free(&node);
  if (node_size != size_)
    throw InvalidArgument(fmt::format("[rank {}] shared-window baseline: the {} ranks do not share one node ({} on this "
                                      "one)",
                                      rank_, size_, node_size));
}

SharedWindowBaseline::~SharedWindowBaseline() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  records_.free();
  outputs_.free();
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void SharedWindowBaseline::barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
  complete(request, "MPI_Ibarrier", rank_);
}

void SharedWindowBaseline::reserve(Window& w, std::size_t bytes) {
  unsigned long long need = bytes, most = 0;
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Iallreduce(&need, &most, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm_, &request), "MPI_Iallreduce");
  complete(request, "MPI_Iallreduce", rank_);
  if (most <= w.segment_bytes) return;
  w.free();
  const std::size_t grown = aligned(static_cast<std::size_t>(most + most / 4));
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(grown), 1, info, comm_, &base, &w.window);
  MPI_Info_free(&info);
  check(rc, "MPI_Win_allocate_shared");
  check(MPI_Win_lock_all(MPI_MODE_NOCHECK, w.window), "MPI_Win_lock_all");  // one passive epoch: MPI_Win_sync orders loads and stores
  w.segment_bytes = grown;
  w.bases.assign(static_cast<size_t>(size_), nullptr);
  for (int r = 0; r < size_; ++r) {
    MPI_Aint size = 0;
    int unit = 0;
    void* theirs = nullptr;
    check(MPI_Win_shared_query(w.window, r, &size, &unit, &theirs), "MPI_Win_shared_query");
    w.bases[static_cast<size_t>(r)] = static_cast<std::byte*>(theirs);
  }
  std::memset(w.bases[static_cast<size_t>(rank_)], 0, grown);  // first touch by the owner
  barrier();
}

BaselineDispatch SharedWindowBaseline::dispatch(const TensorView& x, const TensorView& scales,
                                                const TensorView& topk_idx, const TensorView& topk_weights,
                                                int num_experts) {
  const std::int64_t N = x.size(0), k = topk_idx.size(1);
  const int El = num_experts / size_;
  const auto* ids = topk_idx.data_as<const std::int64_t>();
  // Destinations of every token in lane order: each token once per distinct rank.
  std::vector<std::vector<std::int32_t>> lists(static_cast<size_t>(size_));
  std::vector<std::int32_t> position(static_cast<size_t>(N * k), -1);
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t id = ids[t * k + j];
      if (id < 0) continue;
      const int dest = static_cast<int>(id / El);
      bool first = true;
      for (std::int64_t l = 0; l < j; ++l) first &= !(ids[t * k + l] >= 0 && ids[t * k + l] / El == dest);
      if (!first) continue;
      position[static_cast<size_t>(t * k + j)] = static_cast<std::int32_t>(lists[static_cast<size_t>(dest)].size());
      lists[static_cast<size_t>(dest)].push_back(static_cast<std::int32_t>(t));
    }
  barrier();  // every reader of the previous call is done with this rank's segment
  publish(x, scales, topk_idx, topk_weights, lists);
  MPI_Win_sync(records_.window);
  barrier();  // every segment is written
  MPI_Win_sync(records_.window);
  BaselineDispatch d = receive(x.dtype(), lists);
  // Where each (token, first lane of a rank) comes back from: that rank's output row, source-major.
  std::vector<std::int64_t> before(static_cast<size_t>(size_), 0);  // at rank r: rows of sources before this rank
  for (int r = 0; r < size_; ++r)
    for (int s = 0; s < rank_; ++s) before[static_cast<size_t>(r)] += list_entry(s, r).count;
  from_rank_.assign(static_cast<size_t>(N * k), -1);
  from_row_.assign(static_cast<size_t>(N * k), -1);
  d.return_rows.assign(static_cast<size_t>(N * k), -1);
  for (std::int64_t i = 0; i < N * k; ++i) {
    if (position[static_cast<size_t>(i)] < 0) continue;
    const int r = static_cast<int>(ids[i] / El);
    from_rank_[static_cast<size_t>(i)] = r;
    from_row_[static_cast<size_t>(i)] =
        static_cast<std::int32_t>(before[static_cast<size_t>(r)] + position[static_cast<size_t>(i)]);
    d.return_rows[static_cast<size_t>(i)] = from_row_[static_cast<size_t>(i)];
  }
  return d;
}

SharedWindowBaseline::ListEntry SharedWindowBaseline::list_entry(int source, int dest) const {
  ListEntry entry;
  std::memcpy(&entry, records_.bases[static_cast<size_t>(source)] + kTableAt + sizeof(ListEntry) * static_cast<size_t>(dest),
              sizeof entry);
  return entry;
}

void SharedWindowBaseline::publish(const TensorView& x, const TensorView& scales, const TensorView& topk_idx,
                                   const TensorView& topk_weights, const std::vector<std::vector<std::int32_t>>& lists) {
  const std::int64_t N = x.size(0), H = x.size(1), k = topk_idx.size(1);
  const std::int64_t P = scales.defined() ? scales.size(1) : 0;
  const std::int64_t row_bytes = H * static_cast<std::int64_t>(element_size(x.dtype()));
  const std::int64_t record = static_cast<std::int64_t>(aligned(static_cast<std::size_t>(row_bytes + 4 * P + 12 * k)));
  const auto* ids = topk_idx.data_as<const std::int64_t>();
  // Segment: head, list table (offset, count per destination), records, lists.
  const std::size_t records_at = aligned(kTableAt + sizeof(ListEntry) * static_cast<size_t>(size_));
  const std::size_t lists_at = records_at + static_cast<std::size_t>(N * record);
  std::size_t total = lists_at;
  for (const auto& l : lists) total += 4 * l.size();
  reserve(records_, total);
  std::byte* mine = records_.bases[static_cast<size_t>(rank_)];
  const Head head{N, record, row_bytes, P, k, static_cast<std::int64_t>(records_at)};
  std::memcpy(mine, &head, sizeof head);
  for (std::int64_t t = 0; t < N; ++t) {  // every token's row and metadata, once
    std::byte* out = mine + records_at + t * record;
    std::memcpy(out, static_cast<const std::byte*>(x.data()) + t * x.stride(0) * element_size(x.dtype()),
                static_cast<size_t>(row_bytes));
    if (P) std::memcpy(out + row_bytes, scales.data_as<const float>() + t * scales.stride(0), static_cast<size_t>(4 * P));
    std::memcpy(out + row_bytes + 4 * P, ids + t * k, static_cast<size_t>(8 * k));
    std::memcpy(out + row_bytes + 4 * P + 8 * k, topk_weights.data_as<const float>() + t * k, static_cast<size_t>(4 * k));
  }
  std::size_t at = lists_at;
  for (int r = 0; r < size_; ++r) {
    const auto& l = lists[static_cast<size_t>(r)];
    const ListEntry entry{static_cast<std::int64_t>(at), static_cast<std::int64_t>(l.size())};
    std::memcpy(mine + kTableAt + sizeof(ListEntry) * static_cast<size_t>(r), &entry, sizeof entry);
    if (!l.empty()) std::memcpy(mine + at, l.data(), 4 * l.size());
    at += 4 * l.size();
  }
}

BaselineDispatch SharedWindowBaseline::receive(DType dtype, const std::vector<std::vector<std::int32_t>>& lists) {
  Head head;
  std::memcpy(&head, records_.bases[static_cast<size_t>(rank_)], sizeof head);
  const std::int64_t row_bytes = head.row_bytes, P = head.scale_count, k = head.topk, record = head.record_bytes;
  const std::int64_t H = row_bytes / static_cast<std::int64_t>(element_size(dtype));
  BaselineDispatch d;
  d.num_tokens = head.tokens;
  d.num_topk = k;
  d.recv_counts.resize(static_cast<size_t>(size_));
  d.send_counts.resize(static_cast<size_t>(size_));
  std::int64_t rows = 0;
  for (int s = 0; s < size_; ++s) {
    d.recv_counts[static_cast<size_t>(s)] = static_cast<int>(list_entry(s, rank_).count);
    d.send_counts[static_cast<size_t>(s)] = static_cast<int>(lists[static_cast<size_t>(s)].size());
    rows += list_entry(s, rank_).count;
  }
  d.recv_x = rows_of(&kept_x_, rows, H, dtype);
  if (P) d.recv_x_scales = rows_of(&kept_scales_, rows, P, DType::kFP32);
  d.recv_topk_idx = rows_of(&kept_ids_, rows, k, DType::kInt64);
  d.recv_topk_weights = rows_of(&kept_weights_, rows, k, DType::kFP32);
  std::int64_t row = 0;
  for (int s = 0; s < size_; ++s) {  // the rows listed for this rank, straight from each source
    const std::byte* theirs = records_.bases[static_cast<size_t>(s)];
    Head source;
    std::memcpy(&source, theirs, sizeof source);
    const ListEntry entry = list_entry(s, rank_);
    const auto* list = reinterpret_cast<const std::int32_t*>(theirs + entry.offset);
    for (std::int64_t i = 0; i < entry.count; ++i, ++row) {
      const std::byte* in = theirs + source.records_at + static_cast<std::int64_t>(list[i]) * record;
      std::memcpy(static_cast<std::byte*>(d.recv_x.data()) + row * row_bytes, in, static_cast<size_t>(row_bytes));
      if (P) std::memcpy(d.recv_x_scales.data_as<float>() + row * P, in + row_bytes, static_cast<size_t>(4 * P));
      std::memcpy(d.recv_topk_idx.data_as<std::int64_t>() + row * k, in + row_bytes + 4 * P, static_cast<size_t>(8 * k));
      std::memcpy(d.recv_topk_weights.data_as<float>() + row * k, in + row_bytes + 4 * P + 8 * k,
                  static_cast<size_t>(4 * k));
    }
  }
  return d;
}

TensorView SharedWindowBaseline::output_rows(std::int64_t rows, std::int64_t hidden) {
  reserve(outputs_, static_cast<std::size_t>(rows * hidden * 2));
  return TensorView(outputs_.bases[static_cast<size_t>(rank_)], DType::kBF16, {rows, hidden});
}

Tensor SharedWindowBaseline::combine(const BaselineDispatch& d, const TensorView& y) {
  const std::int64_t H = y.size(1), N = d.num_tokens, k = d.num_topk;
  if (y.data() != outputs_.bases[static_cast<size_t>(rank_)])
    throw InvalidArgument(fmt::format("[rank {}] shared-window baseline: combine reads the expert outputs in place: "
                                      "pass the view output_rows() returned",
                                      rank_));
  MPI_Win_sync(outputs_.window);
  barrier();  // every rank's outputs are written
  MPI_Win_sync(outputs_.window);
  Tensor out = rows_of(&kept_out_, N, H, DType::kBF16);
  std::vector<const std::uint16_t*> inputs;
  for (std::int64_t t = 0; t < N; ++t) {
    inputs.clear();
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t r = from_rank_[static_cast<size_t>(t * k + j)];
      if (r >= 0)
        inputs.push_back(reinterpret_cast<const std::uint16_t*>(outputs_.bases[static_cast<size_t>(r)]) +
                         static_cast<std::int64_t>(from_row_[static_cast<size_t>(t * k + j)]) * H);
    }
    core::sum_bf16_rows_streaming(inputs, out.data_as<std::uint16_t>() + t * H, H);
  }
  core::streaming_fence();
  barrier();  // no rank rewrites its outputs while others read them
  return out;
}

}  // namespace moe_ep::bench
