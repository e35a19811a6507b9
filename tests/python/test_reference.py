"""The reference checks itself: its E4M3 rounding against an exhaustive nearest-code search, its
decoder against the format's definition, the block cast's scale rule (amax times the FP32
reciprocal of 448), and the combine order."""

import numpy as np
import torch

import reference as ref


def _nearest_even(v, table):
    finite = ~np.isnan(table)
    vals = table[finite]
    codes = np.nonzero(finite)[0]
    d = np.abs(vals - v)
    best = d.min()
    cands = codes[d == best]
    even = [c for c in cands if (c & 1) == 0]  # ties: the even mantissa
    return table[(even or list(cands))[0]]


def test_e4m3_round_matches_exhaustive_search():
    table = ref.e4m3_decode(np.arange(256, dtype=np.uint8))
    assert table[0x7E] == 448 and np.isnan(table[0x7F]) and table[0x01] == 2.0 ** -9 and table[0x08] == 2.0 ** -6
    finite = np.sort(np.unique(table[~np.isnan(table)]))
    mids = (finite[1:] + finite[:-1]) / 2
    rng = np.random.default_rng(0)
    samples = np.concatenate([finite, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                              rng.uniform(-440, 440, 2000), rng.uniform(-0.02, 0.02, 2000)])
    samples = samples.astype(np.float32).astype(np.float64)
    got = ref.e4m3_round(samples)
    want = np.array([_nearest_even(v, table) if abs(v) < 448 else np.sign(v) * 448 for v in samples])
    assert np.array_equal(got, want)
    assert ref.e4m3_round(np.array([1e9, -500.0, 449.0]))[0] == 448
    assert np.isnan(ref.e4m3_round(np.array([np.nan]))[0])
    codes = ref.e4m3_encode(finite)
    assert np.array_equal(ref.e4m3_decode(codes), finite)


def test_block_cast_rule():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[0, :128] = torch.linspace(-3, 3, 128).to(torch.bfloat16)
    q, s = ref.fp8_block_cast(x)
    amax = float(x[0, :128].float().abs().max())
    inv448 = np.float32(1) / np.float32(448)  # DeepEP's FP32 constant
    assert amax == 3.0 and np.float32(3) / np.float32(448) != np.float32(3) * inv448  # the quotient is another float
    assert float(s[0, 0]) == np.float32(np.float32(amax) * inv448)
    assert float(s[0, 1]) == np.float32(np.float32(1e-4) * inv448)  # amax floor
    assert np.abs(q).max() == 448
    q2, s2 = ref.fp8_block_cast(x, round_scale=True)
    assert float(s2[0, 0]) == 2.0 ** np.ceil(np.log2(np.float32(amax) * inv448))
    packed = ref.ue8m0_pack(torch.tensor([[2.0 ** -3, 2.0 ** 0, 2.0 ** 1, 2.0 ** -127 * 2, 1.0]], dtype=torch.float32))
    v = packed.numpy().view(np.uint32)
    assert v.shape == (1, 2)
    assert v[0, 0] == (124 | 127 << 8 | 128 << 16 | 1 << 24) and v[0, 1] == 127


def test_combine_order_is_ascending_master_lane_with_one_rounding():
    # E = 4 experts on 4 ranks; lanes: 0 -> rank 2, 1 -> rank 0, 2 -> rank 2 (master lane of rank 2 is 2)
    idx = torch.tensor([2, 0, 3 - 1])
    big = torch.tensor([2.0 ** 10], dtype=torch.bfloat16)
    small = torch.tensor([1.0], dtype=torch.bfloat16)
    # rank 0 (key 1) returns big, rank 2 (key 2) returns -big; with a bias of small: small + big - big = 0 in
    # FP32? no: exact in FP32 (1 + 1024 - 1024 = 1); the BF16 rounding happens once at the end
    row = ref.combine_token(torch.tensor([2, 0, -1]), 4, 4, rank_rows={2: -big, 0: big}, biases=[small])
    assert float(row[0]) == 1.0
    # 2^24 + 1 - 2^24 in FP32 loses the 1 (first input taken as is, in order)
    b = torch.tensor([2.0 ** 24], dtype=torch.bfloat16)
    r1 = ref.combine_token(torch.tensor([0, 1, 2]), 3, 3, rank_rows={0: b, 1: small, 2: -b})
    r2 = ref.combine_token(torch.tensor([1, 2, 0]), 3, 3, rank_rows={1: b, 2: small, 0: -b})
    assert float(r1[0]) == 0.0  # (B + 1) - B
    assert float(r2[0]) == 0.0  # keys: rank 1 -> lane 0 (B), rank 2 -> lane 1 (1), rank 0 -> lane 2 (-B)
    r3 = ref.combine_token(torch.tensor([0, 2, 1]), 3, 3, rank_rows={0: b, 2: -b, 1: small})
    assert float(r3[0]) == 1.0  # (B - B) + 1
    assert idx.numel() == 3
