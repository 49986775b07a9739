"""Autograd modes beyond first-order reverse mode are refused, never half done: with
``create_graph=True`` the first-order gradients are the usual ones, and differentiating them
again (a gradient penalty, a Hessian-vector product) raises instead of leaving out the
library's part (the kernels' gradients carry no graph); forward-mode AD raises instead of
the kernels dropping the tangents."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import grouped_linear as gl
from grouped_linear.kernels._triton import HAS_TRITON, interpreting

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [3, 0, 5]


def _linear(backend, recipe=None):
    def make(device):
        w = torch.randn(3, 8, 8, device=device) / 3
        b = torch.randn(3, 8, device=device)

        def call(x, w, b):
            return gl.grouped_linear(x, w, b, torch.tensor(SIZES, device=device),
                                     backend=backend, recipe=recipe)
        return (w, b), call
    return make


def _mlp(device):
    w1 = torch.randn(3, 16, 8, device=device) / 3
    w2 = torch.randn(3, 8, 8, device=device) / 3

    def call(x, w1, w2):
        return gl.grouped_mlp(x, w1, None, w2, None, torch.tensor(SIZES, device=device))
    return (w1, w2), call


def _routed(device):
    probs = torch.rand(8, 2, device=device)
    index = torch.randint(0, 3, (8, 2), device=device)

    def call(x, probs):
        rows, _, row_map = gl.permute(x, index, 3)
        return gl.unpermute(rows * 2, row_map, probs)
    return (probs,), call


CASES = {"loop": _linear("loop"), "grouped": _linear("grouped"), "triton": _linear("triton"),
         "auto": _linear("auto"), "fp8_rowwise": _linear("auto", gl.recipes.Float8Rowwise()),
         "mlp": _mlp, "permute_unpermute": _routed}


@pytest.mark.parametrize("name", list(CASES))
def test_first_order_only(name):
    if name == "triton" and not (HAS_TRITON and (TRITON_DEVICE == "cuda" or interpreting())):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = TRITON_DEVICE if name == "triton" else "cpu"
    params, call = CASES[name](device)
    x = torch.randn(8, 8, device=device, requires_grad=True)
    params = [p.requires_grad_() for p in params]

    plain = torch.autograd.grad(call(x, *params).square().sum(), [x, *params])
    graphed = torch.autograd.grad(call(x, *params).square().sum(), [x, *params],
                                  create_graph=True)
    for got, want in zip(graphed, plain):
        assert torch.equal(got.detach(), want)
    penalty = sum(g.square().sum() for g in graphed)
    loss = call(x, *params).sum() + penalty
    with pytest.raises(RuntimeError, match="differentiate twice"):
        loss.backward()


def _can_run(backend):
    return backend != "triton" or (HAS_TRITON and (TRITON_DEVICE == "cuda" or interpreting()))


@pytest.mark.parametrize("backend", ["loop", "grouped", "triton", "auto"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_forward_mode_ad_is_refused(backend, grad):
    """A dual input raises (the layer has no forward-mode derivative) under ``no_grad`` too,
    where the kernels would run alone; plain inputs inside a dual level run as outside."""
    if not _can_run(backend):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    x = torch.randn(8, 8, device=device)
    w = torch.randn(3, 8, 8, device=device)
    splits = torch.tensor(SIZES, device=device)
    want = gl.grouped_linear(x, w, None, splits, backend=backend)
    with fwAD.dual_level(), torch.set_grad_enabled(grad):
        assert torch.equal(gl.grouped_linear(x, w, None, splits, backend=backend), want)
        dual = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(NotImplementedError, match="forward"):
            gl.grouped_linear(dual, w, None, splits, backend=backend)
