// The executor ElasticDevice<Exec> runs on, as a concept: what CudaExec (exec_cuda.cuh, a GPU) and
// HostExec (tests/cuda, the rank's host threads) both provide, checked with static_assert where
// each is defined. An executor runs index-parallel steps in order on the rank's communication
// stream (each(n, f): f(i) for every i in [0, n), all of a step before any of the next), owns the
// rank's memory (symmetric regions other ranks reach, stream-ordered scratch and outputs),
// orders its work after and before the caller's stream, and mirrors the device's error word to
// the host. Optional members, used when present: hardware_queues() (the device's queues in this
// process), capturing(stream) (a graph capture in progress: no host wait), peer_readable(p)
// (whether ranks on other devices can read p in place).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "cuda/device_common.hh"
#include "moe_ep/dtype.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::cuda {

// A step that does nothing (the concept's probe of each()).
struct NoStep {
  MOE_EP_HD void operator()(std::int64_t) const {}
};

template <class E>
concept Executor = requires(E e, const E ce, void* p, const void* cp, char* handle, const char* chandle, std::size_t n,
                            std::int64_t i, std::uintptr_t stream, DType dtype, const std::int32_t* in,
                            std::int32_t* out, std::uint64_t* word, std::function<void()> fn) {
  { ce.dl_device() } -> std::same_as<DLDevice>;
  { ce.direct_allowed() } -> std::same_as<bool>;
  { e.alloc(n) } -> std::same_as<std::shared_ptr<void>>;
  { e.alloc_symmetric(n) } -> std::same_as<std::shared_ptr<void>>;
  { e.temp(n) } -> std::same_as<void*>;
  e.end_op();
  { e.empty(dtype, stream, i, i) } -> std::same_as<Tensor>;
  e.each(i, NoStep{});
  e.scan(in, out, i);
  e.copy(p, cp, n);
  e.copy_to_host(p, cp, n);
  e.zero(p, n);
  e.synchronize();
  e.after_caller(stream);
  e.before_caller(stream);
  e.then(fn);
  e.mirror_error(word);
  { e.take_mirrored_error() } -> std::same_as<std::uint64_t>;
  { ce.mirrored_error() } -> std::same_as<const std::uint64_t*>;
  e.ipc_handle(p, handle);
  { e.open_ipc(chandle) } -> std::same_as<std::shared_ptr<void>>;
  e.enable_peer_access_to(cp);
};

}  // namespace moe_ep::cuda
