"""The triton backend's eager fast-path autograd function (ops/fast_path.py) against a
float64 reference: on CUDA where there is one, else under Triton's CPU interpreter."""

import pytest
import torch

from grouped_linear.kernels._triton import HAS_TRITON, interpreting
from grouped_linear.ops.fast_path import apply_triton_linear
from tests.reference import reference_grads, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not interpreting()),
    reason="needs CUDA or TRITON_INTERPRET=1",
)

SIZES = [5, 0, 17, 3]  # an empty group, and 4 tail rows past the groups
ROWS, K, N = 29, 24, 40


def _inputs(dtype, with_bias, requires=(True, True, True)):
    torch.manual_seed(0)
    G = len(SIZES)
    x = torch.randn(ROWS, K, dtype=dtype, device=DEVICE)
    weight = torch.randn(G, N, K, dtype=dtype, device=DEVICE) / 4
    bias = torch.randn(G, N, dtype=dtype, device=DEVICE) if with_bias else None
    tensors = [x, weight, bias]
    for i, flag in enumerate(requires):
        if tensors[i] is not None:
            tensors[i].requires_grad_(flag)
    return (*tensors, torch.tensor(SIZES, device=DEVICE))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_one_launch_backward_match_float64(dtype, tol, with_bias):
    if dtype == torch.float32 and DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    x, weight, bias, sizes = _inputs(dtype, with_bias)
    y = apply_triton_linear(x, weight, bias, sizes)
    assert type(y.grad_fn).__name__ == "TritonGroupedLinearFunctionBackward"
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    want = reference_grads(x, weight, bias, SIZES, grad_out)
    got = (y, x.grad, weight.grad, bias.grad if bias is not None else None)
    for name, g, w in zip(("y", "dx", "dW", "db"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == dtype and g.shape == w.shape, name
        assert rel_err(g, w) < tol, (name, rel_err(g, w))


@pytest.mark.parametrize("requires", [(True, False, False), (False, True, False),
                                      (False, False, True), (False, True, True)])
def test_partial_gradients_come_from_the_separate_kernels(requires):
    """Only some inputs need a gradient: each asked one matches, the others stay None."""
    x, weight, bias, sizes = _inputs(torch.float32, True, requires)
    y = apply_triton_linear(x, weight, bias, sizes)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    want = reference_grads(x, weight, bias, SIZES, grad_out)[1:]
    for flag, tensor, w in zip(requires, (x, weight, bias), want):
        if flag:
            assert rel_err(tensor.grad, w) < 1e-5
        else:
            assert tensor.grad is None


def test_zero_stride_gradient_and_no_graph_without_grad():
    x, weight, bias, sizes = _inputs(torch.float32, True)
    y = apply_triton_linear(x, weight, bias, sizes)
    y.sum().backward()  # the gradient arrives expanded from a scalar
    want = reference_grads(x, weight, bias, SIZES, torch.ones_like(y))
    assert rel_err(weight.grad, want[2]) < 1e-5 and rel_err(bias.grad, want[3]) < 1e-5
    with torch.no_grad():
        plain = apply_triton_linear(x, weight, bias, sizes)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, y.detach(), rtol=0, atol=0)
