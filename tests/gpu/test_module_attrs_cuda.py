"""GroupedLinear on CUDA: ``(..., in_features)`` input on every backend, the fast path and the
FP8 recipes; Megatron-Core's ``overwrite_main_grad`` and ``zero_out_wgrad`` on the weights."""

import importlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ops_module = importlib.import_module("grouped_linear.ops.grouped_linear")
TRITON_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
LEADING = (4, 3, 170)  # 2040 rows
SIZES = [300, 0, 1, 517, 64, 0, 129, 1029]
G, K, N = len(SIZES), 256, 384
RECIPES = [
    None, Float8Rowwise(), Float8Tensorwise(),
    pytest.param(Float8Blockwise(), marks=pytest.mark.skipif(
        not TRITON_FP8, reason="needs FP8 tensor cores (sm89+)")),
]


def _layer(backend="auto", recipe=None, **kwargs):
    torch.manual_seed(0)
    return gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device="cuda",
                            backend=backend, recipe=recipe, **kwargs)


def _step(layer, x, splits, grad_out):
    for p in (x, *layer.parameters()):
        p.grad = None
    y = layer(x, splits)
    y.backward(grad_out)
    return y.detach().clone(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("backend", ["auto", "triton", "grouped", "loop"])
@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("device_splits", [True, False])
def test_nd_input_equals_the_flattened_call(monkeypatch, backend, recipe, device_splits):
    """Device splits without a recipe take the fast path (no split normalisation) for the
    N-D call as for the 2-D one; values and gradients equal the flattened call's."""
    if recipe is not None and backend != "auto":
        pytest.skip("a recipe chooses its own GEMMs")
    calls = []
    normalize = ops_module.normalize_splits
    monkeypatch.setattr(ops_module, "normalize_splits",
                        lambda *a, **k: calls.append(1) or normalize(*a, **k))
    layer = _layer(backend, recipe)
    splits = torch.tensor(SIZES, device="cuda") if device_splits else SIZES
    x = torch.randn(*LEADING, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(*LEADING, N, device="cuda", dtype=torch.bfloat16)
    flat = x.detach().reshape(-1, K).clone().requires_grad_()
    want = _step(layer, flat, splits, grad_out.reshape(-1, N))
    calls.clear()
    got = _step(layer, x, splits, grad_out)
    if device_splits and recipe is None:
        assert not calls  # the fast path
    assert got[0].shape == (*LEADING, N) and got[1].shape == x.shape
    assert torch.equal(got[0].reshape(-1, N), want[0])
    assert torch.equal(got[1].reshape(-1, K), want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    ref = reference_grads(flat, layer.weight, layer.bias, SIZES, grad_out.reshape(-1, N))
    tol = 1e-2 if recipe is None else 6e-2
    assert rel_err(got[0].reshape(-1, N), ref[0]) < tol
    assert rel_err(got[2][0], ref[2]) < tol


@pytest.mark.parametrize("backend, recipe", [
    ("triton", None), ("grouped", None), ("loop", None), ("auto", Float8Rowwise()),
    pytest.param("auto", Float8Blockwise(), marks=pytest.mark.skipif(
        not TRITON_FP8, reason="needs FP8 tensor cores (sm89+)")),
], ids=str)
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_overwrite_main_grad(backend, recipe, single, delay, overwrite):
    """Two steps into an fp32 ``main_grad`` that holds values already: overwritten, only the
    second step's gradient stays; accumulated, the sum."""
    layer = _layer(backend, recipe, single_grouped_weight=single, delay_wgrad_compute=delay,
                   fuse_wgrad_accumulation=True)
    weights = [layer.weight] if single else [getattr(layer, f"weight{i}") for i in range(G)]
    start = torch.randn(G, N, K, device="cuda")
    for p, piece in zip(weights, [start] if single else start.unbind(0)):
        p.main_grad = piece.clone()
        p.overwrite_main_grad = overwrite
        p.zero_out_wgrad = True
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    splits = torch.tensor(SIZES, device="cuda")
    refs = []
    for _ in range(2):
        x = torch.randn(*LEADING, K, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(*LEADING, N, device="cuda", dtype=torch.bfloat16)
        layer(x, splits).backward(g)
        refs.append(reference_grads(x.reshape(-1, K), w, b, SIZES, g.reshape(-1, N))[2])
    layer.backward_dw()
    got = torch.stack([p.main_grad for p in weights]).reshape(G, N, K)
    want = refs[1] if overwrite else start.double().cpu() + refs[0] + refs[1]
    assert got.dtype == torch.float32
    assert rel_err(got, want) < (1e-5 if recipe is None else 6e-2)
    assert all(p.grad is not None and not p.grad.any() for p in weights)  # zero_out_wgrad
