"""The fused-quantization FP8 GEMMs against the recipes' quantize -> dequantize references
(kernels/quantize/emulate.py) multiplied in float32, group by group."""

import pytest
import torch

from grouped_linear.kernels._triton import tl, triton
from grouped_linear.kernels.gemm import fp8_fused_gemm as ff
from grouped_linear.kernels.gemm.fp8_fused_gemm import _round_fp8
from grouped_linear.kernels.quantize import emulate, rows, transposed
from grouped_linear.kernels.quantize.common import saturate, scale_from_amax
from grouped_linear.kernels.quantize.emulate import dequantize_codes
from grouped_linear.kernels.quantize.folded import ColumnFactors
from grouped_linear.kernels.quantize.groups import group_amax_scales_reference
from grouped_linear.ops.fp8.primary import quantize_weight_codes
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES, TAIL = [5, 0, 150, 3], 7
G, K, N = len(SIZES), 200, 136
M = sum(SIZES) + TAIL
# Both sides multiply the same FP8 values (the kernels' scales are the host's, bit for bit)
# in float32: they differ by the order of the sums alone.
TOL = 1e-5
RECIPES = {"rowwise": (Float8Rowwise(), False), "tensorwise": (Float8Tensorwise(), False),
           "blockwise": (Float8Blockwise(), True)}


