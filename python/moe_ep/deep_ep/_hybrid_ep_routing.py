"""HybridEPBuffer's routing in plain torch (docs/hybrid-ep.md): the routing input as a map and
probabilities, the per-token lanes moe-ep's V2 dispatch moves (their order fixes the reduction
order of combine), and the items of HybridEP's handles, computed from the all-gathered map."""

import torch

from ._hybrid_ep_config import LANE_LIMIT, align


def _tensor_problem(name, t, dtypes, shape):
    """A phrase naming what is wrong with t (None when it is a tensor of one of dtypes and shape;
    -1 in shape: any size)."""
    if not isinstance(t, torch.Tensor):
        return f"{name} is a {type(t).__name__}, expected a torch tensor"
    if t.device.type != "cpu":
        return f"{name} is on {t.device}; HybridEPBuffer on moe-ep moves CPU tensors"
    if t.layout != torch.strided or t.is_nested:
        what = "is a nested tensor" if t.is_nested else f"has layout {t.layout}"
        return f"{name} {what}; HybridEPBuffer on moe-ep moves dense tensors (layout torch.strided)"
    if t.dtype not in dtypes:
        return f"{name} has dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}"
    if t.dim() != len(shape) or any(want >= 0 and have != want for have, want in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s < 0 else str(s) for s in shape) + "]"
        return f"{name} has shape {list(t.shape)}, expected {want}"
    return None


def check_tensor(name, t, dtypes, shape):
    problem = _tensor_problem(name, t, dtypes, shape)
    if problem is not None:
        raise ValueError(problem)
    return t


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def routing_of(n, num_experts, topk_idx, topk_weights, num_of_experts, routing_map, probs):
    """(map bool [N, E], probs float32 [N, E] or None) from either routing input; ValueError
    naming the argument otherwise."""
    if routing_map is not None:
        check_tensor("routing_map", routing_map, (torch.bool,), (n, num_experts))
        if probs is not None:
            check_tensor("probs", probs, (torch.float32,), (n, num_experts))
        return routing_map, probs
    if topk_idx is None:
        raise ValueError("no routing input: pass routing_map (and probs), or topk_idx, topk_weights and "
                         "num_of_experts, or a handle")
    check_tensor("topk_idx", topk_idx, _INT_DTYPES, (n, -1))
    if num_of_experts is None or num_of_experts != num_experts:
        raise ValueError(f"num_of_experts = {num_of_experts!r}, expected {num_experts} (num_local_experts * group "
                         f"size) with topk_idx")
    ids = topk_idx.to(torch.int64)
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= num_experts):
        raise ValueError(f"topk_idx holds {int(ids.min())} .. {int(ids.max())}, expected ids in [-1, {num_experts})")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, (torch.float32,), tuple(topk_idx.shape))
    slot = torch.where(ids >= 0, ids, num_experts)  # -1 lands in a column that is dropped
    routed = torch.zeros(n, num_experts + 1, dtype=torch.bool).scatter_(1, slot, True)[:, :num_experts]
    if topk_weights is None:
        return routed, None
    dense = torch.zeros(n, num_experts + 1, dtype=torch.float32).scatter_(1, slot, topk_weights)[:, :num_experts]
    return routed, dense


def routed_count_problem(routing_map):
    """A phrase when a token has more routed experts than moe-ep moves (kMaxTopk), else None."""
    counts = routing_map.sum(1)
    if counts.numel() and int(counts.max()) > LANE_LIMIT:
        t = int(counts.argmax())
        return (f"token {t} is routed to {int(counts[t])} experts; moe-ep moves at most {LANE_LIMIT} per token "
                f"(kMaxTopk)")
    return None


class HybridHandle(tuple):
    """One of HybridEP's handle tuples; ``_hybrid`` carries the moe-ep routing state behind it."""

    def __new__(cls, items, state):
        t = super().__new__(cls, items)
        t._hybrid = state
        return t


class HybridEPShape:
    """The shape of a HybridEP call: G ranks, L per NVLink domain, M domains, El experts per rank,
    N tokens per rank."""

    def __init__(self, ranks, per_node, local_experts, tokens):
        self.ranks, self.per_node, self.local_experts, self.tokens = ranks, per_node, local_experts, tokens
        self.nodes = ranks // per_node
        self.experts = local_experts * ranks
        self.node_experts = local_experts * per_node


