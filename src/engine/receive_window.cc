#include "engine/receive_window.hh"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/reduce.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine {
namespace {

void check_out_row(const ReceiveWindow& w, std::int64_t i, std::int64_t out_row) {
  if (out_row < 0 || out_row >= w.out_rows)
    throw StateError(fmt::format("receive window: plan row {} names output row {}, outside the window's {} rows", i,
                                 out_row, w.out_rows));
}

}  // namespace

void write_row(const ReceiveWindow& w, const WindowShape& s, std::int64_t i, const RowInput& in) {
  if (i < 0 || i >= w.num_rows)
    throw StateError(fmt::format("receive window: plan row {} is outside the plan's {} rows", i, w.num_rows));
  const int k = s.topk, P = s.scale_columns;
  const auto row_bytes = static_cast<std::size_t>(s.row_bytes);
  auto copy_scales = [&](std::int64_t out_row) {
    if (!w.scales) return;
    std::uint32_t* dst = w.scales + w.scale_layout.at(out_row, 0);
    const std::int64_t step = w.scale_layout.block;
    if (in.scale_step == 1 && step == 1) {
      std::memcpy(dst, in.scales, sizeof(std::uint32_t) * static_cast<size_t>(P));
    } else {
      for (int p = 0; p < P; ++p) dst[p * step] = in.scales[p * in.scale_step];
    }
  };
  const std::int32_t* local = w.local_ids + i * k;
  if (s.expand) {
    const std::int32_t* expanded = w.expanded_rows + i * k;
    for (int j = 0; j < k; ++j)
      if (expanded[j] >= 0) check_out_row(w, i, expanded[j]);
    for (int j = 0; j < k; ++j) {
      if (expanded[j] < 0) continue;
      core::copy_bytes_streaming(w.x + expanded[j] * s.row_bytes, in.payload, row_bytes);
      copy_scales(expanded[j]);
      if (w.weights) w.weights[expanded[j]] = in.weights[j];
    }
  } else {
    check_out_row(w, i, i);
    core::copy_bytes_streaming(w.x + i * s.row_bytes, in.payload, row_bytes);
    copy_scales(i);
    for (int j = 0; j < k; ++j) w.ids[i * k + j] = local[j];
    if (w.weights) {
      float* out = w.weights + i * k;
      std::memcpy(out, in.weights, sizeof(float) * static_cast<size_t>(k));
      if (s.zero_nonlocal_weights)
        for (int j = 0; j < k; ++j)
          if (local[j] < 0) out[j] = 0.0f;
    }
  }
  if (w.metadata) {
    std::int32_t* m = w.metadata + i * (k + 2);
    const routing::RowSource src = w.rows[i];
    m[0] = src.source * s.max_tokens + w.row_token[i];
    m[1] = src.source * k + w.master_lane[i];
    for (int j = 0; j < k; ++j) m[2 + j] = s.expand ? w.expanded_rows[i * k + j] : -1;
  }
}

void check_source(const ReceiveWindow& w, std::int64_t i, int source, std::int64_t token, int window_rank) {
  if (i < 0 || i >= w.num_rows)
    throw StateError(fmt::format("receive window of rank {}: row {} of token {} of rank {} is outside its plan's {} "
                                 "rows", window_rank, i, token, source, w.num_rows));
  const routing::RowSource src = w.rows[i];
  if (src.source != source || src.index != token)
    throw StateError(fmt::format("receive window of rank {}: row {} is token {} of rank {}, not token {} of rank {}",
                                 window_rank, i, src.index, src.source, token, source));
}

namespace {

// The bytes of each span of a window with these counts (the order of PublishedWindow's spans);
// a span the window does not have (a null pointer) needs none.
struct SpanBytes {
  std::size_t x, scales, ids, weights, metadata, rows, row_token, master_lane, local_ids, expanded_rows;
};

SpanBytes span_bytes(const ReceiveWindow& w, const WindowShape& s) {
  const auto n = static_cast<std::size_t>(std::max<std::int64_t>(w.num_rows, 0));
  const auto k = static_cast<std::size_t>(s.topk);
  const auto out = static_cast<std::size_t>(std::max<std::int64_t>(w.out_rows, 0));
  const std::size_t i32 = sizeof(std::int32_t);
  auto if_given = [](const void* p, std::size_t bytes) { return p ? bytes : 0; };
  const std::size_t scale_elements =
      w.scales && out > 0 ? static_cast<std::size_t>(w.scale_layout.at(w.out_rows - 1, s.scale_columns - 1) + 1) : 0;
  return {.x = if_given(w.x, out * static_cast<std::size_t>(s.row_bytes)),
          .scales = scale_elements * sizeof(std::uint32_t),
          .ids = if_given(w.ids, out * k * sizeof(std::int64_t)),
          .weights = if_given(w.weights, (s.expand ? out : out * k) * sizeof(float)),
          .metadata = if_given(w.metadata, n * (k + 2) * i32),
          .rows = if_given(w.rows, n * sizeof(routing::RowSource)),
          .row_token = if_given(w.row_token, n * i32),
          .master_lane = if_given(w.master_lane, n * i32),
          .local_ids = if_given(w.local_ids, n * k * i32),
          .expanded_rows = if_given(w.expanded_rows, n * k * i32)};
}

}  // namespace

