"""The one-pass relayout kernel against its reference (CUDA, or the Triton interpreter)."""

import pytest
import torch

from grouped_linear.kernels import layout
from grouped_linear.kernels._triton import HAS_TRITON, use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _ends(sizes):
    return torch.tensor(sizes, device=DEVICE).cumsum(0)


@pytest.mark.parametrize("src_sizes, dst_sizes, dst_rows", [
    ([3, 0, 17, 1], [16, 0, 32, 16], 64),     # pad to 16
    ([16, 0, 32, 16], [3, 0, 17, 1], 21),     # unpad
    ([5, 5], [8, 8], 30),                     # destination tail past the last group
    ([0, 0, 0], [0, 0, 0], 4),                # nothing to copy: zeros
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relayout_matches_reference(src_sizes, dst_sizes, dst_rows, dtype):
    src = torch.randn(max(sum(src_sizes), 1), 300, device=DEVICE).to(dtype)
    assert use_triton(src)
    got = layout.relayout(src, _ends(src_sizes), _ends(dst_sizes), dst_rows)
    want = layout.relayout_reference(src, _ends(src_sizes), _ends(dst_sizes), dst_rows)
    assert got.shape == (dst_rows, 300) and torch.equal(got, want)
    # spot-check the pairing itself: group 0's first row lands on destination row 0
    if src_sizes[0] and dst_sizes[0]:
        assert torch.equal(got[0], src[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_kernel(dtype):
    src = torch.randn(10, 300, device=DEVICE).to(dtype)
    index = torch.tensor([3, -1, 9, 10, 0, 3, -7], device=DEVICE)  # -1, 10, -7: zero rows
    assert use_triton(src)
    got = layout.gather_rows(src, index)
    assert torch.equal(got, layout.gather_rows_reference(src, index))
    assert torch.equal(got[0], src[3]) and torch.all(got[[1, 3, 6]] == 0)


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_kernel(with_weights, dtype):
    src = torch.randn(12, 300, device=DEVICE).to(dtype)
    row_map = torch.tensor([[0, 5, -1], [11, 2, 3], [-1, -1, -1], [7, 12, 1]], device=DEVICE)
    weights = torch.rand(4, 3, device=DEVICE) if with_weights else None
    got = layout.combine_rows(src, row_map, weights)
    want = layout.combine_rows_reference(src, row_map, weights)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tol)
    assert torch.all(got[2] == 0)  # every slot dropped
    exact = src[0].double() * (weights[0, 0].double() if with_weights else 1) + src[5].double() * (
        weights[0, 1].double() if with_weights else 1)
    torch.testing.assert_close(got[0].double(), exact, **tol)


# --------------------------------------------------------------------------- routing map

def _routing(gen, tokens, k, experts, drop=0.2, used=None):
    """Random ``(tokens, k)`` expert choice, ``drop`` of the slots -1; experts from ``used``."""
    pool = torch.tensor(used if used is not None else range(experts))
    topk = pool[torch.randint(0, len(pool), (tokens, k), generator=gen)]
    return topk.masked_fill(torch.rand(tokens, k, generator=gen) < drop, -1)


def _check_routing(topk, experts, multiple, max_programs=None, extra_rows=0):
    topk = topk.to(DEVICE)
    num_rows = topk.numel() + experts * (multiple - 1) + extra_rows  # the CUDA upper bound
    got = layout.routing_map(topk, experts, multiple, num_rows, max_programs=max_programs)
    want = layout.routing_map_reference(topk, experts, multiple, num_rows)
    for name, a, b in zip(("m_splits", "row_map", "token_of_row"), got, want, strict=True):
        assert a.dtype == torch.int64 and a.shape == b.shape, name
        assert torch.equal(a, b), name
    # and what they mean: every routed slot has its own row, which names its token
    m_splits, row_map, token_of_row = (t.cpu() for t in got)
    tokens, k = topk.shape
    routed = (topk >= 0) & (topk < experts)
    assert torch.equal(row_map < 0, ~routed.cpu())
    held = row_map[row_map >= 0]
    assert torch.equal(token_of_row[held], torch.arange(tokens).repeat_interleave(k)[
        routed.cpu().reshape(-1)])
    assert int((token_of_row >= 0).sum()) == held.numel() and bool((m_splits % multiple == 0).all())
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
    m_splits, row_map, token_of_row = _check_routing(topk, 3, 2)
    assert m_splits.tolist() == [2, 2, 2]
    assert row_map.tolist() == [[0, -1], [-1, 4], [5, -1], [2, -1]]
    assert token_of_row.tolist()[:8] == [0, -1, 3, -1, 1, 2, -1, -1]


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
    try:  # one program per SM, a grid barrier between the phases, and no host sync
        got = layout.routing_map(topk.to(torch.int32), experts, multiple, num_rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = layout.routing_map_reference(topk, experts, multiple, num_rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("k, weighted", [(1, False), (2, True), (8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spread_rows_against_reference(k, weighted, dtype):
    tokens, H, padding = 37, 40, 13
    num_rows = tokens * k + padding
    gen = torch.Generator().manual_seed(k)
    row_map = torch.randperm(num_rows, generator=gen)[: tokens * k].view(tokens, k)
    row_map[3, 0] = -1  # a dropped slot
    if k > 1:
        row_map[5, 1] = num_rows + 4  # outside: dropped too
    src = torch.randn(tokens, H, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE) if weighted else None
    row_map = row_map.to(DEVICE)
    got = layout.spread_rows(src, row_map, num_rows, weights)
    want = layout.spread_rows_reference(src, row_map, num_rows, weights)
    assert got.dtype == dtype and got.shape == (num_rows, H)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    held = row_map[(row_map >= 0) & (row_map < num_rows)]
    unheld = torch.ones(num_rows, dtype=torch.bool, device=DEVICE)
    unheld[held] = False
    assert torch.all(got[unheld] == 0)


@pytest.mark.parametrize("k, multiple, experts", [(1, 1, 4), (2, 16, 5), (8, 128, 16), (3, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_rows_equals_gather_by_token(k, multiple, experts, dtype):
    """The permute layout written source-row by source-row (each read once) equals the
    gather by each row's token, padding and dropped slots included."""
    tokens, H = 45, 300
    gen = torch.Generator().manual_seed(k * 100 + multiple)
    topk = torch.stack([torch.randperm(max(experts, k), generator=gen)[:k] % experts
                        for _ in range(tokens)])
    topk[2, 0] = -1  # a dropped slot
    topk = topk.to(DEVICE)
    num_rows = tokens * k + experts * (multiple - 1) + 7  # an upper bound with a tail
    _, row_map, token_of_row = layout.routing_map_reference(topk, experts, multiple, num_rows)
    src = torch.randn(tokens, H, generator=gen).to(DEVICE, dtype)
    got = layout.scatter_rows(src, row_map, token_of_row)
    assert got.shape == (num_rows, H)
    assert torch.equal(got, layout.gather_rows_reference(src, token_of_row))
    assert torch.all(got[token_of_row.cpu() < 0] == 0)
