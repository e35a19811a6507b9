"""Zero copy: outputs are torch tensors over moe-ep memory (no copy on the way out), they outlive
the buffers and groups that made them, inputs (torch or numpy) are read in place by threads
(nothing copied into shared memory), and across processes a pushing dispatch reads its inputs in
place too, while a combine copies only inputs outside moe-ep memory for the peers: feeding moe-ep
outputs back in copies nothing."""

import gc

import torch

import moe_ep
from moe_ep import deep_ep

import reference as ref
import scenarios
from conftest import check_all_ok, run_processes
from scenarios import assert_same, v1_buffer

H, E, K, T, N = 256, 16, 4, 16, 12


def test_outputs_are_views_of_moe_ep_memory():
    def fn(g):
        buf = v1_buffer(g, deep_ep, low_latency_mode=True)
        inputs = ref.make_inputs(g.size(), N, H, E, K, 1)
        x, idx, w = inputs[g.rank()]
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 16, E, use_fp8=False)
        a = buf.get_next_low_latency_combine_buffer(handle)
        b = buf.get_next_low_latency_combine_buffer(handle)
        assert a.data_ptr() == b.data_ptr(), "the next combine buffer is one region of the buffer"
        a[0, 0, :4] = 7.0
        assert b[0, 0, :4].tolist() == [7.0] * 4, "both accesses see the same memory"
        # handle fields exported twice: the same storage
        f1, f2 = handle._native.fields(), handle._native.fields()
        assert f1[0].data_ptr() == f2[0].data_ptr() and f1[1].data_ptr() == f2[1].data_ptr()
        v2 = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)
        recv_x, _, _, h2, _ = v2.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        assert h2._native.recv_src_metadata.data_ptr() == h2._native.recv_src_metadata.data_ptr()
        # the output does not alias the input
        lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
        assert not (lo <= recv_x.data_ptr() < hi)
        v2.destroy()
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def _produce(g, seed):
    inputs = ref.make_inputs(g.size(), N, H, E, K, seed)
    x, idx, w = inputs[g.rank()]
    buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    combined, _, _ = buf.combine(recv_x, handle)
    v1 = v1_buffer(g, deep_ep, low_latency_mode=True)
    slab, count, llh, _, _ = v1.low_latency_dispatch(x, idx, 16, E, use_fp8=False)
    exp = ref.v2_dispatch_compact(inputs, g.rank(), E)
    per = ref.ll_expert_tokens(inputs, g.rank(), E)
    return dict(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, combined=combined, slab=slab,
                src_info=llh[0], exp=exp, per=per, inputs=inputs)


def test_outputs_outlive_buffers_and_groups():
    outs = moe_ep.LocalWorld(2).run(lambda g: _produce(g, 3))
    gc.collect()
    # more work reuses freed memory; the kept outputs must not change
    moe_ep.LocalWorld(2).run(lambda g: scenarios.v2_compact(g, deep_ep, seed=4))
    moe_ep.LocalWorld(2).run(lambda g: scenarios.v1_low_latency(g, deep_ep, seed=5))
    gc.collect()
    for rank, o in enumerate(outs):
        exp = o["exp"]
        assert_same(o["recv_x"], exp["recv_x"], "recv_x after its buffer and group are gone")
        assert_same(o["recv_idx"], exp["recv_topk_idx"], "recv_topk_idx after the buffer is gone")
        assert_same(o["recv_w"], exp["recv_topk_weights"], "recv_topk_weights after the buffer is gone")
        x = o["inputs"][rank][0]
        want = ref.combine_rank(o["inputs"], rank, E, rank_rows_of=lambda d, t: x[t])
        assert_same(o["combined"], want, "combined_x after the buffer is gone")
        for i, p in enumerate(o["per"]):
            if p:
                got = o["slab"][i, :len(p)]
                src = o["src_info"][i, :len(p)].tolist()
                assert sorted(src) == sorted(t for _, t in p)
                assert got.shape == (len(p), H)


def test_threads_copy_nothing_into_shared_memory():
    def fn(g):
        before = g.shared_bytes_copied()
        scenarios.v2_compact(g, deep_ep, seed=10)
        scenarios.v2_expanded(g, deep_ep, seed=11)
        scenarios.v1_normal(g, deep_ep, seed=12)
        scenarios.v1_low_latency(g, deep_ep, seed=13, zero_copy=True)
        return g.shared_bytes_copied() - before
    assert moe_ep.LocalWorld(2).run(fn) == [0, 0]
    assert moe_ep.LocalWorld(4, 2).run(fn) == [0, 0, 0, 0]