PublishedWindow publish_window(comm::Transport& transport, const ReceiveWindow& w, const WindowShape& s) {
  const SpanBytes b = span_bytes(w, s);
  // Sources write the outputs and read the plan.
  const comm::Transport::WindowSpan spans[] = {
      {w.x, b.x, true},
      {w.scales, b.scales, true},
      {w.ids, b.ids, true},
      {w.weights, b.weights, true},
      {w.metadata, b.metadata, true},
      {w.rows, b.rows, false},
      {w.row_token, b.row_token, false},
      {w.master_lane, b.master_lane, false},
      {w.local_ids, b.local_ids, false},
      {w.expanded_rows, b.expanded_rows, false},
  };
  const std::vector<comm::Transport::PublishedSpan> v = transport.share_window(spans);
  return {.x = v[0], .scales = v[1], .ids = v[2], .weights = v[3], .metadata = v[4], .rows = v[5], .row_token = v[6],
          .master_lane = v[7], .local_ids = v[8], .expanded_rows = v[9], .out_rows = w.out_rows,
          .num_rows = w.num_rows, .scale_block = w.scale_layout.block, .scale_columns = w.scale_layout.columns};
}

ReceiveWindow open_window(const comm::Transport& transport, int rank, const PublishedWindow& p, const WindowShape& s) {
  if (p.out_rows < 0 || p.num_rows < 0 || p.scale_block < 1 || (p.scales.value != 0 && p.scale_columns != s.scale_columns))
    throw StateError(fmt::format("receive window of rank {}: {} output rows, {} plan rows, scale block {}, {} scale "
                                 "columns: not a window of this dispatch", rank, p.out_rows, p.num_rows,
                                 p.scale_block, p.scale_columns));
  // The counts it claims, with every span it published present: what each span must hold.
  ReceiveWindow claimed;
  auto* some = reinterpret_cast<std::byte*>(std::uintptr_t{64});  // a non-null stand-in: only presence counts
  auto mark = [&](const comm::Transport::PublishedSpan& span) { return span.value != 0 ? some : nullptr; };
  claimed.x = mark(p.x);
  claimed.scales = reinterpret_cast<std::uint32_t*>(mark(p.scales));
  claimed.ids = reinterpret_cast<std::int64_t*>(mark(p.ids));
  claimed.weights = reinterpret_cast<float*>(mark(p.weights));
  claimed.metadata = reinterpret_cast<std::int32_t*>(mark(p.metadata));
  claimed.rows = reinterpret_cast<const routing::RowSource*>(mark(p.rows));
  claimed.row_token = reinterpret_cast<const std::int32_t*>(mark(p.row_token));
  claimed.master_lane = reinterpret_cast<const std::int32_t*>(mark(p.master_lane));
  claimed.local_ids = reinterpret_cast<const std::int32_t*>(mark(p.local_ids));
  claimed.expanded_rows = reinterpret_cast<const std::int32_t*>(mark(p.expanded_rows));
  claimed.out_rows = p.out_rows;
  claimed.num_rows = p.num_rows;
  claimed.scale_layout = {.block = p.scale_block, .columns = p.scale_columns};
  const SpanBytes b = span_bytes(claimed, s);
  auto at = [&](const comm::Transport::PublishedSpan& span, std::size_t bytes) {
    return transport.node_window(rank, span, bytes);
  };
  ReceiveWindow w = claimed;
  w.x = at(p.x, b.x);
  w.scales = reinterpret_cast<std::uint32_t*>(at(p.scales, b.scales));
  w.ids = reinterpret_cast<std::int64_t*>(at(p.ids, b.ids));
  w.weights = reinterpret_cast<float*>(at(p.weights, b.weights));
  w.metadata = reinterpret_cast<std::int32_t*>(at(p.metadata, b.metadata));
  w.rows = reinterpret_cast<const routing::RowSource*>(at(p.rows, b.rows));
  w.row_token = reinterpret_cast<const std::int32_t*>(at(p.row_token, b.row_token));
  w.master_lane = reinterpret_cast<const std::int32_t*>(at(p.master_lane, b.master_lane));
  w.local_ids = reinterpret_cast<const std::int32_t*>(at(p.local_ids, b.local_ids));
  w.expanded_rows = reinterpret_cast<const std::int32_t*>(at(p.expanded_rows, b.expanded_rows));
  const bool missing = (w.out_rows > 0 && !w.x) || (w.num_rows > 0 && (!w.rows || !w.local_ids)) ||
                       (w.num_rows > 0 && s.expand && !w.expanded_rows) || (w.out_rows > 0 && !s.expand && !w.ids);
  if (missing)
    throw StateError(fmt::format("receive window of rank {}: {} output rows and {} plan rows, but a span they need "
                                 "was not published", rank, w.out_rows, w.num_rows));
  return w;
}

}  // namespace moe_ep::engine
