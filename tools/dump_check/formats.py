"""Numeric formats as numpy computes them (docs/quantized-formats.md, moe_ep/convert.hpp): BF16,
the per-128 FP8 E4M3 cast, the NVFP4 cast (E2M1 values, E4M3 or UE8M0 block scales, nearest-even
or SM90 rounding), the 128 x 4 swizzled scale storage, LogFMT-10 and the FP32 row sum with one
BF16 rounding. Bit-exact with the library: every step rounds where the library rounds."""
import numpy as np

F32 = np.float32


def bf16_to_f32(u16):
    return (np.asarray(u16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(f32):
    u = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def fp8_table():
    values = np.zeros(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 15, code & 7
        if e == 15 and m == 7:
            values[code] = np.nan
        elif e == 0:
            values[code] = sign * m * 2.0 ** -9
        else:
            values[code] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return values



FP8_VALUES = fp8_table()
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def f32_to_e4m3(f):
    """float8_e4m3fn code: round to nearest even, saturating at 448, NaN -> 0x7F (with sign)."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32)
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    mag = u & np.uint32(0x7FFFFFFF)
    normal = ((mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    # Below 2^-6: |f| * 512 rounded to an integer (adding 2^23 rounds to nearest even).
    sub = (mag.view(np.float32) * F32(512) + F32(8388608)).view(np.uint32) - np.uint32(0x4B000000)
    code = np.where(mag < np.uint32(0x3C800000), sub, normal)
    code = np.where(mag > np.uint32(0x43E00000), np.uint32(0x7E), code)
    code = np.where(mag > np.uint32(0x7F800000), np.uint32(0x7F), code)
    return (sign | code).astype(np.uint8)


def cast_fp8(x_bits, round_scale=False):
    """Per-128 FP8 cast of BF16 rows (moe_ep/convert.hpp): codes [N, H] and scale_inv [N, H/128].
    scale_inv = amax * fp32(1/448), one FP32 product (DeepEP's formula, not amax / 448)."""
    n, h = x_bits.shape
    x = bf16_to_f32(x_bits).reshape(n, h // 128, 128)
    mag = np.abs(x)
    amax = np.where(np.isnan(mag), F32(0), mag).max(axis=2) if n else np.zeros((0, h // 128), np.float32)
    floored = np.maximum(amax, F32(1e-4))
    scale_inv = (floored * (F32(1) / F32(448))).astype(np.float32)
    if round_scale:
        # 2^e with e = ceil(log2(scale_inv)): the exponent field, plus one if any mantissa bit is set
        u = scale_inv.view(np.uint32)
        e = ((u >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127 + (u & np.uint32(0x7FFFFF) != 0)
        finite = np.isfinite(scale_inv)
        e = np.where(finite, e, 0)
        scale_inv = np.where(finite, ((e + 127).astype(np.uint32) << np.uint32(23)).view(np.float32), scale_inv)
        scale = np.where(finite, ((127 - e).astype(np.uint32) << np.uint32(23)).view(np.float32), F32(0))
    else:
        scale = (F32(448) / floored).astype(np.float32)
    q = f32_to_e4m3(x * scale[:, :, None]).reshape(n, h)
    return q, scale_inv


def dequant_fp8(q, scale_inv):
    n, h = q.shape
    return (FP8_VALUES[q].reshape(n, h // 128, 128) * scale_inv[:, :, None]).reshape(n, h).astype(np.float32)


def f32_to_e2m1(v, rounding):
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    sign = ((u >> np.uint32(28)) & np.uint32(8)).astype(np.uint8)
    m = (u & np.uint32(0x7FFFFFFF)).view(np.float32)
    if rounding == "sm90":
        s2, s8, s32 = F32(1.41421356237309505), F32(2.82842712474619010), F32(5.65685424949238020)
        code = np.select([m < F32(0.5), m < F32(1), m < F32(2), m < F32(4)],
                         [0, 1, np.where(m > s2, 3, 2), np.where(m > s8, 5, 4)], np.where(m > s32, 7, 6))
    else:  # nearest_even: midpoints, ties to the even code
        code = ((m > F32(0.25)).astype(np.int32) + (m >= F32(0.75)) + (m > F32(1.25)) + (m >= F32(1.75)) +
                (m > F32(2.5)) + (m >= F32(3.5)) + (m > F32(5.0)))
    code = np.where(np.isnan(m), 7, code).astype(np.uint8)
    return sign | code


def f32_to_ue8m0_ceil(f):
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    e = u >> np.uint32(23)
    b = np.minimum(e + ((u & np.uint32(0x7FFFFF)) != 0), 254)
    b = np.where(e == 0, np.where(u <= np.uint32(1 << 22), 0, 1), b)
    b = np.where(e == 255, 254, b)
    b = np.where(np.asarray(f) >= 0, b, 255)  # NaN or negative
    return b.astype(np.uint8)


def cast_nvfp4(x_bits, ue8m0, gs, rounding):
    """NVFP4 row cast (docs/quantized-formats.md): packed [N, H/2], block scales [N, H/16], the
    dequantized values [N, H] (the experts' input)."""
    n, h = x_bits.shape
    x = bf16_to_f32(x_bits).reshape(n, h // 16, 16)
    a = np.abs(x)
    vmax = np.where(np.isnan(a), F32(0), a).max(axis=2) if n else np.zeros((0, h // 16), np.float32)
    r6 = F32(1) / F32(6)
    if ue8m0:
        sf = f32_to_ue8m0_ceil(vmax * r6)
        out_scale = np.where(sf == 0, F32(1), np.ldexp(F32(1), 127 - sf.astype(np.int32)).astype(np.float32))
    else:
        gs = F32(gs)
        sf = f32_to_e4m3(gs * (vmax * r6))
        sf_q = FP8_VALUES[sf]
        with np.errstate(divide="ignore"):
            out_scale = np.where(sf_q != 0, F32(1) / (sf_q * (F32(1) / gs)), F32(0)).astype(np.float32)
    codes = f32_to_e2m1(x * out_scale[:, :, None], rounding).reshape(n, h)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    values = E2M1_VALUES[codes].reshape(n, h // 16, 16)
    if ue8m0:
        deq = np.ldexp(values, sf.astype(np.int32)[:, :, None] - 127).astype(np.float32)
    else:
        deq = (values * FP8_VALUES[sf][:, :, None] / F32(gs)).astype(np.float32)
    return packed, sf, deq.reshape(n, h)


def swizzled_scales(sf_rows, rows_total, h):
    """One expert's scale bytes in the 128 x 4 swizzled storage [rm, rk, 32, 4, 4] (flattened),
    rows 0..len(sf_rows) filled, every other byte zero."""
    rm, rk = (rows_total + 127) // 128, (h + 63) // 64
    out = np.zeros(rm * rk * 512, dtype=np.uint8)
    n = sf_rows.shape[0]
    if n:
        t = np.arange(n)[:, None]
        j = np.arange(h // 16)[None, :]
        off = ((t // 128) * rk + j // 4) * 512 + (t % 32) * 16 + ((t % 128) // 32) * 4 + j % 4
        out[off] = sf_rows
    return out


# LogFMT's own log2 and exp2 (docs/quantized-formats.md), in float32, one rounding per operation.
LOG2_P = [np.array(b, dtype=np.uint32).view(np.float32) for b in  # s, s^3, ..., s^9: fp32(2 / (k ln 2))
          (0x4038AA3B, 0x3F76384F, 0x3F13BB63, 0x3ED30BB1, 0x3EA4258A)]
EXP2_Q = [np.array(b, dtype=np.uint32).view(np.float32) for b in  # f^0 .. f^6
          (0x3F800000, 0x3F317219, 0x3E75FDF0, 0x3D635716, 0x3C1D94F2, 0x3AAFC47F, 0x3922363F)]
SQRT_HALF_BELOW = np.array(0x3F3504F3, dtype=np.uint32).view(np.float32)


def logfmt_log2(v):
    """log2 of non-negative float32 values: v = 2^e m with m in [a, 2a), a = 0x3F3504F3; s = (m - 1) /
    (m + 1); s P(s^2) + e. 0 -> -inf, inf -> inf, NaN -> NaN."""
    v = np.asarray(v, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        m, e = np.frexp(v)  # m in [1/2, 1), exact (subnormals normalized)
        m = m.astype(np.float32)
        low = m < SQRT_HALF_BELOW
        m = np.where(low, m * F32(2), m).astype(np.float32)
        e = np.where(low, e - 1, e)
        s = ((m - F32(1)) / (m + F32(1))).astype(np.float32)
        z = (s * s).astype(np.float32)
        q = LOG2_P[4]
        for c in LOG2_P[3::-1]:
            q = (q * z + c).astype(np.float32)
        out = (s * q + e.astype(np.float32)).astype(np.float32)
    out = np.where(v == 0, F32(-np.inf), out)
    out = np.where(np.isinf(v), F32(np.inf), out)
    return np.where(np.isnan(v), v, out).astype(np.float32)


def logfmt_exp2(x):
    """2^x of float32 values: clamp to [-160, 128], n = round half to even, f = x - n, Q(f) by
    Horner, then (Q 2^floor(n/2)) 2^(n - floor(n/2))."""
    x = np.asarray(x, dtype=np.float32)
    c = np.clip(np.where(np.isnan(x), F32(0), x), F32(-160), F32(128)).astype(np.float32)
    n = np.rint(c).astype(np.float32)
    f = (c - n).astype(np.float32)
    p = EXP2_Q[6]
    for q in EXP2_Q[5::-1]:
        p = (p * f + q).astype(np.float32)
    ni = n.astype(np.int32)
    n1 = ni >> 1
    with np.errstate(over="ignore", under="ignore"):
        out = ((p * np.ldexp(F32(1), n1)).astype(np.float32) * np.ldexp(F32(1), ni - n1)).astype(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def logfmt_roundtrip(y_bits):
    """What LogFMT-10 decodes BF16 rows [M, H] to (FP32), docs/quantized-formats.md: per
    128-channel block (amax, amin), castable chunks of 256*U elements coded, the rest BF16."""
    m, h = y_bits.shape
    nb = h // 128
    chunk = 256 * (4 if h % 1024 == 0 else 2)
    bits = y_bits.astype(np.uint16)
    mag = (bits & np.uint16(0x7FFF)).reshape(m, nb, 128)
    amax = mag.max(axis=2)
    amin = np.minimum(mag.min(axis=2), np.uint16(0x7F80))
    amax = np.where(amax > 0x7F80, np.uint16(0x7FC0), amax)
    amax_f, amin_f = bf16_to_f32(amax), bf16_to_f32(amin)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        la = logfmt_log2(amax_f)
        floor_ln = la - F32(32)
        log_amin = logfmt_log2(amin_f)
        ln = np.where(amin_f == 0, floor_ln, np.where(log_amin < floor_ln, floor_ln, log_amin)).astype(np.float32)
        castable = (la < 0) & (ln < la)
        step = ((la - ln) / F32(510)).astype(np.float32)
        step_inv = (F32(1) / step).astype(np.float32)
        r = (F32(2) - logfmt_log2((F32(1) + logfmt_exp2(step)) * F32(0.5)) * step_inv).astype(np.float32)
        fused = (r - ln * step_inv).astype(np.float32)
        block_chunk = np.arange(nb) * 128 // chunk
        chunk_ok = np.ones((m, block_chunk[-1] + 1), dtype=bool)
        for c in range(block_chunk[-1] + 1):
            chunk_ok[:, c] = castable[:, block_chunk == c].all(axis=1)
        coded = chunk_ok[:, block_chunk]  # [m, nb]
        v = bf16_to_f32(mag)  # [m, nb, 128]
        st, lnb, inv, fu = step[:, :, None], ln[:, :, None], step_inv[:, :, None], fused[:, :, None]
        t = (logfmt_log2(v) * inv + fu).astype(np.float32)
        code = np.floor(np.where(t < 0, F32(0), t))
        code = np.where(code >= F32(511), F32(511), code)
        code = np.where(v == 0, F32(0), code)
        code = np.where(coded[:, :, None], code, F32(0)).astype(np.int32)
        level = logfmt_exp2(((code - 1).astype(np.float32) * st + lnb).astype(np.float32))
        decoded = np.where(code == 0, F32(0), level).astype(np.float32)
    negative = (bits.reshape(m, nb, 128) >> 15).astype(bool)
    decoded = np.where(negative, -decoded, decoded)
    plain = bf16_to_f32(bits).reshape(m, nb, 128)
    return np.where(coded[:, :, None], decoded, plain).reshape(m, h).astype(np.float32), code.reshape(m, h), coded


def sum_rows(rows):
    """FP32 sum in order, the first row as is, one BF16 rounding; one row passes unchanged."""
    if len(rows) == 1:
        return rows[0]
    acc = bf16_to_f32(rows[0]).copy()
    for r in rows[1:]:
        acc = (acc + bf16_to_f32(r)).astype(np.float32)
    return f32_to_bf16(acc)
