"""HybridEP's lane order as deep_ep.HybridEPBuffer computes it in torch (`lanes_of` and
`Routing.lanes_for` of python/moe_ep/deep_ep/_hybrid_ep_routing.py), against a reference written
here in plain Python from the definition (docs/hybrid-ep.md, "Routing input and lanes"): a token of
rank s on NVLink domain n_s = s // L lists its routed experts domain by domain, in the order n_s,
n_s - 1, n_s - 2, ... (wrapping), expert ids ascending inside a domain, then -1 up to k.

The dispatcher's hybrid_ep layout orders the lanes in C++ (routing::order_lanes_hybrid_ep);
tests/routing/lane_order_test.cc checks that order against the same definition, walked the same
way, over the same kinds of cases (random routings, domains of 1 to 4 ranks, 1 to 4 domains,
padding lanes), and both files check the same hand-worked token."""

import random

import pytest
import torch

from moe_ep.deep_ep._hybrid_ep_routing import HybridEPShape, Routing, lanes_of

# (ranks, ranks per domain, local experts)
SHAPES = [(1, 1, 4), (2, 2, 4), (2, 1, 4), (4, 1, 2), (4, 2, 2), (6, 2, 4), (6, 3, 4), (8, 2, 8), (8, 4, 8),
          (3, 1, 1), (9, 3, 3), (16, 4, 4)]


def reference_lanes(experts, source, per_node, local_experts, nodes, k):
    """The lanes of a token of rank `source` routed to the set `experts`: walked domain by domain."""
    home, node_experts = source // per_node, per_node * local_experts
    lanes = []
    for step in range(nodes):
        node = (home - step) % nodes
        lanes += [e for e in range(node * node_experts, (node + 1) * node_experts) if e in experts]
    return lanes + [-1] * (k - len(lanes))


def random_routing(rng, tokens, experts):
    """A routing map (list of sets): 0 to min(E, 32) experts a token, every count reachable, with
    tokens routed nowhere and (where E <= 32) to every expert."""
    limit = min(experts, 32)
    counts = [0, limit] + [rng.choice([rng.randint(0, limit), rng.randint(0, min(limit, 8))])
                           for _ in range(tokens - 2)]
    rng.shuffle(counts)
    return [set(rng.sample(range(experts), c)) for c in counts]


def as_map(routing, experts):
    routed = torch.zeros(len(routing), experts, dtype=torch.bool)
    for t, chosen in enumerate(routing):
        for e in chosen:
            routed[t, e] = True
    return routed


def test_hand_worked_token():
    """The token of tests/routing/lane_order_test.cc (HandWorkedToken): 4 ranks of 2 experts on 2
    domains {0, 1}, {2, 3}; rank 2's token routed to experts {1, 5, 4, 0, 6}, k = 6."""
    experts, expected = {1, 5, 4, 0, 6}, [4, 5, 6, 0, 1, -1]
    assert reference_lanes(experts, 2, 2, 2, 2, 6) == expected
    shape = HybridEPShape(4, 2, 2, 1)
    lanes = lanes_of(as_map([experts], 8), torch.tensor([2]), shape, 6)
    assert lanes.tolist() == [expected]


@pytest.mark.parametrize("ranks,per_node,local_experts", SHAPES)
@pytest.mark.parametrize("padding", [0, 1, 5])
def test_lanes_of_is_the_definition(ranks, per_node, local_experts, padding):
    """lanes_of over rows of every source rank at once, k = the largest count + padding lanes (at
    most E: HybridEPBuffer's k is a token's count)."""
    rng = random.Random(ranks * 1000 + per_node * 100 + local_experts * 10 + padding)
    experts, nodes = ranks * local_experts, ranks // per_node
    routing = random_routing(rng, 40, experts)
    sources = [rng.randrange(ranks) for _ in routing]
    k = min(experts, max(1, max(len(r) for r in routing)) + padding)
    shape = HybridEPShape(ranks, per_node, local_experts, len(routing))
    lanes = lanes_of(as_map(routing, experts), torch.tensor(sources), shape, k)
    assert lanes.dtype == torch.int64 and tuple(lanes.shape) == (len(routing), k)
    for t, (chosen, source) in enumerate(zip(routing, sources)):
        assert lanes[t].tolist() == reference_lanes(chosen, source, per_node, local_experts, nodes, k), \
            f"token {t} of rank {source}, experts {sorted(chosen)}"


@pytest.mark.parametrize("ranks,per_node,local_experts", SHAPES)
def test_routing_lanes_for_is_the_definition(ranks, per_node, local_experts):
    """Routing.lanes_for (what HybridEPBuffer dispatches: a rank's own rows, and the rows it
    receives) over an all-gathered map of N tokens per rank: source = row // N, k = the largest
    count of any token of any rank."""
    rng = random.Random(ranks * 100 + per_node * 10 + local_experts)
    experts, nodes, n = ranks * local_experts, ranks // per_node, 7
    routing = random_routing(rng, ranks * n, experts)
    k = max(1, max(len(r) for r in routing))
    for rank in range(ranks):
        call = Routing(as_map(routing, experts), HybridEPShape(ranks, per_node, local_experts, n), rank)
        for rows in (torch.arange(rank * n, (rank + 1) * n), call.recv):
            lanes = call.lanes_for(rows)
            assert tuple(lanes.shape) == (rows.numel(), k)
            for row, got in zip(rows.tolist(), lanes.tolist()):
                assert got == reference_lanes(routing[row], row // n, per_node, local_experts, nodes, k), \
                    f"rank {rank}: row {row}, experts {sorted(routing[row])}"
