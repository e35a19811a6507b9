"""Engram storage and PP send/receive scenarios (docs/engram-pp.md), checked against torch.

engram: every rank builds every rank's table from the seed; the rows and scales a fetch returns
must equal torch indexing of the concatenated tables (and scales), for both scale layouts, also
after a second write. pp_ring: every rank follows one random schedule of sends between ring
neighbours (the same on every rank, from the seed), sending the events it is the source of and
receiving those it is the destination of, in schedule order (deadlock-free: see the docstring);
every received tensor must equal the one sent.
"""
import random
import time

import torch

from .common import assert_same, group_info

MiB2 = 2 << 20


def _table(seed, rank, entries, hidden, fp8):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    if fp8:  # any E4M3 code but NaN (0x7F, 0xFF): compared as codes anyway
        return torch.randint(0, 0x7F, (entries, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return torch.randn(entries, hidden, generator=gen).to(torch.bfloat16)


def _scales(seed, rows, P, dtype):
    gen = torch.Generator().manual_seed(seed * 100 + 99)
    if dtype == torch.int32:
        return torch.randint(-2**31, 2**31 - 1, (rows, P), generator=gen, dtype=torch.int32)
    return torch.rand(rows, P, generator=gen) + 0.5


def _check_fetch(buf, idx, tables, sf, T, K, hidden, what):
    table = torch.cat(tables)
    want = table[idx.long()].reshape(T, K * hidden)
    for col_major in (False, True):
        data, sf_out = buf.engram_fetch(idx, use_tma_aligned_col_major_sf=col_major)()
        assert_same(data, want, f"{what}: data (col_major {col_major})")
        if sf is None:
            assert sf_out is None, f"{what}: sf_out without scales"
            continue
        P = sf.shape[1]
        assert_same(sf_out, sf[idx.long()].reshape(T, K * P), f"{what}: sf_out (col_major {col_major})")
        want_strides = (1, (T + 3) // 4 * 4) if col_major else (K * P, 1)
        assert sf_out.stride() == want_strides, f"{what}: sf_out strides {sf_out.stride()}, expected {want_strides}"


def engram(group, deep_ep, seed, fp8=False, sf_dtype=torch.float32, entries=12, hidden=256, T=7, K=3, P=4):
    """Writes, fetches, writes again (other rows) and fetches; returns the fetched bytes."""
    rank, R, _, _ = group_info(group)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    gpu, cpu = deep_ep.ElasticBuffer.get_engram_storage_size_hint(entries, hidden, T * K, dtype)
    buf = deep_ep.ElasticBuffer(group, num_bytes=gpu + cpu, num_cpu_bytes=cpu, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    for round_ in range(2):
        s = seed + 1000 * round_
        tables = [_table(s, r, entries, hidden, fp8) for r in range(R)]
        sf = _scales(s, R * entries, P, sf_dtype) if fp8 else None
        buf.engram_write(tables[rank], sf)
        idx = torch.randint(0, R * entries, (T, K), generator=gen, dtype=torch.int32)
        _check_fetch(buf, idx, tables, sf, T, K, hidden, f"rank {rank} round {round_}")
    buf.barrier()
    buf.destroy()
    return T * K * hidden * (1 if fp8 else 2)


def schedule(seed, R, events, max_rows):
    """[(src, dst, rows)]: random sources, each sending to its prev or next. Ranks that act on the
    events in this order never wait forever: the earliest event some rank waits at has its sender
    and receiver past every earlier event, so its receive finds the message and its send finds
    the earlier messages of its channel received."""
    rng = random.Random(seed)
    out = []
    for _ in range(events):
        src = rng.randrange(R)
        out.append((src, rng.choice([(src - 1) % R, (src + 1) % R]), rng.randint(1, max_rows)))
    return out


def _payload(seed, i, rows, hidden):
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed * 10000 + i)).to(torch.bfloat16)


def pp_ring(group, deep_ep, seed, events=96, depth=3, hidden=1024, max_rows=16, delays=True):
    """The schedule's sends and receives with torch.equal on every message; returns the counts."""
    rank, R, _, _ = group_info(group)
    buf = deep_ep.ElasticBuffer(group, num_bytes=MiB2, num_cpu_timeout_secs=60, explicitly_destroy=True)
    buf.pp_set_config(max_rows * hidden * 2, depth)
    wait = random.Random(seed * 31 + rank)
    sent = received = 0
    for i, (src, dst, rows) in enumerate(schedule(seed, R, events, max_rows)):
        if delays and wait.random() < 0.1:
            time.sleep(wait.random() * 0.003)
        if src == rank:
            buf.pp_send(_payload(seed, i, rows, hidden), dst)
            sent += 1
        if dst == rank:
            got = torch.empty(rows, hidden, dtype=torch.bfloat16)
            buf.pp_recv(got, src)
            assert torch.equal(got, _payload(seed, i, rows, hidden)), f"rank {rank}: event {i} from rank {src} differs"
            received += 1
    buf.barrier()
    buf.destroy()
    return sent, received
