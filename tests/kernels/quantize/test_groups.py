"""Tensorwise group scales (one pass, atomic maxima) and rows quantized with a scale per
group, against their plain-PyTorch references."""

import pytest
import torch

from grouped_linear.kernels.quantize import common as qc
from grouped_linear.kernels.quantize import groups as qg
from grouped_linear.kernels.quantize import rows as q
from tests.reference import codes_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def _offsets(sizes):
    return torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("sizes, tail", [([5, 0, 9], 2), ([1], 0), ([0, 0], 3), ([40, 3, 0, 50], 5),
                                         ([(g * 7) % 5 for g in range(300)], 4)])
def test_group_amax_scales_match_the_reference(sizes, tail, pow2):
    """Groups inside one program's rows, spanning several programs, empty, and more groups
    than one block of group ends; rows past the last group count for none."""
    C = 70
    M = sum(sizes) + tail
    scales = torch.logspace(-3, 3, len(sizes)).repeat_interleave(torch.tensor(sizes))
    t = torch.randn(M, C)
    t[:sum(sizes)] *= scales[:, None]
    t[sum(sizes):] = 1e6  # the tail: must not count
    t = t.to(torch.bfloat16).to(DEVICE)
    offsets = _offsets(sizes)
    got = qg.group_amax_scales(t, offsets, E4M3, pow2, config=(8, 32, 4))  # column blocks
    want = qg.group_amax_scales_reference(t, offsets, E4M3, pow2)
    assert got.shape == (len(sizes),) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # the division may round apart
    # and against maxima taken group by group, in float64
    start, amax = 0, []
    for size in sizes:
        block = t[start:start + size].double()
        amax.append(block.abs().max().item() if size else 0.0)
        start += size
    exact = qc.scale_from_amax(torch.tensor(amax, dtype=torch.float64), E4M3, pow2)
    torch.testing.assert_close(got.cpu(), exact, rtol=1e-6, atol=0)
    assert torch.all(got[torch.tensor(sizes, device=DEVICE) == 0] == 1)  # empty groups: 1


@pytest.mark.parametrize("inv_width", [0, 40, 300])
def test_weight_group_scales_and_spread_factors(inv_width):
    G, N, K = 3, 24, 40
    w = (torch.randn(G, N, K) * torch.logspace(-2, 2, K)).to(DEVICE)
    w[1] = 0  # an all-zero expert: scale 1
    scale, inv = qg.weight_group_scales(w, E4M3, False, inv_width=inv_width)
    want = qg.weight_group_scales_reference(w, E4M3, False)
    torch.testing.assert_close(scale, want, rtol=1e-6, atol=0)
    assert scale[1] == 1
    if inv_width:
        assert inv.shape == (G, inv_width)
        torch.testing.assert_close(inv, (1 / want)[:, None].expand(G, inv_width))
    else:
        assert inv is None
    # a non-contiguous weight takes the reference, same values
    strided = w.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(qg.weight_group_scales(strided, E4M3, False)[0], want)


@pytest.mark.parametrize("sizes, tail", [([5, 0, 9], 2), ([0, 7, 3, 0], 0), ([33] * 9, 1)])
def test_rows_with_group_scales(sizes, tail):
    """``quantize_rows`` with a scale per group (by row ends, or every ``group_rows`` rows)
    equals it with those scales spread onto the rows; rows past the last end take the
    last group's scale."""
    C = 48
    M = sum(sizes) + tail
    t = (torch.randn(M, C) * 20).to(torch.bfloat16).to(DEVICE)
    offsets = _offsets(sizes)
    group_scale = torch.rand(len(sizes), device=DEVICE) * 8 + 0.25
    groups = torch.bucketize(torch.arange(M, device=DEVICE), offsets.long(), right=True)
    per_row = group_scale[groups.clamp(max=len(sizes) - 1)]
    data, inv = q.quantize_rows(t, E4M3, False, group_scale, ends=offsets)
    want_data, want_inv = q.quantize_rows_reference(t, E4M3, False, per_row)
    torch.testing.assert_close(inv, want_inv)
    assert codes_close(data, want_data)
    rows = 11
    uniform = (torch.randn(4 * rows, C) * 20).to(DEVICE)
    data, inv = q.quantize_rows(uniform, E4M3, False, group_scale[:1].repeat(4) * torch.arange(
        1, 5, device=DEVICE), group_rows=rows)
    scale = (group_scale[:1] * torch.arange(1, 5, device=DEVICE)).repeat_interleave(rows)
    want_data, want_inv = q.quantize_rows_reference(uniform, E4M3, False, scale)
    torch.testing.assert_close(inv, want_inv)
    assert codes_close(data, want_data)