@triton.jit
def _round_kernel(v_ptr, s_ptr, out_ptr, n, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                  MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    values = tl.load(v_ptr + i, mask=mask, other=0.0)
    scale = tl.load(s_ptr + i, mask=mask, other=1.0)
    tl.store(out_ptr + i, _round_fp8(values, scale, FP8_MAX, MANT, MIN_EXP), mask=mask)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_rounding_is_the_casts(fp8):
    """Saturated, rounded to nearest with ties to even, subnormals included: bit for bit
    what torch's cast gives, for every value an FP8 code can take, the midpoints between
    neighbours (ties), values just off them, and random ones at every scale."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    nudged = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])
    rand = torch.randn(4096) * torch.exp2(torch.randint(-30, 30, (4096,)).float())
    values = torch.cat([codes, mids, nudged, rand, torch.tensor([1e30, -1e30, 0.0, -0.0])])
    scale = torch.where(torch.rand_like(values) < 0.5, 1.0, 3.0)
    values, scale = values.to(DEVICE), scale.to(DEVICE)
    out = torch.empty_like(values)
    mant, min_exp = ff._FORMATS[fp8]
    _round_kernel[(triton.cdiv(values.numel(), 1024),)](
        values, scale, out, values.numel(), FP8_MAX=torch.finfo(fp8).max, MANT=mant,
        MIN_EXP=min_exp, BLOCK=1024)
    want = saturate(values, scale, fp8).float()
    assert torch.equal(out, want)


def _ends():
    return torch.tensor(SIZES).cumsum(0).tolist()


def _per_group(fn, out):
    start = 0
    for g, end in enumerate(_ends()):
        fn(g, start, end, out)
        start = end
    return out


def _operands(blockwise, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).bfloat16().float()
    w = torch.randn(G, N, K, generator=gen) * 0.05
    dy = torch.randn(M, N, generator=gen).bfloat16().float()
    x[3] *= 1000  # rows of very different ranges
    dy[:, 7] *= 1e-3
    return x, w, dy


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["scales", "pow2"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_matches_the_recipe(name, power_of_two, bias, dtype):
    """In float32 to the reference's float32 products; in bf16 to its rounding."""
    recipe, blockwise = RECIPES[name]
    x, w, _ = _operands(blockwise)
    x = x.to(dtype)
    b = torch.randn(G, N).to(dtype) if bias else None
    codes, inv = quantize_weight_codes(w, recipe)
    sizes = torch.tensor(SIZES, device=DEVICE)
    ends = torch.tensor(_ends(), dtype=torch.int32)
    tensorwise = name == "tensorwise"
    group_scale = group_amax_scales_reference(x, ends, E4M3, power_of_two) if tensorwise \
        else None
    out, scale = ff.forward(x.to(DEVICE), codes.to(DEVICE), inv.to(DEVICE),
                            None if b is None else b.to(DEVICE), sizes, blockwise, E4M3,
                            power_of_two, save_scale=not blockwise,
                            group_scale=None if group_scale is None else group_scale.to(DEVICE))
    if tensorwise:
        xq = emulate.fake_quant_groups(x.float(), ends, E4M3, power_of_two)
    elif blockwise:
        xq = emulate.fake_quant_column_tiles(x, E4M3, power_of_two)
    else:
        xq = emulate.fake_quant_rows(x, E4M3, power_of_two)
    wq = dequantize_codes(codes, inv, torch.float32)

    def group(g, s, e, o):
        o[s:e] = xq[s:e] @ wq[g].T + (b[g].float() if b is not None else 0)

    want = _per_group(group, torch.zeros(M, N))
    assert out.dtype == dtype
    assert rel_err(out.float().cpu(), want) < (TOL if dtype == torch.float32 else 1e-2)
    assert torch.all(out[sum(SIZES):] == 0)
    if tensorwise:  # each row's saved scale is its group's
        rows = torch.repeat_interleave(group_scale, torch.tensor(SIZES))
        assert torch.equal(scale[:sum(SIZES)].cpu(), rows)
    elif not blockwise:
        host = scale_from_amax(x.float().abs().amax(dim=1), E4M3, power_of_two)
        assert torch.equal(scale[:sum(SIZES)].cpu(), host[:sum(SIZES)])


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_dgrad_matches_the_recipe(name, fp8):
    """Rowwise: ``dy`` times the weight's channel factors, per row, against the codes;
    tensorwise: ``dy`` per group; blockwise: ``dy`` per 1x128 tile against the dequantized
    blocks."""
    recipe, blockwise = RECIPES[name]
    _, w, dy = _operands(blockwise, seed=1)
    codes, inv = quantize_weight_codes(w, recipe)
    sizes = torch.tensor(SIZES, device=DEVICE)
    ends = torch.tensor(_ends(), dtype=torch.int32)
    group_scale = group_amax_scales_reference(dy, ends, fp8, False) \
        if name == "tensorwise" else None
    dx = ff.dgrad(dy.to(DEVICE), codes.to(DEVICE), inv.to(DEVICE), sizes, blockwise, fp8, False,
                  None if group_scale is None else group_scale.to(DEVICE))
    if name == "tensorwise":  # dy per group against the weight per expert
        dyq = emulate.fake_quant_groups(dy, ends, fp8, False)
        wq = dequantize_codes(codes, inv, torch.float32)
    elif blockwise:
        dyq = emulate.fake_quant_column_tiles(dy, fp8, False)
        wq = dequantize_codes(codes, inv, torch.float32)
    else:
        dyq = emulate.fake_quant_rows(ColumnFactors.of_groups(inv, ends, M).apply(dy), fp8,
                                      False)
        wq = codes.float()
    want = _per_group(lambda g, s, e, o: o.__setitem__(slice(s, e), dyq[s:e] @ wq[g]),
                      torch.zeros(M, K))
    assert rel_err(dx.float().cpu(), want) < TOL
    assert torch.all(dx[sum(SIZES):] == 0)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_matches_the_recipe(name, out_dtype):
    """Rowwise and tensorwise: ``dy`` times ``x``'s row (group) factors per (group, column)
    against ``x``'s forward codes; blockwise: both per column in 128-row blocks from each
    group's start. The bias sums are ``dy``'s per group; the empty group's gradient is
    zero."""
    recipe, blockwise = RECIPES[name]
    x, w, dy = _operands(blockwise, seed=2)
    codes, inv = quantize_weight_codes(w, recipe)
    sizes = torch.tensor(SIZES, device=DEVICE)
    ends = torch.tensor(_ends(), dtype=torch.int32)
    x_d, dy_d = x.to(DEVICE), dy.to(DEVICE)
    group_scale = group_amax_scales_reference(x, ends, E4M3, False) \
        if name == "tensorwise" else None
    _, scale = ff.forward(x_d, codes.to(DEVICE), inv.to(DEVICE), None, sizes, blockwise, E4M3,
                          False, save_scale=not blockwise,
                          group_scale=None if group_scale is None else group_scale.to(DEVICE))
    sums = torch.empty(G, N, device=DEVICE)
    dw = ff.wgrad(dy_d, x_d, scale, sizes, blockwise, E4M3, E5M2, False, out_dtype, sums)
    if blockwise:
        a = emulate.fake_quant_row_tiles(dy, ends, E5M2, False)
        b = emulate.fake_quant_row_tiles(x, ends, E4M3, False)
    else:
        row_scale = None if group_scale is None else \
            emulate.group_scales_per_row(x, ends, E4M3, False)
        x_codes, x_inv = rows.quantize_rows_reference(x, E4M3, False, row_scale)
        a = emulate.fake_quant_group_columns(transposed.fold_row_factors(dy, x_inv), ends,
                                             E5M2, False)
        b = x_codes.float()
    want = _per_group(lambda g, s, e, o: o.__setitem__(g, a[s:e].T @ b[s:e]),
                      torch.zeros(G, N, K))
    assert dw.dtype == out_dtype
    assert rel_err(dw.float().cpu(), want) < TOL + (4e-3 if out_dtype == torch.bfloat16 else 0)
    assert torch.all(dw[1] == 0)
    want_sums = _per_group(lambda g, s, e, o: o.__setitem__(g, dy[s:e].float().sum(0)),
                           torch.zeros(G, N))
    assert rel_err(sums.cpu(), want_sums) < 1e-5


def test_no_rows_or_columns():
    """Empty problems: outputs of the right shapes; without input columns a zero weight
    gradient, and the bias sums still ``dy``'s per group."""
    codes, inv = quantize_weight_codes(torch.randn(2, 8, 16), Float8Rowwise())
    sizes = torch.tensor([0, 0], device=DEVICE)
    out, _ = ff.forward(torch.zeros(0, 16, device=DEVICE).bfloat16(), codes.to(DEVICE),
                        inv.to(DEVICE), None, sizes, False, E4M3, False)
    assert out.shape == (0, 8)
    dy = torch.randn(3, 8, device=DEVICE)
    sums = torch.full((2, 8), 5.0, device=DEVICE)
    dw = ff.wgrad(dy, torch.zeros(3, 0, device=DEVICE), None, torch.tensor([1, 2], device=DEVICE),
                  False, E4M3, E5M2, False, torch.float32, sums)
    assert dw.shape == (2, 8, 0)
    assert torch.allclose(sums, torch.stack([dy[:1].sum(0), dy[1:].sum(0)]))