def lanes_of(routed, sources, shape, k):
    """Lane ids int64 [rows, k] (k <= E) of map rows `routed` whose source ranks are `sources`
    [rows]: the routed experts ordered by (node key, expert), node key (source node - expert node)
    mod M, so the own node first, then nodes n-1, n-2, ...; -1 after them. The dispatcher's
    hybrid_ep layout orders top-k lanes the same way in C++ (routing::order_lanes_hybrid_ep); both
    are checked against one definition (tests/python/test_hybrid_ep_lane_order.py,
    tests/routing/lane_order_test.cc)."""
    e = torch.arange(shape.experts)
    source_node = torch.div(sources, shape.per_node, rounding_mode="floor")
    node_key = (source_node[:, None] - (e // shape.node_experts)[None, :]) % shape.nodes
    key = torch.where(routed, node_key * shape.experts + e, shape.nodes * shape.experts + e)
    order = torch.argsort(key, dim=1)[:, :k]
    return torch.where(torch.gather(routed, 1, order), order, torch.full_like(order, -1))


def lane_values(dense, lanes):
    """dense [rows, E] at the lanes [rows, k]; 0 at lanes -1 (values copied bitwise)."""
    picked = torch.gather(dense, 1, lanes.clamp(min=0))
    return torch.where(lanes >= 0, picked, torch.zeros_like(picked))


def scatter_lanes(values, lanes, width, offset=0):
    """[rows, width] float32: values [rows, k] at columns lanes - offset where those are in
    [0, width), 0 elsewhere."""
    col = lanes - offset
    keep = (lanes >= 0) & (col >= 0) & (col < width)
    out = torch.zeros(values.shape[0], width + 1, dtype=torch.float32)
    out.scatter_(1, torch.where(keep, col, torch.full_like(col, width)), torch.where(keep, values, torch.zeros_like(values)))
    return out[:, :width].contiguous()


class Routing:
    """What every rank derives from the all-gathered map (bool [G*N, E], rows g = s*N + t)."""

    def __init__(self, all_map, shape, rank):
        self.map, self.shape, self.rank = all_map, shape, rank
        g = shape
        self.to_rank = all_map.view(-1, g.ranks, g.local_experts).any(2)  # [G*N, G]
        self.to_node = all_map.view(-1, g.nodes, g.node_experts).any(2)  # [G*N, M]
        self.recv = self.to_rank[:, rank].nonzero().flatten()  # g of the rows this rank receives
        self.local_map = all_map[self.recv, rank * g.local_experts:(rank + 1) * g.local_experts]  # [D, El]
        self.topk = max(1, int(all_map.sum(1).max())) if all_map.numel() else 1

    def sources(self, rows):
        return torch.div(rows, self.shape.tokens, rounding_mode="floor")

    def lanes_for(self, rows):
        return lanes_of(self.map[rows], self.sources(rows), self.shape, self.topk)

    def common_items(self):
        """The first five handle items: sparse_to_dense_map, rdma_to_attn_map, attn_to_rdma_map,
        num_dispatched_tokens_tensor, local_expert_routing_map."""
        g, n, me = self.shape, self.shape.tokens, self.rank
        node, local = me // g.per_node, me % g.per_node
        routed = self.to_rank[:, node * g.per_node:(node + 1) * g.per_node]  # to this node's ranks
        position = torch.where(routed, routed.to(torch.int64).cumsum(0) - 1, torch.full(routed.shape, -1))
        rail = torch.cat([torch.arange((m * g.per_node + local) * n, (m * g.per_node + local + 1) * n)
                          for m in range(g.nodes)])
        sparse_to_dense = position[rail].to(torch.int32).contiguous()
        padded = align(n, 16)
        node_major = torch.zeros(g.nodes, padded, dtype=torch.bool)
        node_major[:, :n] = self.to_node[rail, node].view(g.nodes, n)
        rdma_to_attn = node_major.reshape(padded, g.nodes)  # declared [a(N, 16), M], used node-major
        others = [m for m in range(g.nodes) if m != node]
        attn_to_rdma = self.to_node[me * n:(me + 1) * n][:, others].contiguous()
        d = self.recv.numel()
        dispatched = torch.tensor([d], dtype=torch.int32)
        local_routing = torch.zeros(n * g.ranks, g.local_experts, dtype=torch.bool)
        local_routing[:d] = self.local_map
        return [sparse_to_dense, rdma_to_attn, attn_to_rdma, dispatched, local_routing]

    def counts(self):
        """c_e: the (token, local expert) pairs this rank receives, int64 [El]."""
        return self.local_map.sum(0)

    def dense_chunk_layout(self):
        g, n = self.shape, self.shape.tokens
        chunks = (n + 63) // 64
        src = self.sources(self.recv)
        chunk = src * chunks + torch.div(self.recv - src * n, 64, rounding_mode="floor")
        return torch.bincount(chunk, minlength=chunks * g.ranks).cumsum(0).to(torch.int32)

    def dense_to_expert_map(self, starts, kept_rows):
        """int32 [N*G, El]: the output row of (dense row, local expert), -1 where not routed or
        dropped (row >= kept_rows)."""
        g = self.shape
        local = self.local_map
        rows = starts[None, :] + local.to(torch.int64).cumsum(0) - 1
        keep = local & (rows < kept_rows)
        out = torch.full((g.tokens * g.ranks, g.local_experts), -1, dtype=torch.int32)
        out[:local.shape[0]] = torch.where(keep, rows, torch.full_like(rows, -1)).to(torch.int32)
        return out
