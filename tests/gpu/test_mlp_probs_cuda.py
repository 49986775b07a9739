"""Routing probabilities in the expert MLP on CUDA, bf16: the fused activation kernel, both
conventions of ``gl.grouped_mlp`` and ``GroupedMLP`` with device splits (run by
``make test-gpu``)."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels import activation as act
from tests.kernels.test_activation import CASES, GATED, grouped_f64
from tests.ops.test_mlp import reference
from tests.reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [300, 0, 1, 517, 64, 0, 129, 1000]  # unaligned, empty groups
TAIL = 37  # rows past the device splits
H, F = 256, 384


@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16])
def test_kernel_bf16_with_probs(kind, interleaved, probs_dtype):
    """The fused kernel in bf16 against the float64 formulas: output, gradient of fc1's
    output and of the probabilities; the rows past the groups get zero."""
    torch.manual_seed(0)
    head = sum(SIZES)
    width = 2 * F if kind in GATED else F
    h = (torch.randn(head + TAIL, width, device="cuda") * 3).bfloat16()
    bias = torch.randn(len(SIZES), width, device="cuda").bfloat16()
    ends = torch.tensor(SIZES, device="cuda").cumsum(0).to(torch.int32)
    probs = torch.rand(head + TAIL, device="cuda").to(probs_dtype)
    out = act.bias_act_forward(h, bias, ends, kind, True, interleaved, probs=probs)
    grad_a = torch.randn(out.shape, device="cuda").bfloat16()
    grad_h, grad_p = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved,
                                           probs=probs, probs_grad=True)
    h64 = h.double().requires_grad_()
    p64 = probs.double().requires_grad_()
    want = p64.unsqueeze(1) * grouped_f64(kind, h64, bias.double(), SIZES, interleaved)
    want_h, want_p = torch.autograd.grad(want, [h64, p64], grad_a.double())
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < 1e-2
    assert rel_err(grad_h, want_h) < 1e-2
    assert grad_p.dtype == probs_dtype and rel_err(grad_p, want_p) < 1e-2
    assert torch.all(out[head:] == 0) and torch.all(grad_h[head:] == 0)
    assert torch.all(grad_p[head:] == 0)


def _weights(kind):
    G, width = len(SIZES), (2 * F if kind in GATED else F)
    return [(torch.randn(*shape, device="cuda") * scale).bfloat16().requires_grad_()
            for shape, scale in (((G, width, H), H ** -0.5), ((G, width), 1.0),
                                 ((G, H, F), F ** -0.5), ((G, H), 1.0))]


@pytest.mark.parametrize("probs_on", ["activation", "input"])
@pytest.mark.parametrize("kind, interleaved", [("swiglu", False), ("gpt_oss_swiglu", True),
                                               ("gelu", False)])
def test_grouped_mlp_bf16_with_probs_and_device_splits(kind, interleaved, probs_on):
    """bf16 rows, float32 probabilities, CUDA splits that leave a tail: within bf16's error
    of the unfused float64 computation (for the gradients: 2e-2, or twice the error of the
    same unfused computation run in bf16 where that is larger; a limit of 1.0 clamps most of
    GPT-OSS's gates, and bf16 rounding moves some of them across it); the tail's output and
    gradients are zero."""
    torch.manual_seed(1)
    head = sum(SIZES)
    w1, b1, w2, b2 = _weights(kind)
    x = torch.randn(head + TAIL, H, device="cuda").bfloat16().requires_grad_()
    probs = torch.rand(head + TAIL, device="cuda", requires_grad=True)
    order = "interleaved" if interleaved else "concatenated"
    limit = {"limit": 1.0} if kind == "gpt_oss_swiglu" else {}
    y = gl.grouped_mlp(x, w1, b1, w2, b2, torch.tensor(SIZES, device="cuda"), activation=kind,
                       gate_up_order=order, probs=probs, probs_on=probs_on, **limit)
    grad = torch.randn(y.shape, device="cuda").bfloat16()
    y.backward(grad)
    wanted = {}
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w1, b1, w2, b2, probs)]
        out = reference(leaves[0][:head], *leaves[1:5], SIZES, kind, interleaved,
                        probs=leaves[5][:head], probs_on=probs_on, **limit)
        out.backward(grad[:head].to(dtype))
        wanted[dtype] = (out, leaves)
    want, leaves = wanted[torch.float64]
    assert y.dtype == torch.bfloat16 and rel_err(y[:head], want) < 2e-2
    assert torch.all(y[head:] == 0)
    names = ("x", "w1", "b1", "w2", "b2", "probs")
    for name, got, leaf, bf16 in zip(names, (x, w1, b1, w2, b2, probs), leaves,
                                     wanted[torch.bfloat16][1], strict=True):
        bound = max(2e-2, 2 * rel_err(bf16.grad[:head] if name in ("x", "probs") else bf16.grad,
                                      leaf.grad[:head] if name in ("x", "probs") else leaf.grad))
        assert rel_err(got.grad, leaf.grad) < bound, name
    assert torch.all(x.grad[head:] == 0) and torch.all(probs.grad[head:] == 0)


@pytest.mark.parametrize("probs_on", ["activation", "input"])
def test_module_bf16_nd_input(probs_on):
    """``GroupedMLP`` in bf16 on a ``(B, S, H)`` input with ``(B, S)`` probabilities: the
    flattened call's output and gradients."""
    torch.manual_seed(2)
    mlp = gl.GroupedMLP(len(SIZES), H, F, params_dtype=torch.bfloat16, device="cuda",
                        probs_on=probs_on)
    rows = sum(SIZES)
    x = torch.randn(1, rows, H, device="cuda").bfloat16().requires_grad_()
    probs = torch.rand(1, rows, device="cuda", requires_grad=True)
    y = mlp(x, SIZES, probs)
    x_flat = x.detach().reshape(rows, H).requires_grad_()
    probs_flat = probs.detach().reshape(rows).requires_grad_()
    want = mlp(x_flat, SIZES, probs_flat)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(rows, H), want, rtol=0, atol=0)
    grad = torch.randn(rows, H, device="cuda").bfloat16()
    y.backward(grad.reshape(1, rows, H))
    want.backward(grad)
    torch.testing.assert_close(x.grad.reshape(rows, H), x_flat.grad, rtol=0, atol=0)
    torch.testing.assert_close(probs.grad.reshape(rows), probs_flat.grad, rtol=0, atol=0)
