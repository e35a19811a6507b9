#include "engine/receive_window.hh"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/reduce.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine {
namespace {

void check_out_row(const RowPlacement& p, std::int64_t out_row, std::int64_t limit, const char* what) {
  if (out_row < 0 || out_row >= limit)
    throw StateError(fmt::format("receive window: token {} of rank {} names {} row {}, outside the window's {} rows",
                                 p.token, p.source, what, out_row, limit));
}

}  // namespace

void place_row(const WindowOutputs& w, const WindowShape& s, const RowPlacement& p, const RowInput& in) {
  const int k = s.topk, P = s.scale_columns;
  const auto row_bytes = static_cast<std::size_t>(s.row_bytes);
  // Every row this placement names is checked before the first write.
  if (s.expand) {
    for (int j = 0; j < k; ++j)
      if (p.expanded_rows[j] >= 0) check_out_row(p, p.expanded_rows[j], w.out_rows, "output");
  } else {
    check_out_row(p, p.row, w.out_rows, "output");
  }
  if (w.metadata) check_out_row(p, p.row, w.meta_rows, "metadata");
  auto copy_scales = [&](std::int64_t out_row) {
    if (!w.scales) return;
    std::uint32_t* dst = w.scales + w.scale_layout.at(out_row, 0);
    const std::int64_t step = w.scale_layout.block;
    if (in.scale_step == 1 && step == 1) {
      std::memcpy(dst, in.scales, sizeof(std::uint32_t) * static_cast<size_t>(P));
    } else {
      for (int q = 0; q < P; ++q) dst[q * step] = in.scales[q * in.scale_step];
    }
  };
  if (s.expand) {
    for (int j = 0; j < k; ++j) {
      const std::int32_t r = p.expanded_rows[j];
      if (r < 0) continue;
      core::copy_bytes_streaming(w.x + r * s.row_bytes, in.payload, row_bytes);
      copy_scales(r);
      if (w.weights) w.weights[r] = in.weights[j];
    }
  } else {
    const std::int64_t r = p.row;
    core::copy_bytes_streaming(w.x + r * s.row_bytes, in.payload, row_bytes);
    copy_scales(r);
    for (int j = 0; j < k; ++j) w.ids[r * k + j] = p.local_ids[j];
    if (w.weights) {
      float* out = w.weights + r * k;
      std::memcpy(out, in.weights, sizeof(float) * static_cast<size_t>(k));
      if (s.zero_nonlocal_weights)
        for (int j = 0; j < k; ++j)
          if (p.local_ids[j] < 0) out[j] = 0.0f;
    }
  }
  if (w.metadata) {
    std::int32_t* m = w.metadata + p.row * (k + 2);
    m[0] = p.source * s.max_tokens + p.token;
    m[1] = p.source * k + p.master_lane;
    for (int j = 0; j < k; ++j) m[2 + j] = s.expand ? p.expanded_rows[j] : -1;
  }
}

void write_row(const ReceiveWindow& w, const WindowShape& s, std::int64_t i, const RowInput& in) {
  if (i < 0 || i >= w.num_rows)
    throw StateError(fmt::format("receive window: plan row {} is outside the plan's {} rows", i, w.num_rows));
  const int k = s.topk;
  const routing::RowSource src = w.rows[i];
  place_row(w.out, s,
            {.row = i, .source = src.source, .token = w.row_token[i], .master_lane = w.master_lane[i],
             .local_ids = w.local_ids + i * k, .expanded_rows = s.expand ? w.expanded_rows + i * k : nullptr},
            in);
}

