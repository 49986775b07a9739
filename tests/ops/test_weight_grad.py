"""Parameter gradients routed around autograd (``delay_wgrad_compute``,
``fuse_wgrad_accumulation``): nothing lost when ``backward_dw`` raises, in-place changes
caught, only what the backward pass asks for written, ``main_grad`` accumulated in fp32."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Rowwise
from tests.reference import reference_grads, rel_err

SIZES = [5, 0, 9, 6]
G, K, N = len(SIZES), 16, 8
M = sum(SIZES)
BACKENDS = ["loop", "grouped", "triton"]
# The triton backend runs where Triton does: CUDA, else the CPU interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _device(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _dtype(backend):
    """float64 where the backend takes it (exact comparisons), else float32."""
    return torch.float64 if backend == "loop" else torch.float32


def _tol(backend):
    return 1e-12 if backend == "loop" else 1e-5


def _layer(backend="loop", **kwargs):
    torch.manual_seed(7)
    return gl.GroupedLinear(G, K, N, params_dtype=_dtype(backend), backend=backend,
                            device=_device(backend), **kwargs)


def _weights(layer):
    if layer.single_grouped_weight:
        return [layer.weight]
    return [getattr(layer, f"weight{i}") for i in range(G)]


def _main_grad(layer):
    return torch.stack([p.main_grad for p in _weights(layer)]).reshape(G, N, K)


def _give_main_grads(layer, dtype=torch.float32):
    for p in _weights(layer):
        p.main_grad = torch.zeros_like(p, dtype=dtype)


def _params_snapshot(layer):
    return {name: (p.detach().clone(), None if p.grad is None else p.grad.clone(),
                   p.main_grad.clone() if hasattr(p, "main_grad") else None)
            for name, p in layer.named_parameters()}


def _same_snapshot(a, b):
    for name in a:
        for left, right in zip(a[name], b[name]):
            if (left is None) != (right is None):
                return False
            if left is not None and not torch.equal(left, right):
                return False
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("single", [True, False])
def test_a_failing_backward_dw_keeps_every_pending_gradient(backend, single):
    layer = _layer(backend, delay_wgrad_compute=True, fuse_wgrad_accumulation=True,
                   single_grouped_weight=single)
    dtype = _dtype(backend)
    _give_main_grads(layer, dtype)
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    xs = [torch.randn(M, K, dtype=dtype, device=_device(backend)) for _ in range(2)]
    gs = [torch.randn(M, N, dtype=dtype, device=_device(backend)) for _ in range(2)]
    for x, g in zip(xs, gs):
        layer(x, SIZES).backward(g)
    saved = [p.main_grad for p in _weights(layer)]
    del _weights(layer)[-1].main_grad
    with pytest.raises(ValueError, match="main_grad"):
        layer.backward_dw()
    for p, main_grad in zip(_weights(layer), saved):
        p.main_grad = main_grad
    assert all(p.grad is None for p in layer.parameters())
    assert float(_main_grad(layer).abs().max()) == 0.0
    layer.backward_dw()
    refs = [reference_grads(x, w, b, SIZES, g) for x, g in zip(xs, gs)]
    assert rel_err(_main_grad(layer), refs[0][2] + refs[1][2]) < _tol(backend)
    assert rel_err(layer.bias.grad, refs[0][3] + refs[1][3]) < _tol(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("changed", ["input", "output gradient"])
def test_an_in_place_change_before_backward_dw_raises(backend, changed):
    layer = _layer(backend, delay_wgrad_compute=True)
    x = torch.randn(M, K, dtype=_dtype(backend), device=_device(backend))
    g = torch.randn(M, N, dtype=_dtype(backend), device=_device(backend))
    xx = x.clone()
    layer(xx, SIZES).backward(g)
    (xx if changed == "input" else g).mul_(10)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        layer.backward_dw()
    assert all(p.grad is None for p in layer.parameters())
    (xx if changed == "input" else g).div_(10)  # restored values, but not the version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        layer.backward_dw()


def test_split_sizes_changed_in_place_before_backward_dw_raise_or_are_not_read():
    """Split tensors the kernels read as they are (none on CPU: the splits are normalised
    into new tensors) would raise like the input; either way no gradient of the new sizes."""
    layer = _layer("triton", delay_wgrad_compute=True)
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    sizes = torch.tensor(SIZES, device=TRITON_DEVICE)
    x = torch.randn(M, K, device=TRITON_DEVICE)
    g = torch.randn(M, N, device=TRITON_DEVICE)
    layer(x, sizes).backward(g)
    sizes[0] += 1
    sizes[2] -= 1
    try:
        layer.backward_dw()
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
    else:
        assert rel_err(layer.weight.grad, reference_grads(x, w, b, SIZES, g)[2]) < 1e-5


def _input_only(kind, y, x):
    if kind == "grad":
        return torch.autograd.grad(y, x, torch.ones_like(y))[0]
    y.backward(torch.ones_like(y), inputs=[x])
    return x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["delay", "fuse", "both"])
@pytest.mark.parametrize("kind", ["grad", "backward(inputs)"])
def test_an_input_only_backward_leaves_the_parameters_alone(backend, mode, kind):
    dtype = _dtype(backend)
    layer = _layer(backend, delay_wgrad_compute=mode != "fuse",
                   fuse_wgrad_accumulation=mode != "delay", single_grouped_weight=False)
    if mode != "delay":
        _give_main_grads(layer, dtype)
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    x = torch.randn(M, K, dtype=dtype, device=_device(backend), requires_grad=True)
    before = _params_snapshot(layer)
    grad_x = _input_only(kind, layer(x, SIZES), x)
    layer.backward_dw()
    ref = reference_grads(x, w, b, SIZES, torch.ones(M, N, dtype=dtype))
    assert rel_err(grad_x, ref[1]) < _tol(backend)
    assert _same_snapshot(before, _params_snapshot(layer))
    assert not layer._pending_wgrads


@pytest.mark.parametrize("mode", ["delay", "fuse"])
def test_autograd_grad_over_a_weight_returns_it_and_writes_nothing(mode):
    layer = _layer(delay_wgrad_compute=mode == "delay", fuse_wgrad_accumulation=mode == "fuse")
    if mode == "fuse":
        _give_main_grads(layer, torch.float64)
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    x = torch.randn(M, K, dtype=torch.float64, requires_grad=True)
    g = torch.randn(M, N, dtype=torch.float64)
    before = _params_snapshot(layer)
    grad_x, grad_w = torch.autograd.grad(layer(x, SIZES), [x, layer.weight], g)
    layer.backward_dw()
    ref = reference_grads(x, w, b, SIZES, g)
    assert rel_err(grad_x, ref[1]) < 1e-12 and rel_err(grad_w, ref[2]) < 1e-12
    assert _same_snapshot(before, _params_snapshot(layer))


def test_a_backward_over_the_weight_only_leaves_the_bias_alone():
    layer = _layer(delay_wgrad_compute=True)
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    x = torch.randn(M, K, dtype=torch.float64, requires_grad=True)
    g = torch.randn(M, N, dtype=torch.float64)
    layer(x, SIZES).backward(g, inputs=[layer.weight])
    layer.backward_dw()
    assert layer.bias.grad is None and x.grad is None
    assert rel_err(layer.weight.grad, reference_grads(x, w, b, SIZES, g)[2]) < 1e-12


@pytest.mark.parametrize("backend, dtype", [("loop", torch.bfloat16), ("loop", torch.float16),
                                            ("grouped", torch.bfloat16),
                                            ("triton", torch.bfloat16), ("triton", torch.float16)])
@pytest.mark.parametrize("delay", [False, True])
def test_main_grad_accumulates_in_float32(backend, dtype, delay):
    """Several micro-batches of a half-precision layer into an fp32 ``main_grad``: within
    fp32 rounding of the float64 sum (weight gradients rounded to the parameter's dtype
    first are off by about 2^-9 of it)."""
    sizes = [200, 0, 180, 132]
    layer = gl.GroupedLinear(len(sizes), K, N, params_dtype=dtype, backend=backend,
                             device=_device(backend), fuse_wgrad_accumulation=True,
                             delay_wgrad_compute=delay)
    _give_main_grads(layer)
    torch.manual_seed(3)
    want = torch.zeros(len(sizes), N, K, dtype=torch.float64)
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    for _ in range(3):
        x = (torch.randn(sum(sizes), K) * 4).to(dtype).to(_device(backend))
        g = torch.randn(sum(sizes), N).to(dtype).to(_device(backend))
        layer(x, sizes).backward(g)
        want += reference_grads(x, w, b, sizes, g)[2]
    layer.backward_dw()
    got = layer.weight.main_grad
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("delay", [False, True])
def test_fp8_main_grad_is_not_rounded_to_the_parameter_dtype(delay):
    layer = gl.GroupedLinear(G, 64, 32, params_dtype=torch.bfloat16, recipe=Float8Rowwise(),
                             fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    _give_main_grads(layer)
    sizes = [40, 0, 75, 13]
    x = torch.randn(sum(sizes), 64).to(torch.bfloat16)
    g = torch.randn(sum(sizes), 32).to(torch.bfloat16)
    layer(x, sizes).backward(g)
    layer.backward_dw()
    got = layer.weight.main_grad
    want = reference_grads(x, layer.weight.detach(), layer.bias.detach(), sizes, g)[2]
    assert rel_err(got, want) < 6e-2
    assert not torch.equal(got, got.to(torch.bfloat16).float())  # not bf16 values


def test_an_overlapping_main_grad_is_rejected_before_anything_runs():
    layer = _layer(fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(1, 1, 1, dtype=torch.float64).expand(G, N, K)
    before = _params_snapshot(layer)
    with pytest.raises(ValueError, match=r"weight\.main_grad overlaps"):
        layer(torch.randn(M, K, dtype=torch.float64), SIZES)
    assert _same_snapshot(before, _params_snapshot(layer))
