"""The routing-map kernel against its reference (CUDA, or the Triton interpreter)."""

import pytest
import torch

from grouped_linear.kernels._triton import HAS_TRITON
from grouped_linear.kernels.routing import routing_map as routing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _routing(gen, tokens, k, experts, drop=0.2, used=None):
    """Random ``(tokens, k)`` expert choice, ``drop`` of the slots -1; experts from ``used``."""
    pool = torch.tensor(used if used is not None else range(experts))
    topk = pool[torch.randint(0, len(pool), (tokens, k), generator=gen)]
    return topk.masked_fill(torch.rand(tokens, k, generator=gen) < drop, -1)


def _check_routing(topk, experts, multiple, max_programs=None, extra_rows=0):
    topk = topk.to(DEVICE)
    num_rows = topk.numel() + experts * (multiple - 1) + extra_rows  # the CUDA upper bound
    got = routing.routing_map(topk, experts, multiple, num_rows, max_programs=max_programs)
    want = routing.routing_map_reference(topk, experts, multiple, num_rows)
    for name, a, b in zip(("m_splits", "row_map", "token_of_row", "counts"), got, want,
                          strict=True):
        assert a.dtype == torch.int64 and a.shape == b.shape, name
        assert torch.equal(a, b), name
    # and what they mean: every routed slot has its own row, which names its token
    m_splits, row_map, token_of_row, counts = (t.cpu() for t in got)
    tokens, k = topk.shape
    routed = (topk >= 0) & (topk < experts)
    assert torch.equal(row_map < 0, ~routed.cpu())
    held = row_map[row_map >= 0]
    assert torch.equal(token_of_row[held], torch.arange(tokens).repeat_interleave(k)[
        routed.cpu().reshape(-1)])
    assert int((token_of_row >= 0).sum()) == held.numel() and bool((m_splits % multiple == 0).all())
    assert torch.equal(counts, torch.bincount(topk[routed].cpu(), minlength=experts))
    assert bool((counts <= m_splits).all()) and bool((m_splits - counts < multiple).all())
    return got


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("multiple", [1, 16, 128])
def test_routing_map_matches_reference(k, multiple):
    gen = torch.Generator().manual_seed(10 * k + multiple)
    # 300 tokens over 3 programs: several blocks of slots per program, the last one partial
    _check_routing(_routing(gen, 300, k, 16), 16, multiple, max_programs=3)
    # 13 experts (not a power of two), five of them empty
    _check_routing(_routing(gen, 97, k, 13, drop=0.4, used=[0, 2, 3, 5, 7, 8, 11, 12]), 13,
                   multiple, max_programs=5)


