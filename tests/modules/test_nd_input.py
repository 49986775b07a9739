"""GroupedLinear on ``(..., in_features)`` input: the rows are the leading dims flattened (in
order, ``m_splits`` counts them), the output keeps the leading dims."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.modules import grouped_linear as module
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import reference_grads, rel_err

LEADING = (2, 3, 4)
SIZES = [5, 0, 9, 10]  # the 24 rows of LEADING
G, K, N = len(SIZES), 16, 8
# The triton backend runs where Triton does: CUDA, else the CPU interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (backend, dtype, recipe, tolerance against float64): every backend on CPU, and FP8 recipes
# (emulated on CPU).
CASES = [
    ("loop", torch.float64, None, 1e-12),
    ("grouped", torch.float32, None, 1e-5),
    ("triton", torch.float32, None, 1e-5),
    ("auto", torch.bfloat16, Float8Rowwise(), 8e-2),
    ("auto", torch.bfloat16, Float8Tensorwise(), 8e-2),
    ("auto", torch.bfloat16, Float8Blockwise(), 8e-2),
]


def _device(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _layer(backend="loop", dtype=torch.float64, recipe=None, **kwargs):
    torch.manual_seed(11)
    return gl.GroupedLinear(G, K, N, params_dtype=dtype, backend=backend, recipe=recipe,
                            device=_device(backend), **kwargs)


def _param_grads(layer):
    return [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("backend, dtype, recipe, tol", CASES,
                         ids=[f"{c[0]}-{c[1]}-{type(c[2]).__name__}" for c in CASES])
def test_nd_input_equals_the_flattened_call(backend, dtype, recipe, tol):
    layer = _layer(backend, dtype, recipe)
    device = _device(backend)
    x = torch.randn(*LEADING, K, device=device).to(dtype).requires_grad_()
    g = torch.randn(*LEADING, N, device=device).to(dtype)
    y = layer(x, SIZES)
    assert y.shape == (*LEADING, N)
    y.backward(g)
    nd_grads = _param_grads(layer)
    layer.zero_grad(set_to_none=True)

    flat = x.detach().reshape(-1, K).clone().requires_grad_()
    y_flat = layer(flat, SIZES)
    y_flat.backward(g.reshape(-1, N))
    assert torch.equal(y.detach().reshape(-1, N), y_flat.detach())
    assert torch.equal(x.grad.reshape(-1, K), flat.grad)
    assert all(torch.equal(a, b) for a, b in zip(nd_grads, _param_grads(layer)))

    ref = reference_grads(flat, layer.grouped_weight(), layer.grouped_bias(), SIZES,
                          g.reshape(-1, N))
    assert rel_err(y.reshape(-1, N), ref[0]) < tol
    assert rel_err(x.grad.reshape(-1, K), ref[1]) < tol
    assert rel_err(nd_grads[0], ref[2]) < tol and rel_err(nd_grads[1], ref[3]) < tol


@pytest.mark.parametrize("backend", ["loop", "triton"])
def test_the_ops_get_a_2d_view_of_contiguous_input(backend, monkeypatch):
    seen = []
    apply = module.apply_grouped_linear

    def spy(x, *args, **kwargs):
        seen.append(x)
        return apply(x, *args, **kwargs)

    monkeypatch.setattr(module, "apply_grouped_linear", spy)
    dtype = torch.float64 if backend == "loop" else torch.float32
    layer = _layer(backend, dtype)
    x = torch.randn(*LEADING, K, dtype=dtype, device=_device(backend))
    layer(x, SIZES)
    assert seen[0].shape == (sum(SIZES), K)
    assert seen[0].data_ptr() == x.data_ptr() and seen[0]._base is x  # a view, not a copy


def test_non_contiguous_nd_input_and_splits_tensor():
    layer = _layer()
    base = torch.randn(3, 2, 4, K, dtype=torch.float64)
    x = base.transpose(0, 1).requires_grad_()  # (2, 3, 4, K), not contiguous
    g = torch.randn(*LEADING, N, dtype=torch.float64)
    y = layer(x, torch.tensor(SIZES))
    y.backward(g)
    ref = reference_grads(x.reshape(-1, K), layer.grouped_weight(), layer.grouped_bias(), SIZES,
                          g.reshape(-1, N))
    assert y.shape == (*LEADING, N) and x.grad.shape == x.shape
    assert rel_err(y.reshape(-1, N), ref[0]) < 1e-12
    assert rel_err(x.grad.reshape(-1, K), ref[1]) < 1e-12
    assert rel_err(layer.weight.grad, ref[2]) < 1e-12


@pytest.mark.parametrize("delay, fuse", [(True, False), (False, True), (True, True)])
def test_nd_input_with_the_gradient_sink(delay, fuse):
    layer = _layer(delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse,
                   single_grouped_weight=False, single_grouped_bias=False)
    weights = [getattr(layer, f"weight{i}") for i in range(G)]
    for p in weights:
        p.main_grad = torch.zeros_like(p)
    x = torch.randn(*LEADING, K, dtype=torch.float64)
    g = torch.randn(*LEADING, N, dtype=torch.float64)
    y, bias = layer(x, SIZES, return_bias=True)
    assert y.shape == (*LEADING, N) and len(bias) == G
    y.backward(g)
    layer.backward_dw()
    ref = reference_grads(x.reshape(-1, K), layer.grouped_weight(), None, SIZES,
                          g.reshape(-1, N))
    got = torch.stack([p.main_grad if fuse else p.grad for p in weights])
    assert rel_err(y.reshape(-1, N), ref[0]) < 1e-12 and rel_err(got, ref[2]) < 1e-12


def test_empty_leading_dim():
    layer = _layer()
    x = torch.randn(0, 3, K, dtype=torch.float64, requires_grad=True)
    y = layer(x, [0] * G)
    y.sum().backward()
    assert y.shape == (0, 3, N) and x.grad.shape == x.shape
    assert float(layer.weight.grad.abs().sum()) == 0.0


def test_list_input_keeps_its_2d_output():
    layer = _layer()
    pieces = [torch.randn(s, K, dtype=torch.float64) for s in SIZES]
    y = layer(pieces)
    ref = reference_grads(torch.cat(pieces), layer.grouped_weight(), layer.grouped_bias(),
                          SIZES, torch.ones(sum(SIZES), N, dtype=torch.float64))
    assert y.shape == (sum(SIZES), N) and rel_err(y, ref[0]) < 1e-12


@pytest.mark.parametrize("shape, pattern", [
    ((), r"x has shape \(\): expected \(\.\.\., 16\)"),
    ((K,), r"x has shape \(16,\): expected \(\.\.\., 16\)"),
    ((2, 3, K + 1), r"x has 17 features \(shape \(2, 3, 17\)\), expected 16"),
])
def test_input_of_too_few_dims_or_wrong_features_is_rejected(shape, pattern):
    layer = _layer(delay_wgrad_compute=True)
    before = [p.detach().clone() for p in layer.parameters()]
    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(shape, dtype=torch.float64, requires_grad=True), SIZES)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert all(p.grad is None for p in layer.parameters()) and not layer._pending_wgrads