namespace {

// The bytes of each span of outputs with these counts (the order of PublishedWindow's spans); a
// span the outputs do not have (a null pointer) needs none.
struct SpanBytes {
  std::size_t x, scales, ids, weights, metadata;
};

SpanBytes span_bytes(const WindowOutputs& w, const WindowShape& s) {
  const auto k = static_cast<std::size_t>(s.topk);
  const auto out = static_cast<std::size_t>(std::max<std::int64_t>(w.out_rows, 0));
  const auto meta = static_cast<std::size_t>(std::max<std::int64_t>(w.meta_rows, 0));
  auto if_given = [](const void* p, std::size_t bytes) { return p ? bytes : 0; };
  const std::size_t scale_elements =
      w.scales && out > 0 ? static_cast<std::size_t>(w.scale_layout.at(w.out_rows - 1, s.scale_columns - 1) + 1) : 0;
  return {.x = if_given(w.x, out * static_cast<std::size_t>(s.row_bytes)),
          .scales = scale_elements * sizeof(std::uint32_t),
          .ids = if_given(w.ids, out * k * sizeof(std::int64_t)),
          .weights = if_given(w.weights, (s.expand ? out : out * k) * sizeof(float)),
          .metadata = if_given(w.metadata, meta * (k + 2) * sizeof(std::int32_t))};
}

}  // namespace

PublishedWindow publish_window(comm::Transport& transport, const WindowOutputs& w, const WindowShape& s) {
  const SpanBytes b = span_bytes(w, s);
  const comm::Transport::WindowSpan spans[] = {  // sources write every span
      {w.x, b.x, true}, {w.scales, b.scales, true}, {w.ids, b.ids, true},
      {w.weights, b.weights, true}, {w.metadata, b.metadata, true},
  };
  const std::vector<comm::Transport::PublishedSpan> v = transport.share_window(spans);
  return {.x = v[0], .scales = v[1], .ids = v[2], .weights = v[3], .metadata = v[4], .out_rows = w.out_rows,
          .meta_rows = w.meta_rows, .scale_block = w.scale_layout.block, .scale_columns = w.scale_layout.columns};
}

WindowOutputs open_window(const comm::Transport& transport, int rank, const PublishedWindow& p, const WindowShape& s) {
  if (p.out_rows < 0 || p.meta_rows < 0 || p.scale_block < 1 ||
      (p.scales.value != 0 && p.scale_columns != s.scale_columns))
    throw StateError(fmt::format("receive window of rank {}: {} output rows, {} metadata rows, scale block {}, {} "
                                 "scale columns: not a window of this dispatch", rank, p.out_rows, p.meta_rows,
                                 p.scale_block, p.scale_columns));
  // The counts it claims, with every span it published present: what each span must hold.
  WindowOutputs claimed;
  auto* some = reinterpret_cast<std::byte*>(std::uintptr_t{64});  // a non-null stand-in: only presence counts
  auto mark = [&](const comm::Transport::PublishedSpan& span) { return span.value != 0 ? some : nullptr; };
  claimed.x = mark(p.x);
  claimed.scales = reinterpret_cast<std::uint32_t*>(mark(p.scales));
  claimed.ids = reinterpret_cast<std::int64_t*>(mark(p.ids));
  claimed.weights = reinterpret_cast<float*>(mark(p.weights));
  claimed.metadata = reinterpret_cast<std::int32_t*>(mark(p.metadata));
  claimed.out_rows = p.out_rows;
  claimed.meta_rows = p.meta_rows;
  claimed.scale_layout = {.block = p.scale_block, .columns = p.scale_columns};
  const SpanBytes b = span_bytes(claimed, s);
  auto at = [&](const comm::Transport::PublishedSpan& span, std::size_t bytes) {
    return transport.node_window(rank, span, bytes);
  };
  WindowOutputs w = claimed;
  w.x = at(p.x, b.x);
  w.scales = reinterpret_cast<std::uint32_t*>(at(p.scales, b.scales));
  w.ids = reinterpret_cast<std::int64_t*>(at(p.ids, b.ids));
  w.weights = reinterpret_cast<float*>(at(p.weights, b.weights));
  w.metadata = reinterpret_cast<std::int32_t*>(at(p.metadata, b.metadata));
  if ((w.out_rows > 0 && !w.x) || (w.out_rows > 0 && !s.expand && !w.ids))
    throw StateError(fmt::format("receive window of rank {}: {} output rows, but a span they need was not published",
                                 rank, w.out_rows));
  return w;
}

}  // namespace moe_ep::engine
