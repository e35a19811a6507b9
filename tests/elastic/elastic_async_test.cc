// Asynchronous execution, event ordering, buffer-level queries and steady-state allocations.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <thread>

#include "core/host_allocator.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

// Counts heap allocations (all threads), to check that steady-state calls allocate nothing that
// grows with the data: through a replaced operator new, or, under ThreadSanitizer (whose runtime
// owns operator new), through its allocation hooks.
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MOE_EP_COUNT_WITH_SANITIZER_HOOKS 1
#endif
#endif
namespace {
std::atomic<long long> g_new_bytes{0};
}
#ifdef MOE_EP_COUNT_WITH_SANITIZER_HOOKS
#include <sanitizer/allocator_interface.h>
namespace {
void count_allocation(const volatile void*, std::size_t n) { g_new_bytes += static_cast<long long>(n); }
void count_release(const volatile void*) {}
const int g_hooks_installed = __sanitizer_install_malloc_and_free_hooks(count_allocation, count_release);
}  // namespace
#else
// Not inlined into the other tests compiled in the same batch (tests/CMakeLists.txt), where GCC
// would see the std::free of the replaced delete as a mismatch (-Wmismatched-new-delete).
[[gnu::noinline]] void* operator new(std::size_t n) {
  g_new_bytes += static_cast<long long>(n);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void* operator new(std::size_t n, std::align_val_t a) {
  g_new_bytes += static_cast<long long>(n);
  const auto align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif

namespace moe_ep {
namespace {

struct Batch {
  Batch(int rank, int n, int hidden, int k, int experts) : n(n), hidden(hidden), k(k) {
    x.resize(static_cast<size_t>(n) * hidden);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(static_cast<float>((i * 7 + rank) % 13) - 6.0f);
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < k; ++j) topk.push_back((t * 5 + j * 3 + rank) % experts == 0 ? -1 : (t * 5 + j * (experts / k) + rank) % experts);
    for (int t = 0; t < n; ++t) {  // make ids distinct per row
      for (int j = 0; j < k; ++j)
        for (int l = 0; l < j; ++l)
          if (topk[static_cast<size_t>(t * k + j)] == topk[static_cast<size_t>(t * k + l)]) topk[static_cast<size_t>(t * k + j)] = -1;
    }
  }
  TensorView xv() { return TensorView(x.data(), DType::kBF16, {n, hidden}); }
  TensorView tv() { return TensorView(topk.data(), DType::kInt64, {n, k}); }
  std::int64_t n;
  int hidden, k;
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
};

TEST(ElasticAsync, EventsOrderWorkAfterACallerEvent) {
  LocalWorld(4).run([&](Group& g) {
    ElasticBuffer b(g, {.num_max_tokens_per_rank = 16, .hidden = 64, .num_topk = 4});
    Batch batch(g.rank(), 16, 64, 4, 16);
    auto sync = b.dispatch({.x = batch.xv(), .topk_idx = batch.tv(), .num_experts = 16});
    EXPECT_TRUE(sync.event.query());

    // Cached dispatch has known shapes: it returns at once and waits for the caller's event.
    Event before = Event::pending();
    auto pending = b.dispatch({.x = batch.xv(), .previous_event = before, .async_with_compute_stream = true,
                               .allocate_on_comm_stream = true, .handle = sync.handle});
    EXPECT_FALSE(pending.event.wait_for(0.05));
    before.complete();
    pending.event.wait();
    EXPECT_EQ(std::memcmp(pending.recv_x.data(), sync.recv_x.data(), sync.recv_x.nbytes()), 0);

    // Without CPU sync a new dispatch is asynchronous end to end; the combine queued after it
    // runs after it on the same worker.
    auto worst = b.dispatch({.x = batch.xv(), .topk_idx = batch.tv(), .num_experts = 16,
                             .async_with_compute_stream = true, .do_cpu_sync = false});
    EXPECT_EQ(worst.recv_x.size(0), 16 * 4);
    Tensor y = Tensor::zeros({worst.recv_x.size(0), 64}, DType::kBF16);
    auto combined = b.combine({.x = y, .handle = worst.handle, .async_with_compute_stream = true});
    combined.event.wait();
    worst.event.wait();
    EXPECT_EQ(worst.handle->psum_num_recv_tokens_per_scaleup_rank.data_as<std::int32_t>()[3], sync.recv_x.size(0));
    b.barrier();  // ordered after the queued work
  });
}

TEST(ElasticAsync, DomainSizesAndWorkerModel) {
  LocalWorld(8, {.num_scaleout = 2}).run([&](Group& g) {
    ElasticBuffer hybrid(g, {.num_max_tokens_per_rank = 8, .hidden = 64});
    EXPECT_EQ(hybrid.get_physical_domain_size(), (std::pair<int, int>(2, 4)));
    EXPECT_EQ(hybrid.get_logical_domain_size(), (std::pair<int, int>(2, 4)));
    EXPECT_TRUE(hybrid.is_hybrid());
    EXPECT_EQ(hybrid.scaleout_rank_idx(), g.rank() / 4);
    EXPECT_EQ(hybrid.num_allocated_qps(), 129);
    ElasticBuffer direct(g, {.num_max_tokens_per_rank = 8, .hidden = 64, .allow_hybrid_mode = false});
    EXPECT_EQ(direct.get_logical_domain_size(), (std::pair<int, int>(1, 8)));
    EXPECT_FALSE(direct.is_hybrid());
    EXPECT_EQ(direct.num_allocated_qps(), 17);
    EXPECT_EQ(direct.get_theoretical_num_qps(4), 4);
    // The model itself, with explicit bandwidths, against values worked out by hand from the
    // formula (uncapped values are clipped to the cores available to a rank).
    const int cap = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 8);
    EXPECT_EQ(hybrid.get_theoretical_num_sms(256, 8, 0, 50, 430, 200, 50), std::min(cap, 12));
    EXPECT_EQ(direct.get_theoretical_num_sms(256, 8, 0, 50, 430, 200, 50), std::min(cap, 14));
    EXPECT_THROW(direct.get_theoretical_num_sms(255, 8), InvalidArgument);
  });
}

// On EFA (FI_PROVIDER=efa) a peer's request ring has 128 slots: allocated QPs (in-flight
// transfers per peer) are capped there, auto-sized or given.
TEST(ElasticAsync, QpsCappedAt128OnEfa) {
  const char* before = std::getenv("FI_PROVIDER");
  const std::string saved = before ? before : "";
  setenv("FI_PROVIDER", "efa", 1);
  LocalWorld(4, {.num_scaleout = 2}).run([&](Group& g) {
    ElasticBuffer hybrid(g, {.num_max_tokens_per_rank = 8, .hidden = 64});
    EXPECT_EQ(hybrid.num_allocated_qps(), 128) << "auto-sized 129, capped";
    ElasticBuffer given(g, {.num_max_tokens_per_rank = 8, .hidden = 64, .num_allocated_qps = 300});
    EXPECT_EQ(given.num_allocated_qps(), 128);
    ElasticBuffer direct(g, {.num_max_tokens_per_rank = 8, .hidden = 64, .allow_hybrid_mode = false});
    EXPECT_EQ(direct.num_allocated_qps(), 17) << "below the cap: unchanged";
  });
  if (before) {
    setenv("FI_PROVIDER", saved.c_str(), 1);
  } else {
    unsetenv("FI_PROVIDER");
  }
}

TEST(ElasticSizing, TopkZeroSizesForThirtyTwoAndSaysSoWhenDebugging) {
  env::ScopedOverride debug("MOE_EP_DEBUG", "1");
  ::testing::internal::CaptureStderr();
  LocalWorld(1).run([&](Group& g) { ElasticBuffer b(g, {.num_max_tokens_per_rank = 8, .hidden = 64}); });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("num_topk = 0, sizing conservatively for k = 32"), std::string::npos) << err;
}

TEST(ElasticSizing, HintFollowsTheDocumentedFormula) {
  LocalWorld(8).run([&](Group& g) {
    // One node: no records travel through the buffer; the minimum is one 2 MiB unit.
    EXPECT_EQ(ElasticBuffer::get_buffer_size_hint(g, 8192, 7168, 8, true), 2 << 20);
  });
  LocalWorld(8, {.num_scaleout = 2}).run([&](Group& g) {
    // Hybrid, FP8: D = a(7168,32) + a(4*224,32) + a(8*8+4,32) = 7168 + 896 + 96 = 8160;
    // dispatch = SO*T*D = 2*4096*8160; combine = SO*T*(14336 + 32) (multi).
    const std::int64_t d = 2LL * 4096 * 8160, c = 2LL * 4096 * (14336 + 32);
    const std::int64_t expect = (std::max(d, c) + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    EXPECT_EQ(ElasticBuffer::get_buffer_size_hint(g, 4096, 7168, 8, true), expect);
    // Direct across nodes without multiple reduction: dispatch R*T*D, combine k*T*Cb.
    const std::int64_t d2 = 8LL * 4096 * 8160, c2 = 8LL * 4096 * (14336 + 32);
    EXPECT_EQ(ElasticBuffer::get_buffer_size_hint(g, 4096, 7168, 8, true, false, false),
              (std::max(d2, c2) + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    // num_topk = 0 sizes for k = 32 (visible where regions scale with k).
    EXPECT_GT(ElasticBuffer::get_buffer_size_hint(g, 4096, 7168, 0, true, true, false),
              ElasticBuffer::get_buffer_size_hint(g, 4096, 7168, 8, true, true, false));
    ElasticBuffer b(g, {.num_max_tokens_per_rank = 4096, .hidden = 7168, .num_topk = 8, .use_fp8_dispatch = true});
    EXPECT_EQ(b.num_bytes(), expect);
  });
}

// Steady state: a cached dispatch and a combine allocate their outputs and a bounded amount of
// bookkeeping, independent of the number of tokens and the hidden size.
TEST(ElasticAllocation, SteadyStateAllocatesOnlyOutputs) {
  std::vector<long long> overhead;
  for (int n : {32, 256}) {
    const int hidden = n * 8;
    std::atomic<long long> outputs{0};
    long long before = 0, after = 0;
    std::size_t maps_before = 0, maps_after = 0;
    LocalWorld world(2);
    world.run([&](Group& g) {
      ElasticBuffer b(g, {.num_max_tokens_per_rank = n, .hidden = hidden, .num_topk = 4});
      Batch batch(g.rank(), n, hidden, 4, 8);
      auto first = b.dispatch({.x = batch.xv(), .topk_idx = batch.tv(), .num_experts = 8, .num_sms = 1});
      Tensor y = Tensor::zeros({first.recv_x.size(0), hidden}, DType::kBF16);
      for (int warm = 0; warm < 2; ++warm) {
        auto d = b.dispatch({.x = batch.xv(), .num_sms = 1, .handle = first.handle});
        auto c = b.combine({.x = y, .handle = first.handle, .num_sms = 1});
      }
      b.barrier();
      if (g.rank() == 0) {
        before = g_new_bytes.load();
        maps_before = host_allocator_stats().num_maps;
      }
      b.barrier();
      auto d = b.dispatch({.x = batch.xv(), .num_sms = 1, .handle = first.handle});
      auto c = b.combine({.x = y, .handle = first.handle, .num_sms = 1});
      // Outputs below 1 MiB come from operator new; larger ones from the allocator cache.
      for (const Tensor* t : {&d.recv_x, &d.recv_topk_idx, &c.combined_x})
        if (t->nbytes() < (1u << 20)) outputs += static_cast<long long>(t->nbytes());
      b.barrier();
      if (g.rank() == 0) {
        after = g_new_bytes.load();
        maps_after = host_allocator_stats().num_maps;
      }
      b.barrier();
    });
    EXPECT_EQ(maps_after, maps_before) << "large outputs must come from the allocator cache";
    overhead.push_back(after - before - outputs.load());
  }
  // Bookkeeping (operations, agreements, events) does not grow with tokens or hidden size.
  EXPECT_LT(overhead[0], 64 * 1024) << overhead[0];
  EXPECT_LT(overhead[1], 64 * 1024) << overhead[1];
  EXPECT_LT(std::llabs(overhead[1] - overhead[0]), 4096) << overhead[0] << " vs " << overhead[1];
}

}  // namespace
}  // namespace moe_ep
