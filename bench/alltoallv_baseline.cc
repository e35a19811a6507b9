#include "alltoallv_baseline.hh"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string_view>

#include "comm/wait.hh"
#include "core/reduce.hh"
#include "core/timeout.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::bench {
namespace {

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw StateError(fmt::format("Alltoallv baseline: {} failed (error {})", call, rc));
}

// Completes a nonblocking collective within MOE_EP_TIMEOUT_SECS: a rank that never takes part
// (stopped, hung) is a TimeoutError, not a hang. Blocking MPI collectives would wait forever.
void complete(int rc, MPI_Request& request, const char* call, int rank) {
  check(rc, call);
  comm::Backoff backoff(core::timeout_from_env());
  for (;;) {
    int done = 0;
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), call);
    if (done) return;
    if (!backoff.pause())
      throw TimeoutError(fmt::format("[rank {}] Alltoallv baseline: {} did not complete within {:.1f} s: some rank did "
                                     "not take part",
                                     rank, call, backoff.elapsed_secs()),
                         {});
  }
}

int to_int(std::int64_t bytes, std::string_view side, std::string_view what) {
  if (bytes > INT_MAX)
    throw InvalidArgument(fmt::format("Alltoallv baseline: {} {} of {} bytes exceed MPI's int counts", side, what, bytes));
  return static_cast<int>(bytes);
}

// MPI_Alltoallv's byte counts and displacements for counts[r] rows of `unit` bytes per rank r,
// in rank order; `rows` is their sum. `side` ("send" or "receive") names them in errors.
struct ByteLayout {
  std::vector<int> bytes, displs;
  std::int64_t rows = 0;
};
ByteLayout byte_layout(const std::vector<int>& counts, std::int64_t unit, std::string_view side) {
  ByteLayout l;
  for (const int count : counts) {
    l.displs.push_back(to_int(l.rows * unit, side, "displacement"));
    l.bytes.push_back(to_int(std::int64_t{count} * unit, side, "count"));
    l.rows += count;
  }
  return l;
}

// The destinations of every token, in lane order: tokens_to[dest] lists the tokens sent to
// dest once each (at their first lane there), position[t * k + j] the index in that list (-1
// at lanes that send nothing).
void route_tokens(const std::int64_t* ids, std::int64_t N, std::int64_t k, int El,
                  std::vector<std::vector<std::int32_t>>& tokens_to, std::vector<std::int32_t>& position) {
  for (std::int64_t t = 0; t < N; ++t) {
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t id = ids[t * k + j];
      if (id < 0) continue;
      const int dest = static_cast<int>(id / El);
      bool first = true;
      for (std::int64_t l = 0; l < j; ++l) first &= !(ids[t * k + l] >= 0 && ids[t * k + l] / El == dest);
      if (!first) continue;
      position[static_cast<size_t>(t * k + j)] = static_cast<std::int32_t>(tokens_to[static_cast<size_t>(dest)].size());
      tokens_to[static_cast<size_t>(dest)].push_back(static_cast<std::int32_t>(t));
    }
  }
}

// A tensor of `rows` rows of `cols` elements viewing the start of `*kept`, which grows (to 1.25x
// the rows asked for) only when too small: the outputs stay mapped and faulted in between calls,
// as a caching allocator keeps them.
Tensor rows_of(Tensor* kept, std::int64_t rows, std::int64_t cols, DType dtype) {
  if (!kept->defined() || kept->size(0) < rows || kept->size(1) != cols || kept->dtype() != dtype)
    *kept = Tensor::empty({std::max<std::int64_t>(1, rows + rows / 4), cols}, dtype);
  return kept->with_view(TensorView(kept->data(), dtype, {rows, cols}));
}

