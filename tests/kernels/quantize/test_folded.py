"""The folded rows quantization (Float8Rowwise's dgrad operand) against its reference."""

import pytest
import torch

from grouped_linear.kernels.quantize import folded as qf
from tests.reference import codes_close, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("sizes, tail", [([5, 0, 9], 2), ([1], 0), ([0, 7, 3, 0], 4),
                                         ([40, 3, 0, 50], 5),
                                         ([(g * 7) % 5 for g in range(300)], 3)])
def test_rows_with_column_factors(sizes, tail, pow2):
    """Rows times their group's column factors, quantized per row: the kernel against the
    reference, and the dequantized result against the float64 product."""
    C = 70
    M = sum(sizes) + tail
    t = (torch.randn(M, C) * 3).to(torch.bfloat16).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    factors = (torch.rand(len(sizes), C) * torch.logspace(-3, 3, C)).to(DEVICE)
    column_factors = qf.ColumnFactors.of_groups(factors, offsets, M)
    data, inv = qf.quantize_rows_folded(t, column_factors, E4M3, pow2)
    ref_data, ref_inv = qf.quantize_rows_folded_reference(t, column_factors, E4M3, pow2)
    assert torch.allclose(inv, ref_inv, rtol=1e-6) and codes_close(data, ref_data)
    groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    groups = torch.cat([groups, torch.full((tail,), len(sizes) - 1)]).to(DEVICE)
    want = t.double() * factors.double()[groups]
    assert rel_err(data.double() * inv.double()[:, None], want) < 0.04
    with pytest.raises(ValueError, match="do not fit"):
        qf.quantize_rows_folded(t[:, :-1], column_factors, E4M3, pow2)
    with pytest.raises(ValueError, match="num_rows"):
        qf.quantize_rows_folded(t[:-1], column_factors, E4M3, pow2)
    with pytest.raises(ValueError, match="ends has shape"):
        qf.quantize_rows_folded(t, qf.ColumnFactors(column_factors.factors, offsets[:-1], M),
                                E4M3, pow2)


@pytest.mark.parametrize("pow2", [False, True])
def test_rows_wider_than_one_block(monkeypatch, pow2):
    """Rows past ``MAX_BLOCK_C`` columns are read in blocks, twice, by the kernel (no
    fallback): codes and factors as the reference's (small sizes, the limits lowered)."""
    monkeypatch.setattr(qf, "MAX_BLOCK_C", 64)
    monkeypatch.setattr(qf, "WIDE_BLOCK_C", 32)
    sizes, tail, C = [5, 0, 20, 3], 3, 150
    M = sum(sizes) + tail
    t = (torch.randn(M, C) * torch.logspace(-2, 2, C)).to(torch.bfloat16).to(DEVICE)
    ends = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    factors = (torch.rand(len(sizes), C) + 0.5).to(DEVICE)
    column_factors = qf.ColumnFactors.of_groups(factors, ends, M)
    ref_data, ref_inv = qf.quantize_rows_folded_reference(t, column_factors, E4M3, pow2)
    monkeypatch.setattr(qf, "quantize_rows_folded_reference", None)  # the kernel must run
    data, inv = qf.quantize_rows_folded(t, column_factors, E4M3, pow2)
    assert torch.allclose(inv, ref_inv, rtol=1e-6) and codes_close(data, ref_data)


def test_scale_columns_matches_its_reference():
    """Rows times their group's column scales, saturated to FP8 (no per-row scale): the
    kernel against the reference and the dequantized codes against the float64 product."""
    G, K, N = 3, 40, 70
    t = (torch.randn(G * K, N) * 3).to(torch.bfloat16).to(DEVICE)
    scale = (torch.rand(G, N) * 200).to(DEVICE)
    data = qf.scale_columns(t, scale, K, E4M3)
    ref = qf.scale_columns_reference(t, scale, K, E4M3)
    assert data.dtype == E4M3 and codes_close(data, ref)
    want = t.double() * scale.double().repeat_interleave(K, dim=0)
    fp8_max = torch.finfo(E4M3).max
    assert rel_err(data.double(), want.clamp(-fp8_max, fp8_max)) < 0.04
