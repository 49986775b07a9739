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
    of two (where a float32 log2 rounds up), zero and float32's extremes: the kernels'
    scales and their inverses equal the host's."""
    fp8_max = torch.finfo(fp8).max
    rand = torch.rand(4096) * torch.exp2(torch.randint(-40, 40, (4096,)).float())
    powers = torch.exp2(torch.arange(-30, 30).float())
    below = powers.nextafter(torch.zeros_like(powers))
    near = fp8_max / torch.cat([powers, below])
    amax = torch.cat([rand, near, torch.tensor([0.0, 1e-38, 3.4e38, 1e-30])])
    amax_d = amax.to(DEVICE)
    scale, inv = torch.empty_like(amax_d), torch.empty_like(amax_d)
    _scales_kernel[(triton.cdiv(amax.numel(), 1024),)](amax_d, scale, inv, amax.numel(),
                                                        FP8_MAX=fp8_max, POW2=power_of_two,
                                                        BLOCK=1024)
    want = scale_from_amax(amax, fp8, power_of_two)
    assert torch.equal(scale.cpu(), want)
    assert torch.equal(inv.cpu(), 1.0 / want)
    if power_of_two:  # never above the exact scale
        exact = scale_from_amax(amax, fp8, False)
        assert torch.all(want <= exact) and torch.all(want > exact / 2)
