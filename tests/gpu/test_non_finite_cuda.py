"""A NaN or infinity in the input reaches the output where the exact computation's would, on
CUDA's kernels (Triton's default min/max/clamp drop a NaN operand on GPUs; the interpreter
keeps it, so only these tests see the difference)."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels import activation as act_kernels
from grouped_linear.kernels.quantize import rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("kind", ["relu", "relu2", "silu", "swiglu", "gpt_oss_swiglu",
                                  "clamped_swiglu"])
def test_the_activation_kernel_keeps_a_nan(kind):
    h = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    h[3, 5] = float("nan")
    ends = torch.tensor([40, 64], device="cuda", dtype=torch.int32)
    got = act_kernels.bias_act_forward(h, None, ends, kind, True)
    want = act_kernels.bias_act_reference(h, None, ends, kind, True)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())


@pytest.mark.skipif(not FP8, reason="needs FP8 (sm89+)")
def test_row_quantization_keeps_a_nan_and_leaves_the_other_rows():
    t = torch.randn(32, 512, device="cuda", dtype=torch.bfloat16)
    clean_codes, clean_inv = rows.quantize_rows(t, torch.float8_e4m3fn, False)
    t[7, 11] = float("nan")
    codes, inv = rows.quantize_rows(t, torch.float8_e4m3fn, False)
    assert bool(codes.float()[7, 11].isnan())
    keep = torch.arange(32, device="cuda") != 7
    assert torch.equal(codes.view(torch.uint8)[keep], clean_codes.view(torch.uint8)[keep])
    assert torch.equal(inv[keep], clean_inv[keep])


@pytest.mark.skipif(not FP8, reason="needs FP8 (sm89+)")
@pytest.mark.parametrize("recipe", [gl.recipes.Float8Rowwise(), gl.recipes.Float8Blockwise(),
                                    gl.recipes.Float8Rowwise(power_of_two_scales=True)],
                         ids=["rowwise", "blockwise", "rowwise_pow2"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_token_gives_a_non_finite_output_row(recipe, value):
    """Row 0 holds the value: its output row is not finite (as bf16's), the rows of the other
    group are finite."""
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x[0, 0] = value
    w = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16).abs()
    with torch.no_grad():
        y = gl.grouped_linear(x, w, None, [128, 128], recipe=recipe)
    assert not bool(y[0].isfinite().all())
    assert bool(y[128:].isfinite().all())
