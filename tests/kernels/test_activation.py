"""The fused bias + activation kernels against their reference (CUDA, or the Triton interpreter)."""

import pytest
import torch

from grouped_linear.kernels import activation as act
from grouped_linear.kernels._triton import HAS_TRITON, use_triton
from grouped_linear.ops.activation import bias_activation
from tests.reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["swiglu", "geglu", "gelu", "relu", "silu"]


def _case(kind, dtype, with_bias, sizes=(5, 0, 40, 3), tail=6, F=48):
    G, M = len(sizes), sum(sizes) + tail
    width = 2 * F if kind in act.GATED_KINDS else F
    h = torch.randn(M, width, device=DEVICE, dtype=dtype) * 2
    bias = torch.randn(G, width, device=DEVICE, dtype=dtype) if with_bias else None
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    return h, bias, offsets, sum(sizes)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_matches_reference(kind, dtype, with_bias):
    h, bias, offsets, head = _case(kind, dtype, with_bias)
    assert use_triton(h)
    out = act.bias_act_forward(h, bias, offsets, kind, True)
    ref = act.bias_act_reference(h, bias, offsets, kind, True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and rel_err(out, ref) < tol
    assert torch.all(out[head:] == 0)
    grad_a = torch.randn_like(out)
    grad_h = act.bias_act_backward(grad_a, h, bias, offsets, kind, True)
    leaf = h.detach().double().requires_grad_()
    ref64 = act.bias_act_reference(leaf, bias.double() if bias is not None else None,
                                   offsets, kind, True)
    (want,) = torch.autograd.grad(ref64, leaf, grad_a.double())
    assert rel_err(grad_h, want) < tol
    assert torch.all(grad_h[head:] == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_op_gradcheck_float64(kind):
    h, bias, offsets, _ = _case(kind, torch.float64, True, sizes=(2, 0, 3), tail=0, F=3)
    h.requires_grad_()
    bias.requires_grad_()
    if kind == "relu":  # keep away from the kink
        with torch.no_grad():
            h.add_(torch.sign(h) * 0.1)
    assert torch.autograd.gradcheck(
        lambda h, b: bias_activation(h, b, offsets, kind, False), (h, bias))


def test_op_rejects_unknown_kind():
    h, bias, offsets, _ = _case("relu", torch.float32, False)
    with pytest.raises(ValueError, match="activation='tanh'"):
        bias_activation(h, bias, offsets, "tanh", False)


@pytest.mark.parametrize("kind", KINDS)
def test_written_out_backward_reference_matches_autograd(kind):
    h, bias, offsets, head = _case(kind, torch.float64, True)
    grad_a = torch.randn(h.shape[0], h.shape[1] // (2 if kind in act.GATED_KINDS else 1),
                         dtype=torch.float64, device=h.device)
    leaf = h.detach().requires_grad_()
    (want,) = torch.autograd.grad(act.bias_act_reference(leaf, bias, offsets, kind, True), leaf,
                                  grad_a)
    got = act.bias_act_backward_reference(grad_a, h, bias, offsets, kind)
    assert rel_err(got, want) < 1e-12 and torch.all(got[head:] == 0)
