"""The scaling rule on the host and in the kernels: the same float32 scales, bit for bit."""

import pytest
import torch

from grouped_linear.kernels._triton import tl, triton
from grouped_linear.kernels.quantize.common import amax_to_scale, inverse, scale_from_amax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _scales_kernel(amax_ptr, scale_ptr, inv_ptr, n, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    scale = amax_to_scale(tl.load(amax_ptr + i, mask=mask, other=0.0), FP8_MAX, POW2)
    tl.store(scale_ptr + i, scale, mask=mask)
    tl.store(inv_ptr + i, inverse(scale), mask=mask)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("power_of_two", [False, True], ids=["scales", "pow2"])
def test_kernel_scales_are_the_hosts(fp8, power_of_two):
    """Random maxima over 80 binades, the maxima whose scales fall just below and on powers
    of two (where a float32 log2 rounds up), zero, float32's extremes and infinity: the kernels'
    scales and their inverses equal the host's."""
    fp8_max = torch.finfo(fp8).max
    rand = torch.rand(4096) * torch.exp2(torch.randint(-40, 40, (4096,)).float())
    powers = torch.exp2(torch.arange(-30, 30).float())
    below = powers.nextafter(torch.zeros_like(powers))
    near = fp8_max / torch.cat([powers, below])
    amax = torch.cat([rand, near, torch.tensor([0.0, 1e-38, 3.4e38, 1e-30, float("inf")])])
    amax_d = amax.to(DEVICE)
    scale, inv = torch.empty_like(amax_d), torch.empty_like(amax_d)
    _scales_kernel[(triton.cdiv(amax.numel(), 1024),)](amax_d, scale, inv, amax.numel(),
                                                        FP8_MAX=fp8_max, POW2=power_of_two,
                                                        BLOCK=1024)
    want = scale_from_amax(amax, fp8, power_of_two)
    assert torch.equal(scale.cpu(), want)
    assert torch.equal(inv.cpu(), 1.0 / want)
    if power_of_two:  # never above the exact scale (an infinite maximum's 0 stays 0)
        exact = scale_from_amax(amax, fp8, False)
        finite = exact > 0
        assert torch.all(want <= exact) and torch.all(want[finite] > exact[finite] / 2)
        assert torch.equal(want[~finite], exact[~finite])


@pytest.mark.parametrize("recipe_class", ["Float8Rowwise", "Float8Tensorwise", "Float8Blockwise"])
def test_an_infinite_input_stays_non_finite_with_power_of_two_scales(recipe_class):
    """An infinite input's unit has scale 0 (factor inf) with power-of-two scales too, so the
    emulated GEMM's output is not finite where the exact one is not (a scale of 0.5 made
    it a finite 448 * 2)."""
    import grouped_linear as gl

    recipe = getattr(gl.recipes, recipe_class)(power_of_two_scales=True)
    assert scale_from_amax(torch.tensor([float("inf")]), torch.float8_e4m3fn, True).item() == 0
    x = torch.randn(6, 128)
    x[0, 0] = float("inf")
    w = torch.randn(2, 128, 128).abs()  # positive: the exact output's row 0 is +inf
    with torch.no_grad():
        y = gl.grouped_linear(x, w, None, [4, 2], recipe=recipe)
    assert not bool(y[0].isfinite().all())
    assert bool(y[4:].isfinite().all())  # the other group's rows do not meet the inf


@pytest.mark.parametrize("recipe_class", ["Float8Rowwise", "Float8Tensorwise", "Float8Blockwise"])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_a_nan_spoils_only_what_it_touches(recipe_class, power_of_two):
    """A NaN input or weight value is left out of its unit's scale (as the kernels' maxima
    leave it): the output is NaN where the NaN enters the exact product and otherwise what
    a 0 in its place gives, bit for bit (a scale of 1 for the NaN's whole unit clipped the
    other rows at 448)."""
    import grouped_linear as gl

    recipe = getattr(gl.recipes, recipe_class)(power_of_two_scales=power_of_two)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 128, generator=gen) * 1000
    w = torch.randn(2, 3, 128, generator=gen)
    x[0, 0], w[0, 1, 5] = 0.0, 0.0
    with torch.no_grad():
        clean = gl.grouped_linear(x, w, None, [4, 4], recipe=recipe)
        x_nan, w_nan = x.clone(), w.clone()
        x_nan[0, 0], w_nan[0, 1, 5] = float("nan"), float("nan")
        got = gl.grouped_linear(x_nan, w, None, [4, 4], recipe=recipe)
        got_w = gl.grouped_linear(x, w_nan, None, [4, 4], recipe=recipe)
    assert bool(got[0].isnan().all()) and torch.equal(got[1:], clean[1:])
    assert bool(got_w[:4, 1].isnan().all())
    keep = torch.ones_like(clean, dtype=torch.bool)
    keep[:4, 1] = False
    assert torch.equal(got_w[keep], clean[keep])