// Unpacks recv_rows metadata records (P scales, k ids, k weights) into separate tensors of `d`.
void unpack_meta(const std::byte* received, std::int64_t recv_rows, std::int64_t P, std::int64_t k, BaselineDispatch& d) {
  const std::int64_t record = 4 * P + 12 * k;
  for (std::int64_t i = 0; i < recv_rows; ++i) {
    const std::byte* in = received + i * record;
    if (P) std::memcpy(d.recv_x_scales.data_as<float>() + i * P, in, static_cast<size_t>(4 * P));
    std::memcpy(d.recv_topk_idx.data_as<std::int64_t>() + i * k, in + 4 * P, static_cast<size_t>(8 * k));
    std::memcpy(d.recv_topk_weights.data_as<float>() + i * k, in + 4 * P + 8 * k, static_cast<size_t>(4 * k));
  }
}

}  // namespace

AlltoallvBaseline::AlltoallvBaseline(MPI_Comm comm) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Request request = MPI_REQUEST_NULL;
  complete(MPI_Comm_idup(comm, &comm_, &request), request, "MPI_Comm_idup", rank_);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

AlltoallvBaseline::~AlltoallvBaseline() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

BaselineDispatch AlltoallvBaseline::dispatch(const TensorView& x, const TensorView& scales, const TensorView& topk_idx,
                                             const TensorView& topk_weights, int num_experts) {
  const std::int64_t N = x.size(0), H = x.size(1), k = topk_idx.size(1);
  const std::int64_t P = scales.defined() ? scales.size(1) : 0;
  const std::int64_t row_bytes = H * static_cast<std::int64_t>(element_size(x.dtype()));
  const int El = num_experts / size_;
  const auto* ids = topk_idx.data_as<const std::int64_t>();
  BaselineDispatch d;
  d.num_tokens = N;
  d.num_topk = k;

  // Destinations of every token, in lane order; counts per destination.
  std::vector<std::vector<std::int32_t>> tokens_to(static_cast<size_t>(size_));
  d.return_rows.assign(static_cast<size_t>(N * k), -1);
  std::vector<std::int32_t> position(static_cast<size_t>(N * k), -1);  // index within tokens_to[dest]
  route_tokens(ids, N, k, El, tokens_to, position);
  d.send_counts.resize(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) d.send_counts[static_cast<size_t>(r)] = static_cast<int>(tokens_to[static_cast<size_t>(r)].size());
  d.recv_counts.resize(static_cast<size_t>(size_));
  MPI_Request request = MPI_REQUEST_NULL;
  complete(MPI_Ialltoall(d.send_counts.data(), 1, MPI_INT, d.recv_counts.data(), 1, MPI_INT, comm_, &request), request,
           "MPI_Ialltoall", rank_);

  // Where each token's rows come back in the combine (destination-major, as sent).
  std::int64_t base = 0;
  std::vector<std::int64_t> dest_base(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    dest_base[static_cast<size_t>(r)] = base;
    base += d.send_counts[static_cast<size_t>(r)];
  }
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j)
      if (position[static_cast<size_t>(t * k + j)] >= 0)
        d.return_rows[static_cast<size_t>(t * k + j)] = static_cast<std::int32_t>(
            dest_base[static_cast<size_t>(ids[t * k + j] / El)] + position[static_cast<size_t>(t * k + j)]);

  // Pack, grouped by destination: the rows into one buffer, their metadata into another. The rows
  // then travel straight into recv_x (two copies of each row: the pack, and MPI's transfer).
  const std::int64_t send_rows = base, meta = 4 * P + 12 * k;
  send_.resize(static_cast<size_t>(send_rows * row_bytes));
  send_meta_.resize(static_cast<size_t>(send_rows * meta));
  std::int64_t at = 0;
  for (int r = 0; r < size_; ++r) {
    for (std::int32_t t : tokens_to[static_cast<size_t>(r)]) {
      std::memcpy(send_.data() + at * row_bytes,
                  static_cast<const std::byte*>(x.data()) + t * x.stride(0) * element_size(x.dtype()),
                  static_cast<size_t>(row_bytes));
      std::byte* out = send_meta_.data() + at * meta;
      if (P) std::memcpy(out, scales.data_as<const float>() + t * scales.stride(0), static_cast<size_t>(4 * P));
      std::memcpy(out + 4 * P, ids + t * k, static_cast<size_t>(8 * k));
      std::memcpy(out + 4 * P + 8 * k, topk_weights.data_as<const float>() + t * k, static_cast<size_t>(4 * k));
      ++at;
    }
  }
  const ByteLayout send_row_layout = byte_layout(d.send_counts, row_bytes, "send");
  const ByteLayout send_meta_layout = byte_layout(d.send_counts, meta, "send");
  const ByteLayout recv_row_layout = byte_layout(d.recv_counts, row_bytes, "receive");
  const ByteLayout recv_meta_layout = byte_layout(d.recv_counts, meta, "receive");
  const std::int64_t recv_rows = recv_row_layout.rows;
  d.recv_x = rows_of(&kept_x_, recv_rows, H, x.dtype());
  if (P) d.recv_x_scales = rows_of(&kept_scales_, recv_rows, P, DType::kFP32);
  d.recv_topk_idx = rows_of(&kept_ids_, recv_rows, k, DType::kInt64);
  d.recv_topk_weights = rows_of(&kept_weights_, recv_rows, k, DType::kFP32);
  recv_meta_.resize(static_cast<size_t>(recv_rows * meta));
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  check(MPI_Ialltoallv(send_.data(), send_row_layout.bytes.data(), send_row_layout.displs.data(), MPI_BYTE,
                       d.recv_x.data(), recv_row_layout.bytes.data(), recv_row_layout.displs.data(), MPI_BYTE, comm_,
                       &requests[0]),
        "MPI_Ialltoallv");
  complete(MPI_Ialltoallv(send_meta_.data(), send_meta_layout.bytes.data(), send_meta_layout.displs.data(), MPI_BYTE,
                          recv_meta_.data(), recv_meta_layout.bytes.data(), recv_meta_layout.displs.data(), MPI_BYTE,
                          comm_, &requests[1]),
           requests[1], "MPI_Ialltoallv", rank_);
  complete(MPI_SUCCESS, requests[0], "MPI_Ialltoallv", rank_);
  unpack_meta(recv_meta_.data(), recv_rows, P, k, d);
  return d;
}

