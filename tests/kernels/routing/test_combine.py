"""The k-way combine of routed rows and its weights' gradient dots against their references
(CUDA, or the Triton interpreter), with and without the rows kept as FP8 tiles."""

import pytest
import torch

from grouped_linear.kernels._triton import HAS_TRITON
from grouped_linear.kernels.quantize import blocks as qb
from grouped_linear.kernels.routing import combine
from tests.reference import codes_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_kernel(with_weights, dtype):
    src = torch.randn(12, 300, device=DEVICE).to(dtype)
    row_map = torch.tensor([[0, 5, -1], [11, 2, 3], [-1, -1, -1], [7, 12, 1]], device=DEVICE)
    weights = torch.rand(4, 3, device=DEVICE) if with_weights else None
    got = combine.combine_rows(src, row_map, weights)
    want = combine.combine_rows_reference(src, row_map, weights)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tol)
    assert torch.all(got[2] == 0)  # every slot dropped
    exact = src[0].double() * (weights[0, 0].double() if with_weights else 1) + src[5].double() * (
        weights[0, 1].double() if with_weights else 1)
    torch.testing.assert_close(got[0].double(), exact, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, k, H", [(37, 1, 48), (20, 3, 300), (9, 8, 5), (5, 2, 2100)])
def test_slot_dots_match_the_reference(tokens, k, H, dtype):
    """Per slot, its row dotted with the token's gradient row: dropped slots (-1) and rows
    past the source give 0; several column steps and tokens blocks."""
    gen = torch.Generator().manual_seed(tokens * k)
    rows = tokens * k + 3
    src = torch.randn(rows, H, generator=gen).to(dtype).to(DEVICE)
    grad = torch.randn(tokens, H, generator=gen).to(dtype).to(DEVICE)
    row_map = torch.randperm(rows, generator=gen)[:tokens * k].view(tokens, k)
    row_map[0, 0] = -1  # a dropped slot
    if k > 1:
        row_map[-1, 1] = rows + 5  # outside the source: counts as dropped
    row_map = row_map.to(DEVICE)
    got = combine.slot_dots(src, grad, row_map, config=(4, 64, 4))
    want = combine.slot_dots_reference(src, grad, row_map, torch.float32)
    exact = torch.zeros(tokens, k, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            r = int(row_map[t, j])
            if 0 <= r < rows:
                exact[t, j] = (src[r].double() * grad[t].double()).sum()
    assert got.shape == (tokens, k) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.double().cpu(), exact, rtol=1e-4, atol=1e-3)
    assert got[0, 0] == 0


@pytest.mark.parametrize("H", [300, 256, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_keeping_fp8_writes_the_held_rows_as_row_tiles(H, dtype):
    """The combine is unchanged; each row a slot holds comes back as the 128-column tile
    quantization of the plain reference (rows no slot holds are not read afterwards and not
    checked); the kept rows' slot dots equal those of their dequantized values."""
    gen = torch.Generator().manual_seed(H)
    src = (torch.randn(13, H, generator=gen) * torch.logspace(-3, 3, 13).unsqueeze(1))
    src = src.to(dtype).to(DEVICE)
    src[4, :7] = 0  # an all-zero tile start, and a zero row below
    src[9] = 0
    row_map = torch.tensor([[0, 5, -1], [11, 2, 3], [-1, -1, -1], [7, 9, 1], [4, 12, 6]],
                           device=DEVICE)
    weights = torch.rand(5, 3, generator=gen).to(DEVICE)
    out, codes, factors = combine.combine_rows_keeping_fp8(src, row_map, weights,
                                                          torch.float8_e4m3fn)
    assert torch.equal(out, combine.combine_rows(src, row_map, weights))
    want_codes, want_factors = qb.quantize_row_tiles_reference(src, torch.float8_e4m3fn, False)
    held = row_map[row_map >= 0].cpu()
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == src.shape
    assert codes_close(codes[held].cpu(), want_codes[held].cpu())
    torch.testing.assert_close(factors[held].cpu(), want_factors[held].cpu(), rtol=1e-6, atol=0)
    grad = torch.randn(5, H, generator=gen).to(dtype).to(DEVICE)
    got = combine.slot_dots(codes, grad, row_map, factors=factors, config=(4, 64, 4))
    dequantized = qb.dequantize_row_tiles(codes.cpu(), factors.cpu())
    want = combine.slot_dots_reference(dequantized.to(DEVICE), grad, row_map, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each kept value within half an E4M3 step (2^-4 relative) of the exact one
    exact = combine.slot_dots_reference(src, grad, row_map, torch.float64)
    bound = combine.slot_dots_reference(src.abs(), grad.abs(), row_map, torch.float64) / 16
    assert ((got.double() - exact).abs() <= bound * (1 + 1e-3) + 1e-6).all()


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_combine_reference_rounds_once(with_weights, dtype):
    """The plain-PyTorch combine (the CPU path) gives the float64 sums rounded once to the
    rows' dtype: exact in float64, no intermediate rounding in 16-bit dtypes."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(40, 24, generator=gen).to(dtype)
    row_map = torch.randperm(40, generator=gen)[:36].view(12, 3)
    row_map[0, 1], row_map[5, 2] = -1, 40  # dropped, and outside the source
    weights = torch.rand(12, 3, generator=gen, dtype=torch.float64) if with_weights else None
    exact = torch.zeros(12, 24, dtype=torch.float64)
    for t in range(12):
        for j in range(3):
            r = int(row_map[t, j])
            if 0 <= r < 40:
                exact[t] += src[r].double() * (float(weights[t, j]) if with_weights else 1.0)
    got = combine.combine_rows_reference(src, row_map, weights)
    assert got.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(got, exact, rtol=1e-14, atol=1e-14)
    elif dtype == torch.bfloat16 and not with_weights:
        # float32 sums of three bf16 values are exact here: one rounding, to bf16
        torch.testing.assert_close(got, exact.to(dtype), rtol=0, atol=0)
    elif dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=1e-6)
