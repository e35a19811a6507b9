"""What every scenario shares: the bitwise comparison of tensors, the group's shape and the inputs
made besides the reference's (pass-through FP8 pairs, combine biases)."""
import torch


def assert_same(actual, expected, what):
    assert actual is not None, f"{what} is None"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    if actual.dtype == torch.float8_e4m3fn:  # compared as codes: float8 has no equality kernels
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    if not torch.equal(actual, expected):
        diff = (actual != expected)
        if diff.dim() > 1:
            diff = diff.reshape(diff.shape[0], -1).any(1)
        rows = torch.nonzero(diff).flatten().tolist()
        raise AssertionError(f"{what}: {len(rows)} of {actual.shape[0]} rows differ (first rows {rows[:8]})")


def group_info(group):
    """(rank, size, ranks per node) of any group argument."""
    import moe_ep
    g = moe_ep.resolve_group(group)
    return g.rank(), g.size(), g.num_scaleup, g.num_scaleout


def _fp8_pair(x, seed_rank):
    """A pass-through FP8 input: a torch.float8_e4m3fn tensor of arbitrary valid E4M3 codes, and
    FP32 scales [N, H/128]."""
    gen = torch.Generator().manual_seed(4242 + seed_rank)
    n, h = x.shape
    codes = torch.randint(0, 126, (n, h), generator=gen, dtype=torch.int64).to(torch.uint8)
    codes |= (torch.randint(0, 2, (n, h), generator=gen) * 128).to(torch.uint8)
    scales = torch.rand(n, h // 128, generator=gen) + 0.5
    return codes.view(torch.float8_e4m3fn), scales


def _biases(seed, tokens, hidden):
    """Two BF16 bias tensors [tokens, hidden] for a combine."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(2)]