def test_numpy_inputs():
    def fn(g):
        inputs = ref.make_inputs(g.size(), N, H, E, K, 14)
        x, idx, w = inputs[g.rank()]
        buf = deep_ep.ElasticBuffer(g, num_max_tokens_per_rank=T, hidden=H, num_topk=K, use_fp8_dispatch=True,
                                    explicitly_destroy=True)
        pairs = [scenarios._fp8_pair(inputs[s][0], s) for s in range(g.size())]
        codes, scales = pairs[g.rank()]
        # numpy has no float8: FP8 data comes as its uint8 codes.
        (rx, rsf), ridx, rw, _, _ = buf.dispatch((codes.view(torch.uint8).numpy(), scales.numpy()), topk_idx=idx.numpy(),
                                                 topk_weights=w.numpy(), num_experts=E)
        exp = ref.v2_dispatch_compact(inputs, g.rank(), E, payload=lambda s: pairs[s][0])
        assert_same(rx, exp["recv_x"], "recv_x from numpy FP8 codes")
        assert_same(rsf, torch.stack([pairs[s][1][t] for s, t in exp["rows"]]), "recv_x_scales from numpy")
        assert_same(ridx, exp["recv_topk_idx"], "recv_topk_idx from numpy routing")
        assert_same(rw, exp["recv_topk_weights"], "recv_topk_weights from numpy")
        assert isinstance(rx, torch.Tensor)
        buf.destroy()
        return True
    assert moe_ep.LocalWorld(2).run(fn) == [True, True]


def _copied_bytes(rank, world, group):
    import moe_ep
    import deep_ep
    g = moe_ep.resolve_group(group)
    # Large tensors: moe-ep memory is shareable in place from 1 MiB (smaller blocks come from the
    # heap and are copied, which costs little); x here is 160 x 4096 BF16 = 1.25 MiB.
    PH, PN = 4096, 160
    inputs = ref.make_inputs(world, PN, PH, E, K, 20, vary=False)
    x, idx, w = inputs[rank]
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=PN, hidden=PH, num_topk=K, explicitly_destroy=True)
    c0 = g.shared_bytes_copied()
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    c1 = g.shared_bytes_copied()
    # bytes a copy into the shared arena counts: each tensor starts 64-byte aligned there
    aligned = lambda b: (b + 63) // 64 * 64
    nbytes = lambda t: aligned(t.numel() * t.element_size())
    # A new dispatch also publishes its tokens grouped by destination rank, 8 bytes per (token,
    # destination rank) pair: moe-ep memory below 1 MiB, so copied like the handle's top-k ids.
    pairs = sum(len(ref.dest_ranks(row, E, world)) for row in idx)
    listed = aligned(pairs * 8)
    exp = ref.v2_dispatch_compact(inputs, rank, E)
    assert_same(recv_x, exp["recv_x"], "recv_x")
    # The node's sources push their rows into the receiver's outputs (moe-ep memory, mapped in
    # place) at the rows their own plans give: no receive plan is published.
    # x is read where it is, even though torch allocated it, and so are the weights: only the
    # routing is copied
    assert 0 < c1 - c0 <= nbytes(idx) + listed, (c0, c1)
    assert c1 - c0 < nbytes(x), f"dispatch copied {c1 - c0} bytes: x ({nbytes(x)} bytes) was not read in place"
    # expert outputs written into moe_ep.empty memory: combine copies nothing
    y = moe_ep.empty_like(recv_x)
    y.copy_(recv_x)
    buf.combine(y, handle)
    assert g.shared_bytes_copied() == c1, f"combine of a moe_ep.empty tensor copied {g.shared_bytes_copied() - c1} bytes"
    # moe-ep outputs fed back: the expert output is recv_x itself, and the weights are recv_w
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    c2 = g.shared_bytes_copied()
    # recv_x (large) is read in place; recv_w is below the 1 MiB of shareable blocks, so copied
    assert c2 - c1 <= nbytes(recv_w), f"combine of moe-ep outputs copied {c2 - c1} bytes (weights: {nbytes(recv_w)})"
    assert_same(combined, ref.combine_rank(inputs, rank, E, rank_rows_of=lambda d, t: x[t]), "combined_x")
    # a dispatch of moe-ep memory (the combined output) copies at most the routing tensors
    recv2, _, _, h2, _ = buf.dispatch(combined, topk_idx=idx, topk_weights=w, num_experts=E)
    c3 = g.shared_bytes_copied()
    assert c3 - c2 <= nbytes(idx) + listed, f"dispatch of a moe-ep output copied {c3 - c2} bytes"
    # and a cached dispatch copies at most the handle's (small) top-k ids
    buf.dispatch(combined, handle=h2)
    c4 = g.shared_bytes_copied()
    assert c4 - c3 <= nbytes(idx), f"cached dispatch copied {c4 - c3} bytes"
    # a combine input torch allocated is copied for the peers: the counter sees whole tensors
    torch_y = recv_x.clone()
    buf.combine(torch_y, handle)
    assert g.shared_bytes_copied() - c4 >= nbytes(torch_y), f"combine of a torch tensor copied {g.shared_bytes_copied() - c4}"
    buf.destroy()
    return [c1 - c0, c2 - c1, c3 - c2]


def test_processes_copy_only_foreign_inputs():
    out = check_all_ok(run_processes(_copied_bytes, 2))
    assert all(o[0] > 0 for o in out)  # the routing was copied
