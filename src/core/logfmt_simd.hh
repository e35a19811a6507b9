// The LogFMT chunk kernels written once over a vector of W FP32 lanes (V, the operations of one
// instruction set), included by logfmt_avx2.cc (W = 8) and logfmt_avx512.cc (W = 16) after they
// define V and the two attribute macros:
//   MOE_EP_LOGFMT_INLINE  the target, always_inline: the helpers below
//   MOE_EP_LOGFMT_KERNEL  the target: the kernels (logfmt_kernels.hh)
// Every lane performs the operations of logfmt_math.hh in the same order (no fused multiply-add:
// these files compile with -ffp-contract=off), so the vector kernels give the scalar code's bits.
// log2 of an element is looked up in tables built from the scalar log2 (Log2Gather, Log2Tables).
// Not a general header: its contents have internal linkage, one copy per including file.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/logfmt_kernels.hh"
#include "core/logfmt_math.hh"

namespace moe_ep::core::logfmt {
namespace {

// Positions of the 16 codes of a group: code i is bits 9i .. 9i + 8 of the five little-endian
// words, i.e. word 9i / 32 from bit 9i % 32, continued in the next word; its sign is bit 16 + i
// of word 4.
struct GroupLayout {
  std::int32_t word[16], next[16], shift[16], back[16], sign_shift[16];
  constexpr GroupLayout() : word(), next(), shift(), back(), sign_shift() {
    for (int i = 0; i < 16; ++i) {
      word[i] = 9 * i / 32;
      next[i] = word[i] + 1;
      shift[i] = 9 * i % 32;
      back[i] = 32 - shift[i];  // 32 for a code that starts a word: the shift gives 0
      sign_shift[i] = 15 - i;   // bit 16 + i to bit 31
    }
  }
};
inline constexpr GroupLayout kLayout{};

template <class V>
MOE_EP_LOGFMT_INLINE typename V::F log2_of_mantissa(typename V::F m) {
  using F = typename V::F;
  const F one = V::set(1.0f);
  const F s = V::div(V::sub(m, one), V::add(m, one));
  const F z = V::mul(s, s);
  F q = V::set(bits_float(kLog2C[4]));
  for (int k = 3; k >= 0; --k) q = V::add(V::mul(q, z), V::set(bits_float(kLog2C[k])));
  return V::mul(s, q);
}

// reduction_exponent (logfmt_math.hh) of lanes of FP32 bits u.
template <class V>
MOE_EP_LOGFMT_INLINE typename V::I reduction_exponent(typename V::I u) {
  return V::template sra<23>(V::sub_int(u, V::set_int(static_cast<std::int32_t>(kMantissaLow))));
}

// log2 of non-negative lanes, with its special values (0 -> -inf, inf -> inf, NaN -> NaN).
template <class V>
MOE_EP_LOGFMT_INLINE typename V::F log2_full(typename V::F v) {
  using F = typename V::F;
  using I = typename V::I;
  const auto tiny = V::lt(v, V::set(0x1p-126f));
  const F scaled = V::select(tiny, V::mul(v, V::set(0x1p23f)), v);
  const I e = V::select_int(tiny, V::set_int(-23), V::set_int(0));
  const I u = V::as_int(scaled);
  const I k = reduction_exponent<V>(u);
  const F m = V::as_float(V::sub_int(u, V::template shl<23>(k)));
  F l = V::add(log2_of_mantissa<V>(m), V::to_float(V::add_int(k, e)));
  const F inf = V::set(std::numeric_limits<float>::infinity());
  l = V::select(V::eq(v, V::set(0.0f)), V::set(-std::numeric_limits<float>::infinity()), l);
  l = V::select(V::eq(v, inf), inf, l);
  return V::select(V::is_nan(v), v, l);
}

// 2^f of lanes f in [-1/2, 1/2] (Q of logfmt_math.hh).
template <class V>
MOE_EP_LOGFMT_INLINE typename V::F exp2_fraction(typename V::F f) {
  typename V::F p = V::set(bits_float(kExp2C[6]));
  for (int k = 5; k >= 0; --k) p = V::add(V::mul(p, f), V::set(bits_float(kExp2C[k])));
  return p;
}

// 2^x of lanes x in [-200, 200] (beyond [-160, 128] only where the clamp of exp2 changes no result:
// below -160 both give +0), zero where `keep` is clear.
template <class V>
MOE_EP_LOGFMT_INLINE typename V::F exp2_unclamped(typename V::F x, typename V::M keep) {
  typename V::F n, f;
  V::split(x, n, f);  // n = x rounded to an integer, ties to even; f = x - n
  return V::scale(keep, exp2_fraction<V>(f), n);
}

template <class V>
MOE_EP_LOGFMT_INLINE typename V::F exp2_full(typename V::F x) {
  x = V::min(V::max(x, V::set(kExp2Low)), V::set(kExp2High));  // lanes are not NaN here
  return exp2_unclamped<V>(x, V::all_lanes());
}

// The parameters of W blocks from their meta pairs (log2 of amax and amin looked up: BF16 values).
template <class V>
MOE_EP_LOGFMT_INLINE void params_of(const std::uint16_t* meta, Params* out, std::uint8_t* castable, int count,
                                    const float* log2_table) {
  using F = typename V::F;
  alignas(64) float ln[V::W], step[V::W], inv[V::W], fused[V::W];
  const typename V::I pairs = V::load_pairs(meta, count);  // amax | amin << 16, zeros past count
  const typename V::I min_bits = V::template shr<16>(pairs);
  const F la = V::gather(log2_table, V::and_int(pairs, V::set_int(0xffff))), floor_ln = V::sub(la, V::set(32.0f));
  const F lmin = V::gather(log2_table, min_bits);
  const F l = V::select(V::eq(V::as_float(min_bits), V::set(0.0f)), floor_ln,
                        V::select(V::lt(lmin, floor_ln), floor_ln, lmin));
  const unsigned ok = V::mask_bits(V::mask_and(V::lt(la, V::set(0.0f)), V::lt(l, la)));
  const F s = V::div(V::sub(la, l), V::set(510.0f));
  const F i = V::div(V::set(1.0f), s);
  const F half = V::mul(V::add(V::set(1.0f), exp2_full<V>(s)), V::set(0.5f));
  const F r = V::sub(V::set(2.0f), V::mul(log2_full<V>(half), i));
  V::store(fused, V::sub(r, V::mul(l, i)));
  V::store(ln, l);
  V::store(step, s);
  V::store(inv, i);
  for (int b = 0; b < count; ++b) {
    out[b] = {ln[b], step[b], inv[b], fused[b]};
    castable[b] = static_cast<std::uint8_t>((ok >> b) & 1u);
  }
}

template <class V>
MOE_EP_LOGFMT_KERNEL void params_kernel(const std::uint16_t* meta, std::int64_t blocks, Params* out,
                                        std::uint8_t* castable) {
  const float* table = log2_of_bf16();
  for (std::int64_t b = 0; b < blocks; b += V::W) {
    const int count = blocks - b < V::W ? static_cast<int>(blocks - b) : V::W;
    params_of<V>(meta + 2 * b, out + b, castable + b, count, table);
  }
}

// One block's parameters as vectors.
template <class V>
struct Lanes {
  typename V::F ln, step, step_inv, fused;
  MOE_EP_LOGFMT_INLINE explicit Lanes(const Params& p)
      : ln(V::set(p.ln)), step(V::set(p.step)), step_inv(V::set(p.step_inv)), fused(V::set(p.fused)) {}
};

// log2 of the magnitudes of W BF16 values (raw: the 16 bits zero-extended), as log2_of_bf16 gives
// them: a normal magnitude's from its mantissa's entry and its exponent (log2_of_mantissa_bits,
// logfmt_math.hh); a vector with a zero, subnormal, infinite or NaN magnitude looks those up in
// the full table.
template <class V>
struct Log2Tables {
  typename V::Mantissas mantissas;
  const float* full;
  MOE_EP_LOGFMT_INLINE Log2Tables() : mantissas(log2_of_mantissa_bits()), full(log2_of_bf16()) {}
  MOE_EP_LOGFMT_INLINE typename V::F of(typename V::I raw) const {
    using I = typename V::I;
    const I mag = V::and_int(raw, V::set_int(0x7fff));
    const I k = reduction_exponent<V>(V::template shl<16>(mag));
    const I mantissa = V::and_int(mag, V::set_int(kMantissaEntries - 1));
    const typename V::F l = V::add(mantissas.lookup(mantissa), V::to_float(k));
    // Exponent field 0 (zero, subnormal) or 255 (infinity, NaN): the full table.
    const typename V::M other = V::mask_or(V::lt_int(mag, V::set_int(0x80)), V::lt_int(V::set_int(0x7f7f), mag));
    return V::mask_bits(other) == 0 ? l : V::select(other, V::gather(full, mag), l);
  }
};

// The same values gathered from the full table: fewer vector operations, more loads. The round
// trip, whose arithmetic keeps the vector units busy, is faster with it; the encoder is faster with
// Log2Tables where V::kLog2ByMantissa (kernels_bench BM_LogfmtEncodeRow: docs/performance.md).
template <class V>
struct Log2Gather {
  const float* full;
  MOE_EP_LOGFMT_INLINE Log2Gather() : full(log2_of_bf16()) {}
  MOE_EP_LOGFMT_INLINE typename V::F of(typename V::I raw) const {
    return V::gather(full, V::and_int(raw, V::set_int(0x7fff)));
  }
};

// t of W BF16 values (raw: the 16 bits zero-extended): log2(|x|) * step_inv + fused, -inf for 0.
template <class V, class Log2>
MOE_EP_LOGFMT_INLINE typename V::F code_argument(typename V::I raw, const Lanes<V>& p, const Log2& log2) {
  const typename V::F l = log2.of(raw);
  return V::add(V::mul(l, p.step_inv), p.fused);
}

// The codes of t: floor(max(t, 0)) capped at 511, as FP32 integers.
template <class V>
MOE_EP_LOGFMT_INLINE typename V::F codes_of(typename V::F t) {
  return V::floor(V::min(V::max(t, V::set(0.0f)), V::set(511.0f)));
}

// The magnitudes of W codes: 0 for code < 1, else 2^((code - 1) * step + ln), where (code - 1) * step
// + ln lies in [-166, 1] (ln >= log2(2^-133) - 32).
template <class V>
MOE_EP_LOGFMT_INLINE typename V::F levels_of(typename V::F code, const Lanes<V>& p) {
  const typename V::F y = V::add(V::mul(V::sub(code, V::set(1.0f)), p.step), p.ln);
  return exp2_unclamped<V>(y, V::lt(V::set(0.5f), code));
}

// A decoded magnitude d with the sign bit (bit 31) of `sign`, written or accumulated. Weighted: the
// sign goes on the weight, (-w) * d being -(w * d).
template <class V, Mode kMode>
MOE_EP_LOGFMT_INLINE void put_signed(float* out, typename V::F d, typename V::I sign, typename V::F w) {
  if constexpr (kMode == Mode::kStore) {
    V::store(out, V::with_sign(d, sign));
  } else if constexpr (kMode == Mode::kFirst) {
    V::store(out, V::mul(V::xor_sign(w, sign), d));
  } else {
    V::store(out, V::add(V::load(out), V::mul(V::xor_sign(w, sign), d)));
  }
}

template <class V, Mode kMode>
MOE_EP_LOGFMT_INLINE void put(float* out, typename V::F v, typename V::F w) {
  if constexpr (kMode == Mode::kStore) {
    V::store(out, v);
  } else if constexpr (kMode == Mode::kFirst) {
    V::store(out, V::mul(w, v));
  } else {
    V::store(out, V::add(V::load(out), V::mul(w, v)));
  }
}

// Values per step of the loops below: 64 (four groups), as independent vectors in flight.
inline constexpr int kStep = 64;

// Codes of one group, packed: 16 codes of 9 bits, LSB first, then the 16 sign bits.
MOE_EP_LOGFMT_INLINE void pack_group(const std::uint64_t* p, std::uint32_t signs, std::byte* out) {
  // p[j] = code 2j | code 2j+1 << 9, at bit 18 j of the group
  const std::uint64_t lo = p[0] | p[1] << 18 | p[2] << 36 | p[3] << 54;
  const std::uint64_t hi = p[3] >> 10 | p[4] << 8 | p[5] << 26 | p[6] << 44 | p[7] << 62;
  const std::uint32_t last = static_cast<std::uint32_t>(p[7] >> 2) | signs << 16;
  std::memcpy(out, &lo, 8);
  std::memcpy(out + 8, &hi, 8);
  std::memcpy(out + 16, &last, 4);
}

template <class V>
MOE_EP_LOGFMT_KERNEL void encode_kernel(const std::uint16_t* x, const Params* params, int blocks, std::byte* out) {
  constexpr int kU = kStep / V::W;
  const std::conditional_t<V::kLog2ByMantissa, Log2Tables<V>, Log2Gather<V>> table;
  for (int b = 0; b < blocks; ++b) {
    const Lanes<V> p(params[b]);
    for (int i = b * kBlock; i < (b + 1) * kBlock; i += kStep, out += kStep / 16 * kGroupBytes) {
      alignas(64) std::uint64_t pairs[kStep / 2];
      std::uint64_t signs = 0;
      for (int u = 0; u < kU; ++u) {
        const auto raw = V::load_u16(x + i + u * V::W);
        V::store_pairs(V::truncate(codes_of<V>(code_argument<V>(raw, p, table))), pairs + u * V::W / 2);
        signs |= static_cast<std::uint64_t>(V::sign_bits(V::template shl<16>(raw))) << (u * V::W);
      }
      for (int g = 0; g < kStep / 16; ++g)
        pack_group(pairs + 8 * g, static_cast<std::uint32_t>(signs >> (16 * g)) & 0xffffu, out + g * kGroupBytes);
    }
  }
}

// The codes (FP32 integers) and sign bits (bit 31) of the W values from value h of a group.
template <class V>
MOE_EP_LOGFMT_INLINE void unpack(const std::byte* group, int h, typename V::F& code, typename V::I& sign) {
  using I = typename V::I;
  const I words = V::load_words(group);
  const I first = V::permute(words, V::load_int(kLayout.word + h));
  const I next = V::permute(words, V::load_int(kLayout.next + h));
  const I bits = V::or_int(V::srlv(first, V::load_int(kLayout.shift + h)), V::sllv(next, V::load_int(kLayout.back + h)));
  code = V::to_float(V::and_int(bits, V::set_int(0x1ff)));
  sign = V::sllv(V::permute(words, V::set_int(4)), V::load_int(kLayout.sign_shift + h));
}

template <class V, Mode kMode>
MOE_EP_LOGFMT_INLINE void decode_impl(const std::byte* in, const Params* params, int blocks, float w, float* out) {
  constexpr int kU = kStep / V::W;
  const typename V::F weight = V::set(w);
  for (int b = 0; b < blocks; ++b) {
    const Lanes<V> p(params[b]);
    for (int i = b * kBlock; i < (b + 1) * kBlock; i += kStep, in += kStep / 16 * kGroupBytes) {
      typename V::F code[kU];
      typename V::I sign[kU];
      for (int u = 0; u < kU; ++u) unpack<V>(in + u * V::W / 16 * kGroupBytes, u * V::W % 16, code[u], sign[u]);
      for (int u = 0; u < kU; ++u) put_signed<V, kMode>(out + i + u * V::W, levels_of<V>(code[u], p), sign[u], weight);
    }
  }
}

template <class V, Mode kMode>
MOE_EP_LOGFMT_INLINE void round_trip_impl(const std::uint16_t* x, const Params* params, int blocks, float w,
                                          float* out) {
  const Log2Gather<V> table;
  const typename V::F weight = V::set(w);
  for (int b = 0; b < blocks; ++b) {
    const Lanes<V> p(params[b]);
    constexpr int kU = kStep / V::W;
    for (int i = b * kBlock; i < (b + 1) * kBlock; i += kStep) {
      typename V::I raw[kU];
      typename V::F code[kU];
      for (int u = 0; u < kU; ++u) raw[u] = V::load_u16(x + i + u * V::W);
      // Codes below 0 need no clamp here: they decode to 0 as code 0 does.
      for (int u = 0; u < kU; ++u)
        code[u] = V::to_float(V::min_int(V::truncate(code_argument<V>(raw[u], p, table)), V::set_int(511)));
      for (int u = 0; u < kU; ++u)
        put_signed<V, kMode>(out + i + u * V::W, levels_of<V>(code[u], p), V::template shl<16>(raw[u]), weight);
    }
  }
}

template <class V, Mode kMode>
MOE_EP_LOGFMT_INLINE void plain_impl(const std::uint16_t* x, std::int64_t n, float w, float* out) {
  const typename V::F weight = V::set(w);
  for (std::int64_t i = 0; i < n; i += V::W) put<V, kMode>(out + i, V::as_float(V::template shl<16>(V::load_u16(x + i))), weight);
}

template <class V>
MOE_EP_LOGFMT_KERNEL void decode_kernel(const std::byte* in, const Params* p, int blocks, float w, Mode mode,
                                        float* out) {
  if (mode == Mode::kStore) return decode_impl<V, Mode::kStore>(in, p, blocks, w, out);
  if (mode == Mode::kFirst) return decode_impl<V, Mode::kFirst>(in, p, blocks, w, out);
  decode_impl<V, Mode::kAdd>(in, p, blocks, w, out);
}

template <class V>
MOE_EP_LOGFMT_KERNEL void round_trip_kernel(const std::uint16_t* x, const Params* p, int blocks, float w, Mode mode,
                                            float* out) {
  if (mode == Mode::kStore) return round_trip_impl<V, Mode::kStore>(x, p, blocks, w, out);
  if (mode == Mode::kFirst) return round_trip_impl<V, Mode::kFirst>(x, p, blocks, w, out);
  round_trip_impl<V, Mode::kAdd>(x, p, blocks, w, out);
}

template <class V>
MOE_EP_LOGFMT_KERNEL void plain_kernel(const std::uint16_t* x, std::int64_t n, float w, Mode mode, float* out) {
  if (mode == Mode::kStore) return plain_impl<V, Mode::kStore>(x, n, w, out);
  if (mode == Mode::kFirst) return plain_impl<V, Mode::kFirst>(x, n, w, out);
  plain_impl<V, Mode::kAdd>(x, n, w, out);
}

template <class V>
MOE_EP_LOGFMT_KERNEL void narrow_kernel(const float* acc, std::int64_t n, std::uint16_t* out) {
  for (std::int64_t i = 0; i < n; i += V::W) V::store_bf16(out + i, V::load(acc + i));
}

template <class V>
MOE_EP_LOGFMT_KERNEL void meta_kernel(const std::uint16_t* x, std::int64_t blocks, std::uint16_t* meta) {
  for (std::int64_t b = 0; b < blocks; ++b) {
    std::uint16_t amax = 0, amin = 0x7f80;
    V::magnitude_range(x + b * kBlock, amax, amin);
    meta[2 * b] = amax > 0x7f80 ? std::uint16_t{0x7fc0} : amax;
    meta[2 * b + 1] = amin;
  }
}

template <class V>
constexpr Kernels kernels_of() {
  return {meta_kernel<V>, params_kernel<V>, encode_kernel<V>, decode_kernel<V>, round_trip_kernel<V>, plain_kernel<V>,
          narrow_kernel<V>};
}

}  // namespace
}  // namespace moe_ep::core::logfmt
