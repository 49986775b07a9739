"""Parameter gradients around autograd on CUDA: fp32 ``main_grad`` accumulation on every
backend and FP8 recipe, input-only backward, device split tensors changed in place."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TRITON_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
K, N = 256, 128


def _sizes(num_groups):
    generator = torch.Generator().manual_seed(num_groups)
    sizes = torch.randint(0, 300, (num_groups,), generator=generator).tolist()
    sizes[1] = 0
    return sizes


def _accumulate(layer, sizes, steps=3):
    """``steps`` micro-batches into an fp32 ``main_grad``; returns it and the float64 sum."""
    layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    w, b = layer.weight.detach(), layer.bias.detach()
    want = torch.zeros(len(sizes), N, K, dtype=torch.float64)
    for _ in range(steps):
        x = (torch.randn(sum(sizes), K, device="cuda") * 4).bfloat16()
        g = torch.randn(sum(sizes), N, device="cuda").bfloat16()
        layer(x, torch.tensor(sizes, device="cuda")).backward(g)
        want += reference_grads(x, w, b, sizes, g)[2]
    layer.backward_dw()
    return layer.weight.main_grad, want


@pytest.mark.parametrize("backend", ["triton", "grouped", "loop"])
@pytest.mark.parametrize("delay", [False, True])
def test_main_grad_accumulates_in_float32(backend, delay):
    torch.manual_seed(0)
    sizes = _sizes(8)
    layer = gl.GroupedLinear(8, K, N, params_dtype=torch.bfloat16, device="cuda",
                             backend=backend, fuse_wgrad_accumulation=True,
                             delay_wgrad_compute=delay)
    got, want = _accumulate(layer, sizes)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5  # bf16-rounded weight gradients: about 2e-3


@pytest.mark.parametrize("recipe", [
    Float8Rowwise(), Float8Tensorwise(),
    pytest.param(Float8Blockwise(), marks=pytest.mark.skipif(
        not TRITON_FP8, reason="needs FP8 tensor cores (sm89+)"))], ids=repr)
@pytest.mark.parametrize("num_groups", [4, 40])  # torch's and the Triton FP8 weight gradient
def test_fp8_main_grad_is_accumulated_in_float32(recipe, num_groups):
    torch.manual_seed(1)
    sizes = _sizes(num_groups)
    layer = gl.GroupedLinear(num_groups, K, N, params_dtype=torch.bfloat16, device="cuda",
                             recipe=recipe, fuse_wgrad_accumulation=True)
    got, want = _accumulate(layer, sizes, steps=1)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 6e-2
    assert not torch.equal(got, got.bfloat16().float())  # never rounded to bf16 first


@pytest.mark.parametrize("backend", ["triton", "grouped"])
def test_an_input_only_backward_leaves_the_parameters_alone(backend):
    sizes = _sizes(8)
    layer = gl.GroupedLinear(8, K, N, params_dtype=torch.bfloat16, device="cuda",
                             backend=backend, fuse_wgrad_accumulation=True,
                             delay_wgrad_compute=True)
    layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
    x = torch.randn(sum(sizes), K, device="cuda").bfloat16().requires_grad_()
    y = layer(x, torch.tensor(sizes, device="cuda"))
    (grad_x,) = torch.autograd.grad(y.float().sum(), x)
    layer.backward_dw()
    want = reference_grads(x, layer.weight, layer.bias, sizes,
                           torch.ones(sum(sizes), N, dtype=torch.float64))[1]
    assert rel_err(grad_x, want) < 1e-2
    assert float(layer.weight.main_grad.abs().max()) == 0.0 and layer.bias.grad is None


@pytest.mark.parametrize("backend", ["triton", "grouped"])
def test_device_splits_changed_in_place_before_backward_dw_raise_or_are_not_read(backend):
    torch.manual_seed(2)
    sizes = _sizes(8)
    layer = gl.GroupedLinear(8, K, N, device="cuda", backend=backend,
                             delay_wgrad_compute=True)
    x, g = torch.randn(sum(sizes), K, device="cuda"), torch.randn(sum(sizes), N, device="cuda")
    splits = torch.tensor(sizes, device="cuda")
    layer(x, splits).backward(g)
    splits[0] += 7
    splits[2] -= 7
    try:
        layer.backward_dw()
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
    else:
        want = reference_grads(x, layer.weight, layer.bias, sizes, g)[2]
        assert rel_err(layer.weight.grad, want) < 1e-2
