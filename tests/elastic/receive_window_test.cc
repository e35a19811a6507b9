// The receive window (engine/receive_window.hh) a pushing source writes into: a plan row writes
// exactly the output rows its plan names, and a plan row or output row outside the window is
// refused with nothing written. Expected bytes are written here by hand.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/receive_window.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::testing {
namespace {

using engine::ReceiveWindow;
using engine::RowInput;
using engine::WindowShape;

constexpr int kTopk = 2;
constexpr std::int64_t kRowBytes = 16;
constexpr std::byte kCanary{0xAB};

// A window of `out_rows` output rows (plus one canary row past them) over a plan of two rows:
// token 3 of rank 1 and token 0 of rank 2.
struct Fixture {
  bool expand;
  std::vector<std::byte> x;
  std::vector<float> weights;
  std::vector<std::int64_t> ids;
  std::vector<std::int32_t> metadata;
  std::vector<routing::RowSource> rows = {{1, 3}, {2, 0}};
  std::vector<std::int32_t> row_token = {3, 0}, master_lane = {1, 0};
  std::vector<std::int32_t> local_ids = {0, -1, 1, 0};
  std::vector<std::int32_t> expanded;
  ReceiveWindow w;
  WindowShape shape;

  Fixture(bool expanded_layout, std::int64_t out_rows, std::vector<std::int32_t> expanded_rows = {})
      : expand(expanded_layout), expanded(std::move(expanded_rows)) {
    x.assign(static_cast<size_t>((out_rows + 1) * kRowBytes), kCanary);
    weights.assign(static_cast<size_t>((out_rows + 1) * kTopk), -7.0f);
    ids.assign(static_cast<size_t>((out_rows + 1) * kTopk), -9);
    metadata.assign(2 * (kTopk + 2), -5);
    w.out.x = x.data();
    w.out.weights = weights.data();
    w.out.ids = expand ? nullptr : ids.data();
    w.out.metadata = metadata.data();
    w.out.out_rows = out_rows;
    w.out.meta_rows = 2;
    w.rows = rows.data();
    w.row_token = row_token.data();
    w.master_lane = master_lane.data();
    w.local_ids = local_ids.data();
    w.expanded_rows = expand ? expanded.data() : nullptr;
    w.num_rows = 2;
    shape = {.row_bytes = kRowBytes, .topk = kTopk, .scale_columns = 0, .max_tokens = 8, .expand = expand,
             .zero_nonlocal_weights = true};
  }
  bool row_untouched(std::int64_t r) const {
    for (std::int64_t b = 0; b < kRowBytes; ++b)
      if (x[static_cast<size_t>(r * kRowBytes + b)] != kCanary) return false;
    return true;
  }
};

std::vector<std::byte> payload(std::uint8_t value) { return std::vector<std::byte>(kRowBytes, std::byte{value}); }

TEST(ReceiveWindow, CompactRowWritesItsRowIdsWeightsAndMetadata) {
  Fixture f(false, 2);
  const auto row = payload(0x11);
  const float w[kTopk] = {0.5f, 0.25f};
  engine::write_row(f.w, f.shape, 0, RowInput{.payload = row.data(), .weights = w});
  for (std::int64_t b = 0; b < kRowBytes; ++b) EXPECT_EQ(f.x[static_cast<size_t>(b)], std::byte{0x11});
  EXPECT_TRUE(f.row_untouched(1));
  EXPECT_EQ(f.ids[0], 0);
  EXPECT_EQ(f.ids[1], -1);
  EXPECT_EQ(f.weights[0], 0.5f);
  EXPECT_EQ(f.weights[1], 0.0f);  // expert not local: zeroed
  // Source 1, token 3 with T = 8: 1 * 8 + 3; master lane 1 of source 1: 1 * 2 + 1; no expanded rows.
  EXPECT_EQ(f.metadata, (std::vector<std::int32_t>{11, 3, -1, -1, -5, -5, -5, -5}));
}

TEST(ReceiveWindow, ExpandedRowWritesEveryLocalExpertsRow) {
  Fixture f(true, 4, {-1, 2, 0, 3});
  const auto row = payload(0x22);
  const float w[kTopk] = {0.5f, 0.25f};
  engine::write_row(f.w, f.shape, 1, RowInput{.payload = row.data(), .weights = w});
  for (std::int64_t r : {0, 3})
    for (std::int64_t b = 0; b < kRowBytes; ++b) EXPECT_EQ(f.x[static_cast<size_t>(r * kRowBytes + b)], std::byte{0x22});
  EXPECT_TRUE(f.row_untouched(1));
  EXPECT_TRUE(f.row_untouched(2));
  EXPECT_EQ(f.weights[0], 0.5f);
  EXPECT_EQ(f.weights[3], 0.25f);
  EXPECT_EQ(f.weights[1], -7.0f);
}

TEST(ReceiveWindow, PlanRowsOutsideThePlanAreRefused) {
  Fixture f(false, 2);
  const auto row = payload(0x33);
  const float w[kTopk] = {1.0f, 1.0f};
  for (std::int64_t i : {std::int64_t{-1}, std::int64_t{2}}) {
    EXPECT_THROW(engine::write_row(f.w, f.shape, i, RowInput{.payload = row.data(), .weights = w}), StateError);
  }
  EXPECT_TRUE(f.row_untouched(0));
  EXPECT_TRUE(f.row_untouched(1));
  EXPECT_TRUE(f.row_untouched(2));
}

// A receiver whose outputs are smaller than its plan claims: nothing lands past them.
TEST(ReceiveWindow, OutputRowsOutsideTheWindowAreRefusedBeforeAnyWrite) {
  Fixture compact(false, 1);  // plan row 1 would write output row 1 of a 1-row window
  const auto row = payload(0x44);
  const float w[kTopk] = {1.0f, 1.0f};
  EXPECT_THROW(engine::write_row(compact.w, compact.shape, 1, RowInput{.payload = row.data(), .weights = w}),
               StateError);
  EXPECT_TRUE(compact.row_untouched(0));
  EXPECT_TRUE(compact.row_untouched(1));  // the canary row past the window
  Fixture expanded(true, 2, {0, 1, 1, 2});  // plan row 1 names output rows 1 and 2 of a 2-row window
  EXPECT_THROW(engine::write_row(expanded.w, expanded.shape, 1, RowInput{.payload = row.data(), .weights = w}),
               StateError);
  for (std::int64_t r : {0, 1, 2}) EXPECT_TRUE(expanded.row_untouched(r)) << r;
}

// A pushing source places its token itself (no plan of the receiver): the same bytes as the
// receiver's plan row, and a row past the outputs or their metadata is refused unwritten.
TEST(ReceiveWindow, ASourcePlacementWritesWhereThePlanRowWould) {
  Fixture f(false, 2);
  const auto row = payload(0x55);
  const float w[kTopk] = {0.5f, 0.25f};
  const std::int32_t local[kTopk] = {1, 0};
  engine::place_row(f.w.out, f.shape,
                    {.row = 1, .source = 2, .token = 0, .master_lane = 0, .local_ids = local},
                    RowInput{.payload = row.data(), .weights = w});
  EXPECT_TRUE(f.row_untouched(0));
  for (std::int64_t b = 0; b < kRowBytes; ++b) EXPECT_EQ(f.x[static_cast<size_t>(kRowBytes + b)], std::byte{0x55});
  EXPECT_EQ(f.ids[2], 1);
  EXPECT_EQ(f.ids[3], 0);
  EXPECT_EQ(f.weights[2], 0.5f);
  EXPECT_EQ(f.weights[3], 0.25f);
  // Source 2, token 0 with T = 8: 16; master lane 0 of source 2: 2 * 2 + 0.
  EXPECT_EQ(f.metadata, (std::vector<std::int32_t>{-5, -5, -5, -5, 16, 4, -1, -1}));

  Fixture g(false, 4);  // outputs with room for 4 rows, metadata for 2
  EXPECT_THROW(engine::place_row(g.w.out, g.shape, {.row = 2, .source = 2, .token = 0, .local_ids = local},
                                 RowInput{.payload = row.data(), .weights = w}),
               StateError);
  EXPECT_THROW(engine::place_row(g.w.out, g.shape, {.row = 4, .source = 2, .token = 0, .local_ids = local},
                                 RowInput{.payload = row.data(), .weights = w}),
               StateError);
  for (std::int64_t r : {0, 1, 2, 3, 4}) EXPECT_TRUE(g.row_untouched(r)) << r;
  EXPECT_EQ(g.metadata, std::vector<std::int32_t>(2 * (kTopk + 2), -5));
}

}  // namespace
}  // namespace moe_ep::testing