Tensor AlltoallvBaseline::combine(const BaselineDispatch& d, const TensorView& y) {
  const std::int64_t H = y.size(1), row = 2 * H, N = d.num_tokens, k = d.num_topk;
  // Rows go back to their sources straight from y (receive order is source-major).
  const ByteLayout sends = byte_layout(d.recv_counts, row, "send");
  const ByteLayout receives = byte_layout(d.send_counts, row, "receive");
  recv_.resize(static_cast<size_t>(receives.rows * row));
  MPI_Request request = MPI_REQUEST_NULL;
  complete(MPI_Ialltoallv(y.data(), sends.bytes.data(), sends.displs.data(), MPI_BYTE, recv_.data(),
                          receives.bytes.data(), receives.displs.data(), MPI_BYTE, comm_, &request),
           request, "MPI_Ialltoallv", rank_);
  // Reduce: per token, the rows of its ranks in first-lane order.
  Tensor out = rows_of(&kept_out_, N, H, DType::kBF16);
  const auto* rows = reinterpret_cast<const std::uint16_t*>(recv_.data());
  std::vector<const std::uint16_t*> inputs;
  for (std::int64_t t = 0; t < N; ++t) {
    inputs.clear();
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t r = d.return_rows[static_cast<size_t>(t * k + j)];
      if (r >= 0) inputs.push_back(rows + std::int64_t{r} * H);
    }
    std::uint16_t* dst = out.data_as<std::uint16_t>() + t * H;
    if (inputs.empty()) {
      std::memset(dst, 0, static_cast<size_t>(row));
    } else {
      core::sum_bf16_rows(inputs, dst, H);
    }
  }
  return out;
}

}  // namespace moe_ep::bench
