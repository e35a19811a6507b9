// What the CUDA provider's device code and its host executor share: the qualifiers that make one
// function both a device and a host function, flag loads and stores with acquire/release
// ordering across processes and devices, a nanosecond clock for bounded waits, and the BF16
// widening and rounding of the built-in provider (core/reduce.cc), bit for bit.
//
// Compiled by nvcc (device code, __CUDACC__ defined) and by the host compiler (the executor that
// runs the same steps on host threads, tests/cuda), so nothing here may need either one only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "moe_ep/limits.hpp"  // kMaxTopk, kMaxCudaRanks: sizes of the step arrays

#if defined(__CUDACC__)
#include <cuda/atomic>
#define MOE_EP_HD __host__ __device__
#define MOE_EP_DEVICE_LAMBDA __device__
#else
#define MOE_EP_HD
#define MOE_EP_DEVICE_LAMBDA
#endif

namespace moe_ep::cuda {

// A flag another rank (thread, process or device) writes: release stores, acquire loads, at
// system scope (peers may be processes, other devices over NVLink, or host threads).
// The fence first: the writes earlier steps made (other threads, earlier kernels of the stream)
// are ordered before the flag at system scope, for peers on other devices and processes.
MOE_EP_HD inline void store_release(std::uint64_t* flag, std::uint64_t value) {
#if defined(__CUDACC__)
  ::cuda::atomic_thread_fence(::cuda::memory_order_seq_cst, ::cuda::thread_scope_system);
  ::cuda::atomic_ref<std::uint64_t, ::cuda::thread_scope_system>(*flag).store(value, ::cuda::memory_order_release);
#else  // host: each step happens after the earlier ones (any thread's writes): the release store orders them
  std::atomic_ref<std::uint64_t>(*flag).store(value, std::memory_order_release);
#endif
}

MOE_EP_HD inline std::uint64_t load_acquire(std::uint64_t* flag) {
#if defined(__CUDACC__)
  return ::cuda::atomic_ref<std::uint64_t, ::cuda::thread_scope_system>(*flag).load(::cuda::memory_order_acquire);
#else
  return std::atomic_ref<std::uint64_t>(*flag).load(std::memory_order_acquire);
#endif
}

// Sets *word to value if it is 0 (the first error wins); returns whether it did.
MOE_EP_HD inline bool set_first(std::uint64_t* word, std::uint64_t value) {
#if defined(__CUDACC__)
  std::uint64_t expected = 0;
  return ::cuda::atomic_ref<std::uint64_t, ::cuda::thread_scope_system>(*word).compare_exchange_strong(
      expected, value, ::cuda::memory_order_acq_rel);
#else
  std::uint64_t expected = 0;
  return std::atomic_ref<std::uint64_t>(*word).compare_exchange_strong(expected, value, std::memory_order_acq_rel);
#endif
}

// Between two polls of a flag: the GPU thread sleeps briefly (fewer memory polls), a host thread
// yields its core to the ranks it waits for.
MOE_EP_HD inline void pause_between_polls() {
#if defined(__CUDA_ARCH__)
  __nanosleep(64);
#else
  std::this_thread::yield();
#endif
}

MOE_EP_HD inline std::uint64_t now_ns() {
#if defined(__CUDA_ARCH__)
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
#endif
}

MOE_EP_HD inline float widen_bf16(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// FP32 -> BF16, round to nearest even; NaN keeps its sign and gets the quiet bit.
MOE_EP_HD inline std::uint16_t narrow_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// 16 bytes, the unit every row copy moves (rows are multiples of 16 bytes).
struct alignas(16) Chunk {
  std::uint32_t w[4];
};

// 16 bytes at p (16-byte aligned) as 8 BF16 values widened to FP32, and 8 BF16 values stored.
MOE_EP_HD inline void load8_bf16(const std::uint16_t* p, float* v) {
  Chunk c;
#if defined(__CUDA_ARCH__)
  c = *reinterpret_cast<const Chunk*>(p);
#else
  std::memcpy(&c, p, sizeof c);
#endif
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = widen_bf16(static_cast<std::uint16_t>(c.w[i] & 0xffffu));
    v[2 * i + 1] = widen_bf16(static_cast<std::uint16_t>(c.w[i] >> 16));
  }
}
MOE_EP_HD inline void store8_bf16(std::uint16_t* p, const std::uint16_t* v) {
  Chunk c;
  for (int i = 0; i < 4; ++i) c.w[i] = static_cast<std::uint32_t>(v[2 * i]) | (static_cast<std::uint32_t>(v[2 * i + 1]) << 16);
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Chunk*>(p) = c;
#else
  std::memcpy(p, &c, sizeof c);
#endif
}
MOE_EP_HD inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// One error per rank and call, packed in 64 bits: 0 = none. The host decodes it (error_word.hh).
enum class ErrorCode : std::uint32_t {
  kNone = 0,
  kExpertOutOfRange = 1,  // a = token, b = lane, value = the id (its low 32 bits)
  kDuplicateExpert = 2,   // a = token, b = lane, value = the id
  kTimeout = 3,           // a = the peer that did not arrive, b = the barrier of the call, value = its step
  kPeerRejected = 4,      // a = the peer whose top-k ids were bad
  kPeerLeft = 5,          // a = the rank whose failure after the agreement made ranks leave (the root cause), b = the barrier
};

// The signal a rank leaves in its peers' counters when it fails after a call's agreement, or
// leaves because a peer did: kLeftSignal | the root cause's rank. Waits for it end at once
// (kPeerLeft naming the root cause) instead of running into the timeout.
inline constexpr std::uint64_t kLeftSignal = ~std::uint64_t{0xffff};

// code: 4 bits, a: 22 bits (tokens are below 2^22: the provider's limit), b: 6 bits, value: 32 bits.
static_assert(kMaxCudaTokensPerRank <= (1 << 22) && kMaxCudaRanks <= (1 << 22), "a token or a rank fits in field a");
static_assert(kMaxTopk <= (1 << 6), "a lane fits in field b");
MOE_EP_HD inline std::uint64_t pack_error(ErrorCode code, std::uint32_t a, std::uint32_t b, std::int64_t value) {
  return (static_cast<std::uint64_t>(code) << 60) | (static_cast<std::uint64_t>(a & 0x3fffffu) << 38) |
         (static_cast<std::uint64_t>(b & 0x3fu) << 32) | static_cast<std::uint32_t>(value);
}
struct UnpackedError {
  ErrorCode code;
  std::uint32_t a, b;
  std::int32_t value;
};
MOE_EP_HD inline UnpackedError unpack_error(std::uint64_t w) {
  return {static_cast<ErrorCode>(w >> 60), static_cast<std::uint32_t>((w >> 38) & 0x3fffffu),
          static_cast<std::uint32_t>((w >> 32) & 0x3fu), static_cast<std::int32_t>(static_cast<std::uint32_t>(w))};
}

}  // namespace moe_ep::cuda
