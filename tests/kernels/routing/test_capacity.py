"""Capacity and kept-slot limits: the routing-map kernel's thresholds and the priority drop
kernel against their references and against what they mean (CUDA, or the interpreter)."""

import pytest
import torch

from grouped_linear.kernels._triton import HAS_TRITON
from grouped_linear.kernels.routing import capacity as capacity_kernels
from grouped_linear.kernels.routing import routing_map as routing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _routing(gen, tokens, k, experts, drop=0.2):
    topk = torch.randint(0, experts, (tokens, k), generator=gen)
    return topk.masked_fill(torch.rand(tokens, k, generator=gen) < drop, -1)


@pytest.mark.parametrize("experts", [5, 40])
@pytest.mark.parametrize("capacity, keep, group_rows, multiple", [
    (3, None, None, 1), (7, None, None, 4), (None, 50, None, 1), (None, 0, None, 2),
    (4, 30, None, 1), (6, None, 6, 1), (8, 33, 8, 4), (None, 10**6, None, 1)])
def test_routing_map_limits_match_reference(experts, capacity, keep, group_rows, multiple):
    gen = torch.Generator().manual_seed(experts)
    topk = _routing(gen, 90, 3, experts).to(DEVICE)
    if group_rows is not None:  # groups of fixed size hold at most that many slots
        capacity = group_rows
    num_rows = (experts * group_rows if group_rows is not None
                else topk.numel() + experts * (multiple - 1))
    options = {"capacity": capacity, "keep": keep, "group_rows": group_rows}
    got = routing.routing_map(topk, experts, multiple, num_rows, max_programs=3, **options)
    want = routing.routing_map_reference(topk, experts, multiple, num_rows, **options)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # what they mean, from the slots alone: an expert keeps its first slots in slot order
    m_splits, row_map, token_of_row, counts = (t.cpu() for t in got)
    flat, rows = topk.cpu().reshape(-1), row_map.reshape(-1)
    routed = [[s for s in range(flat.numel()) if flat[s] == e] for e in range(experts)]
    kept = [len(r) if capacity is None else min(len(r), capacity) for r in routed]
    if keep is not None:
        before = 0
        for e in range(experts):
            kept[e] = max(0, min(kept[e], keep - before))
            before += kept[e]
    assert counts.tolist() == kept
    start = 0
    for e in range(experts):
        held = routed[e][:kept[e]]
        assert rows[held].tolist() == list(range(start, start + kept[e]))
        assert bool((rows[routed[e][kept[e]:]] == -1).all())
        assert token_of_row[start:start + kept[e]].tolist() == [s // 3 for s in held]
        start += int(m_splits[e])
    if group_rows is not None:
        assert m_splits.tolist() == [group_rows] * experts


@pytest.mark.parametrize("experts, capacity", [(4, 1), (6, 5), (40, 3), (3, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drop_over_capacity_matches_reference(experts, capacity, dtype):
    gen = torch.Generator().manual_seed(experts * capacity)
    tokens, k = 70, 4
    topk = _routing(gen, tokens, k, experts).to(DEVICE, torch.int32)
    topk[0, 0] = experts + 3  # out of range: dropped like -1
    # few distinct values: many ties, broken by the lower slot
    priority = (torch.randint(0, 4, (tokens, k), generator=gen) / 4).to(DEVICE, dtype)
    got = capacity_kernels.drop_over_capacity(topk, priority, experts, capacity)
    want = capacity_kernels.drop_over_capacity_reference(topk, priority, experts, capacity)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    # each expert keeps its `capacity` best slots: higher priority, then lower slot
    flat, values, kept = topk.cpu().reshape(-1), priority.float().cpu().reshape(-1), got.cpu()
    for e in range(experts):
        slots = [s for s in range(flat.numel()) if flat[s] == e]
        best = sorted(slots, key=lambda s: (-float(values[s]), s))[:capacity]
        assert sorted(s for s in slots if kept.reshape(-1)[s] == e) == sorted(best)
    assert int((kept >= 0).sum()) == sum(
        min(capacity, int((flat == e).sum())) for e in range(experts))


def test_drop_over_capacity_edges():
    topk = torch.full((5, 2), -1, device=DEVICE)
    priority = torch.rand(5, 2, device=DEVICE)
    assert bool((capacity_kernels.drop_over_capacity(topk, priority, 3, 1) == -1).all())
    empty = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert capacity_kernels.drop_over_capacity(empty, priority[:0], 3, 1).shape == (0, 2)
    # one expert holds every slot
    one = torch.zeros(9, 3, dtype=torch.int64, device=DEVICE)
    values = torch.arange(27, device=DEVICE, dtype=torch.float32).view(9, 3)
    got = capacity_kernels.drop_over_capacity(one, values, 2, 4).cpu()
    assert (got.reshape(-1) == 0).nonzero().reshape(-1).tolist() == [23, 24, 25, 26]


def test_drop_over_capacity_large_groups_and_signed_priorities():
    """Groups larger than a program's step (several blocks per pass), negative priorities,
    ``-0.0`` tied with ``0.0`` (the lower slot first), a capacity inside a run of ties."""
    gen = torch.Generator().manual_seed(11)
    tokens, k, experts = 2600, 2, 3
    topk = torch.randint(0, experts, (tokens, k), generator=gen)
    topk[:, 0] = 0  # expert 0: over 2600 slots
    priority = torch.randn(tokens, k, generator=gen)
    priority[::7] = 0.0
    priority[3::7] = -0.0
    priority[5::11] = 0.5
    for capacity in (1, 7, 1234, 2600):
        got = capacity_kernels.drop_over_capacity(topk.to(DEVICE), priority.to(DEVICE),
                                                  experts, capacity)
        want = capacity_kernels.drop_over_capacity_reference(topk, priority, experts, capacity)
        assert torch.equal(got.cpu(), want)


def test_drop_over_capacity_ranks_every_nan_highest():
    """NaN priorities of either sign and any payload rank above ``+inf`` and tie among
    themselves (the lower slot first), as ``torch.sort`` orders them on every device."""
    nan_bits = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -0x007FFFFF],
                            dtype=torch.int32)  # +NaN, -NaN, payloads of both signs
    nans = nan_bits.view(torch.float32)
    assert bool(nans.isnan().all()) and bool(nans.view(torch.int32).lt(0).any())
    values = torch.tensor([0.9, float("inf"), -float("inf"), 0.5, 0.0, -0.2, 3.0, 0.1])
    priority = torch.cat([values, nans, nans]).view(8, 2)
    topk = torch.zeros(8, 2, dtype=torch.int64)
    for capacity in (1, 4, 8, 9, 12):
        got = capacity_kernels.drop_over_capacity(topk.to(DEVICE), priority.to(DEVICE), 1,
                                                  capacity).cpu()
        want = capacity_kernels.drop_over_capacity_reference(topk, priority, 1, capacity)
        flat = priority.reshape(-1).tolist()
        best = sorted(range(16), key=lambda s: (0 if flat[s] != flat[s] else 1,
                                                -flat[s] if flat[s] == flat[s] else 0, s))
        kept = (got.reshape(-1) == 0).nonzero().reshape(-1).tolist()
        assert kept == sorted(best[:capacity]) and torch.equal(got, want)
