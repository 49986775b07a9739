"""The row-moving layout kernels against their references (CUDA, or the Triton interpreter)."""

import pytest
import torch

from grouped_linear.kernels._triton import HAS_TRITON, use_triton
from grouped_linear.kernels.routing import combine
from grouped_linear.kernels.routing import routing_map as routing
from grouped_linear.kernels.routing import rows as layout
from grouped_linear.kernels.routing.relayout import relayout, relayout_reference

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
    got = relayout(src, _ends(src_sizes), _ends(dst_sizes), dst_rows)
    want = relayout_reference(src, _ends(src_sizes), _ends(dst_sizes), dst_rows)
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


def test_spread_rows_ignores_stale_slot_entries(monkeypatch):
    """The inverse slot map is not filled before the slots are written: whatever an unheld
    row's entry holds (a stale slot of another row, a negative or out-of-range number), the
    row comes out zero, and held rows are unaffected."""
    tokens, k, H, padding = 20, 3, 24, 9
    num_rows = tokens * k + padding
    gen = torch.Generator().manual_seed(7)
    row_map = torch.randperm(num_rows, generator=gen)[: tokens * k].view(tokens, k).to(DEVICE)
    src = torch.randn(tokens, H, generator=gen).to(DEVICE)
    stale = torch.randint(-3, tokens * k + 3, (num_rows,), generator=gen).to(DEVICE)
    original_empty = torch.empty

    def stale_empty(*size, **kwargs):
        out = original_empty(*size, **kwargs)
        if out.dtype == torch.int64 and out.shape == (num_rows,):
            out.copy_(stale)
        return out

    monkeypatch.setattr(layout.torch, "empty", stale_empty)
    got = layout.spread_rows(src, row_map, num_rows, None)
    monkeypatch.undo()
    want = layout.spread_rows_reference(src, row_map, num_rows, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("k, multiple, experts", [(1, 1, 4), (2, 16, 5), (8, 128, 16), (3, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("located", [False, True])
def test_scatter_rows_equals_gather_by_token(k, multiple, experts, dtype, located, monkeypatch):
    """The permute layout written source-row by source-row (each read once) equals the
    gather by each row's token, padding and dropped slots included; the rows no slot holds
    found by scanning the row tokens, or (``located``) from the group sizes. The output
    buffer starts as NaN, so a row left unwritten shows."""
    tokens, H = 45, 300
    gen = torch.Generator().manual_seed(k * 100 + multiple)
    topk = torch.stack([torch.randperm(max(experts, k), generator=gen)[:k] % experts
                        for _ in range(tokens)])
    topk[2, 0] = -1  # a dropped slot
    topk = topk.to(DEVICE)
    num_rows = tokens * k + experts * (multiple - 1) + 7  # an upper bound with a tail
    m_splits, row_map, token_of_row, counts = routing.routing_map_reference(
        topk, experts, multiple, num_rows)
    src = torch.randn(tokens, H, generator=gen).to(DEVICE, dtype)
    original_empty = torch.empty
    monkeypatch.setattr(layout.torch, "empty",
                        lambda *size, **kwargs: original_empty(*size, **kwargs).fill_(float("nan"))
                        if kwargs.get("dtype") == dtype else original_empty(*size, **kwargs))
    got = layout.scatter_rows(src, row_map, token_of_row,
                              (m_splits, counts) if located else None)
    monkeypatch.undo()
    assert got.shape == (num_rows, H)
    assert torch.equal(got, layout.gather_rows_reference(src, token_of_row))
    assert torch.all(got[token_of_row.cpu() < 0] == 0)



@pytest.mark.parametrize("config", [(4, 64, 2), (32, 512, 8)])
@pytest.mark.parametrize("located", [False, True])
def test_row_kernels_launch_shapes_agree(config, located):
    """``config=`` (rows per program, columns per program, warps) other than the default:
    scatter_rows, spread_rows and combine_rows give the same rows."""
    tokens, k, experts, multiple, H = 45, 3, 5, 16, 300
    gen = torch.Generator().manual_seed(11)
    topk = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    topk[2, 0] = -1  # a dropped slot
    num_rows = tokens * k + experts * (multiple - 1) + 7
    m_splits, row_map, token_of_row, counts = routing.routing_map_reference(
        topk.to(DEVICE), experts, multiple, num_rows)
    src = torch.randn(tokens, H, generator=gen).to(DEVICE, torch.bfloat16)
    routed = torch.randn(num_rows, H, generator=gen).to(DEVICE, torch.bfloat16)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE)
    groups = (m_splits, counts) if located else None
    assert torch.equal(layout.scatter_rows(src, row_map, token_of_row, groups, config=config),
                       layout.scatter_rows(src, row_map, token_of_row, groups))
    assert torch.equal(layout.spread_rows(src, row_map, num_rows, weights, config=config),
                       layout.spread_rows(src, row_map, num_rows, weights))
    assert torch.equal(combine.combine_rows(routed, row_map, weights, config=config),
                       combine.combine_rows(routed, row_map, weights))


@pytest.mark.parametrize("experts", [layout.SPARSE_SLOTS, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_map_slots_take_the_sparse_path(experts, dtype):
    """A routing map's slots (E per token, a few used; one token with none, one with all):
    the scatter, the weighted spread and the combine skip the unused ones and equal their
    references."""
    tokens, H = 19, 200
    assert layout.sparse_slots(experts)
    gen = torch.Generator().manual_seed(experts)
    chosen = torch.rand(tokens, experts, generator=gen) < 4 / experts
    chosen[4] = False
    chosen[7] = True
    slots = torch.where(chosen, torch.arange(experts), -1).to(DEVICE)
    m_splits, row_map, token_of_row, counts = routing.routing_map_reference(
        slots, experts, 1, tokens * experts)
    src = torch.randn(tokens, H, generator=gen).to(DEVICE, dtype)
    got = layout.scatter_rows(src, row_map, token_of_row, (m_splits, counts))
    assert torch.equal(got, layout.gather_rows_reference(src, token_of_row))
    weights = torch.rand(tokens, experts, generator=gen).to(DEVICE)
    num_rows = int(counts.sum())
    spread = layout.spread_rows(src, row_map, num_rows, weights)
    torch.testing.assert_close(spread, layout.spread_rows_reference(src, row_map, num_rows,
                                                                    weights), rtol=0, atol=0)
    for w in (None, weights):
        back = combine.combine_rows(got, row_map, w)
        torch.testing.assert_close(back, combine.combine_rows_reference(got, row_map, w),
                                   rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-5)
    assert torch.all(combine.combine_rows(got, row_map, None)[4] == 0)
