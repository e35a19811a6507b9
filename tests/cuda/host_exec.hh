// HostExec: the CUDA provider's executor run on the rank's host thread, so that ElasticDevice's
// whole algorithm (routing, scans, barriers over symmetric memory, row pulls, reductions) runs
// and is compared with the built-in provider on machines without a GPU. Steps run at once, in
// order; "device" memory is host memory; ranks must be threads of one process.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::cuda::testing {

class HostExec {
 public:
  explicit HostExec(int device) : device_(device) {}

  // With staging, ranks behave as processes do: every tensor peers read is first copied into
  // the rank's symmetric region, and regions are "mapped" through handles (here the address).
  static inline std::atomic<bool> staging{false};
  bool direct_allowed() const { return !staging.load(); }

  // Views of host memory labelled as memory of CUDA device `device` (only the label differs),
  // so the provider's device checks run as on a GPU.
  DLDevice dl_device() const { return {kDLCUDA, device_}; }

  std::shared_ptr<void> alloc(std::size_t bytes) {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) throw ResourceError("HostExec: out of memory");
    return {p, [](void* q) { std::free(q); }};
  }
  std::shared_ptr<void> alloc_symmetric(std::size_t bytes) { return alloc(bytes); }
  void* temp(std::size_t bytes) {
    temps_.push_back(alloc(bytes));
    return temps_.back().get();
  }
  void end_op() { temps_.clear(); }

  // A 1-d ([d0]) or 2-d ([d0, d1]) tensor.
  Tensor empty(DType dtype, std::uintptr_t /*stream*/, std::int64_t d0, std::int64_t d1 = -1) {
    const std::int64_t dims[2] = {d0, d1};
    const std::span<const std::int64_t> shape(dims, d1 < 0 ? 1 : 2);
    Tensor host = Tensor::empty(shape, dtype);
    std::memset(host.data(), 0xA5, host.nbytes());  // uninitialised memory is not zero on a GPU either
    DLManagedTensor* m = host.to_dlpack();
    m->dl_tensor.device = dl_device();
    return Tensor::from_dlpack(m);
  }

  template <class F>
  void each(std::int64_t n, F f) {
    for (std::int64_t i = 0; i < n; ++i) f(i);
  }
  void scan(const std::int32_t* in, std::int32_t* out, std::int64_t n) {
    std::int32_t run = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t v = in[i];
      out[i] = run;
      run += v;
    }
  }
  void copy(void* dst, const void* src, std::size_t bytes) { std::memmove(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  void zero(void* dst, std::size_t bytes) { std::memset(dst, 0, bytes); }
  void synchronize() {}
  void after_caller(std::uintptr_t) {}
  void before_caller(std::uintptr_t) {}
  void then(const std::function<void()>& fn) { fn(); }

  void mirror_error(std::uint64_t* word) {
    const std::uint64_t w = std::atomic_ref<std::uint64_t>(*word).load();
    if (w != 0) std::atomic_ref<std::uint64_t>(mirrored_).store(w);
  }
  std::uint64_t take_mirrored_error() { return std::atomic_ref<std::uint64_t>(mirrored_).exchange(0); }
  const std::uint64_t* mirrored_error() const { return &mirrored_; }

  void ipc_handle(void* p, char* out) { std::memcpy(out, &p, sizeof p); }
  std::shared_ptr<void> open_ipc(const char* handle) {
    void* p = nullptr;
    std::memcpy(&p, handle, sizeof p);
    return {p, [](void*) {}};  // the owner frees it
  }
  void enable_peer_access_to(const void*) {}

 private:
  int device_;
  std::vector<std::shared_ptr<void>> temps_;
  std::uint64_t mirrored_ = 0;
};

}  // namespace moe_ep::cuda::testing