@pytest.mark.parametrize("experts, k, multiple", [(40, 8, 16), (100, 3, 1), (300, 2, 128), (33, 6, 4)])
def test_routing_map_many_experts(experts, k, multiple):
    # past 32 experts ranks come from comparing the slots of a block pairwise
    gen = torch.Generator().manual_seed(experts + k)
    _check_routing(_routing(gen, 150, k, experts), experts, multiple, max_programs=3)
    # few experts in use: long runs of one expert inside a block, and many empty groups
    used = [0, experts // 2, experts - 1]
    _check_routing(_routing(gen, 120, k, experts, used=used), experts, multiple, max_programs=2)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_routing_map_index_dtypes(dtype):
    gen = torch.Generator().manual_seed(1)
    topk = _routing(gen, 50, 4, 6, drop=0.0 if dtype == torch.uint8 else 0.2)
    _check_routing(topk.to(dtype), 6, 4, max_programs=2)


def test_routing_map_edge_cases():
    gen = torch.Generator().manual_seed(2)
    _check_routing(torch.zeros(0, 4, dtype=torch.int64), 5, 8)  # no tokens: all rows unused
    _check_routing(torch.zeros(0, 4, dtype=torch.int64), 5, 1)  # nothing at all
    _check_routing(torch.full((9, 3), -1), 4, 16, max_programs=2)  # everything dropped
    _check_routing(torch.zeros(20, 2, dtype=torch.int32), 1, 1)  # one expert, no padding
    _check_routing(_routing(gen, 40, 3, 7), 7, 5, max_programs=1)  # one program, one launch
    _check_routing(_routing(gen, 40, 3, 7), 7, 3, extra_rows=10)  # more rows than the bound
    # out-of-range experts are dropped like -1, whatever their size
    topk = torch.tensor([[0, 9], [-7, 2], [2, 2**40], [1, -1]])
    m_splits, row_map, token_of_row, counts = _check_routing(topk, 3, 2)
    assert m_splits.tolist() == [2, 2, 2] and counts.tolist() == [1, 1, 2]
    assert row_map.tolist() == [[0, -1], [-1, 4], [5, -1], [2, -1]]
    assert token_of_row.tolist()[:8] == [0, -1, 3, -1, 1, 2, -1, -1]


@pytest.mark.parametrize("tokens, k, experts", [(0, 2, 4), (1, 1, 1), (60, 4, 8), (33, 8, 64)])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_reference_takes_a_shortcut_where_nothing_is_padded_or_capped(tokens, k, experts, drop):
    """Every slot kept and no padding (the common call): the reference's shortcut gives what
    its general computation gives (reached here through a capacity no expert can fill)."""
    gen = torch.Generator().manual_seed(tokens + k)
    topk = _routing(gen, tokens, k, experts, drop=drop)
    for num_rows in (None, topk.numel()):
        short = routing.routing_map_reference(topk, experts, 1, num_rows)
        general = routing.routing_map_reference(topk, experts, 1, num_rows,
                                                capacity=topk.numel() + 1)
        for name, a, b in zip(("m_splits", "row_map", "token_of_row", "counts"), short,
                              general, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_routing_map_many_experts_falls_back():
    gen = torch.Generator().manual_seed(3)
    topk = _routing(gen, 12, 2, 1500)
    _check_routing(topk, 1500, 2)  # past the kernel's expert limit: the reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens, k, experts, multiple", [
    (8192, 8, 256, 128), (32768, 8, 64, 1), (4096, 6, 1000, 16), (100000, 2, 8, 1), (3, 2, 5, 4)])
def test_routing_map_cuda_large(tokens, k, experts, multiple):
    gen = torch.Generator().manual_seed(tokens)
    topk = _routing(gen, tokens, k, experts, drop=0.05).cuda()
    num_rows = topk.numel() + experts * (multiple - 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # one program per SM, two launches (counts, then places), and no host sync
        got = routing.routing_map(topk.to(torch.int32), experts, multiple, num_rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = routing.routing_map_reference(topk, experts, multiple, num_rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("experts, multiple, programs", [(6, 1, 3), (40, 16, 4), (300, 4, 2),
                                                         (64, 1, 1)])
@pytest.mark.parametrize("limits", [{}, {"capacity": 3}, {"keep": 50},
                                    {"capacity": 4, "keep": 30}])
def test_routing_map_reads_a_bool_map(experts, multiple, programs, limits):
    """A ``(T, E)`` bool map: the same layout as its slots given as expert indices (``e``
    where set, -1 elsewhere), over several chunks of tokens, with every limit."""
    gen = torch.Generator().manual_seed(experts + multiple)
    tokens = 150
    chosen = torch.rand(tokens, experts, generator=gen) < 3 / experts
    chosen[5] = True  # a token routed to every expert
    chosen[:, 1] = False  # an expert nobody chose
    chosen = chosen.to(DEVICE)
    slots = torch.where(chosen, torch.arange(experts, device=DEVICE), -1)
    num_rows = tokens * experts + experts * (multiple - 1)
    got = routing.routing_map(chosen, experts, multiple, num_rows, max_programs=programs,
                              **limits)
    for a, b in zip(got, _check_routing(slots, experts, multiple, max_programs=programs)
                    if not limits else routing.routing_map_reference(
                        slots, experts, multiple, num_rows, **limits), strict=True):
        assert torch.equal(a, b)
    want = routing.routing_map_reference(chosen, experts, multiple, num_rows, **limits)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens, experts, multiple", [(8192, 64, 1), (4096, 256, 16), (3, 5, 4)])
def test_routing_map_cuda_bool_map(tokens, experts, multiple):
    gen = torch.Generator().manual_seed(tokens)
    chosen = (torch.rand(tokens, experts, generator=gen) < 8 / experts).cuda()
    num_rows = tokens * 8 + experts * (multiple - 1)  # num_out_tokens' bound
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = routing.routing_map(chosen, experts, multiple, num_rows, keep=tokens * 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = routing.routing_map_reference(chosen, experts, multiple, num_rows, keep=tokens * 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
