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


@pytest.mark.parametrize("backend", ["loop", "grouped", "triton"])
@pytest.mark.parametrize("main_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("delay", [False, True])
def test_a_narrower_main_grad_gets_the_gradient_rounded_once(backend, main_dtype, delay):
    """An fp32 layer fusing into an fp16 / bf16 ``main_grad``: the gradient is computed in
    fp32 and rounded once into it, equal to the float64 gradient so rounded; operands
    rounded to ``main_grad``'s dtype first (1e4 and 1e-8 in fp16: 0 and inf) would not be."""
    sizes = [3, 0, 5]
    layer = gl.GroupedLinear(len(sizes), 8, 4, bias=False, backend=backend,
                             device=_device(backend), fuse_wgrad_accumulation=True,
                             delay_wgrad_compute=delay)
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=main_dtype,
                                         device=_device(backend))
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(sum(sizes), 8, generator=gen) + 0.5) * 1e4
    g = (torch.rand(sum(sizes), 4, generator=gen) + 0.5) * 1e-8
    layer(x.to(_device(backend)), sizes).backward(g.to(_device(backend)))
    layer.backward_dw()
    w = layer.weight.detach().cpu().double()
    want = reference_grads(x.double(), w, None, sizes, g.double())[2]
    got = layer.weight.main_grad.cpu()
    assert got.dtype == main_dtype and bool(got[0].ne(0).all())
    # rounded once: within half a step of main_grad's dtype (any summation order)
    half_step = 0.51 * torch.finfo(main_dtype).eps
    assert torch.allclose(got.double(), want, rtol=half_step, atol=0)


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


# ------------------------------------------------ Megatron-Core's attributes on the weights
def _two_steps(layer, dtype, device, recipe_tol=None):
    """Two forward+backward passes (``backward_dw`` after both); their float64 references."""
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    refs = []
    for _ in range(2):
        x = torch.randn(M, K, device=device).to(dtype)
        g = torch.randn(M, N, device=device).to(dtype)
        layer(x, SIZES).backward(g)
        refs.append(reference_grads(x, w, b, SIZES, g))
    layer.backward_dw()
    return refs


@pytest.mark.parametrize("backend", BACKENDS + ["fp8"])
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_overwrite_main_grad_keeps_only_the_last_gradient(backend, single, delay, overwrite):
    fp8 = backend == "fp8"
    dtype = torch.bfloat16 if fp8 else _dtype(backend)
    layer = (gl.GroupedLinear(G, K, N, params_dtype=dtype, recipe=Float8Rowwise(),
                              single_grouped_weight=single, delay_wgrad_compute=delay,
                              fuse_wgrad_accumulation=True) if fp8 else
             _layer(backend, single_grouped_weight=single, delay_wgrad_compute=delay,
                    fuse_wgrad_accumulation=True))
    device = "cpu" if fp8 else _device(backend)
    main_dtype = torch.float32 if fp8 else dtype
    start = torch.randn(G, N, K, dtype=main_dtype, device=device)
    for p, piece in zip(_weights(layer), start if not single else [start]):
        p.main_grad = piece.clone().reshape(p.shape)
        p.overwrite_main_grad = overwrite
    refs = _two_steps(layer, dtype, device)
    want = refs[1][2] if overwrite else start.double().cpu() + refs[0][2] + refs[1][2]
    tol = 6e-2 if fp8 else _tol(backend)
    assert rel_err(_main_grad(layer), want) < tol
    assert all(p.grad is None for p in _weights(layer))
    assert rel_err(layer.bias.grad, refs[0][3] + refs[1][3]) < tol  # the bias accumulates


@pytest.mark.parametrize("delay", [False, True])
def test_each_expert_weight_follows_its_own_overwrite_main_grad(delay):
    layer = _layer(single_grouped_weight=False, delay_wgrad_compute=delay,
                   fuse_wgrad_accumulation=True)
    _give_main_grads(layer, torch.float64)
    _weights(layer)[2].overwrite_main_grad = True
    refs = _two_steps(layer, torch.float64, "cpu")
    total = refs[0][2] + refs[1][2]
    for i, p in enumerate(_weights(layer)):
        assert rel_err(p.main_grad, refs[1][2][i] if i == 2 else total[i]) < 1e-12


def _record_autograd_grads(weights):
    """What autograd hands each weight (tensor hooks see it before it is accumulated)."""
    seen = {i: [] for i in range(len(weights))}
    for i, p in enumerate(weights):
        p.register_hook(lambda grad, i=i: seen[i].append(None if grad is None else grad.clone()))
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("delay", [False, True])
def test_zero_out_wgrad_hands_autograd_zeros(backend, single, delay):
    layer = _layer(backend, single_grouped_weight=single, delay_wgrad_compute=delay,
                   fuse_wgrad_accumulation=True)
    _give_main_grads(layer, _dtype(backend))
    for p in _weights(layer):
        p.zero_out_wgrad = True
    seen = _record_autograd_grads(_weights(layer))
    refs = _two_steps(layer, _dtype(backend), _device(backend))
    for i, p in enumerate(_weights(layer)):
        assert len(seen[i]) == 2
        assert all(g.shape == p.shape and g.dtype == p.dtype and not g.any() for g in seen[i])
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()
        assert not hasattr(p, "grad_added_to_main_grad")
    assert rel_err(_main_grad(layer), refs[0][2] + refs[1][2]) < _tol(backend)


@pytest.mark.parametrize("single", [True, False])
def test_without_the_attributes_autograd_gets_no_weight_gradient(single):
    layer = _layer(single_grouped_weight=single, fuse_wgrad_accumulation=True)
    _give_main_grads(layer, torch.float64)
    seen = _record_autograd_grads(_weights(layer))
    refs = _two_steps(layer, torch.float64, "cpu")
    assert all(grads in ([], [None, None]) for grads in seen.values())
    assert all(p.grad is None for p in _weights(layer))
    assert rel_err(_main_grad(layer), refs[0][2] + refs[1][2]) < 1e-12


def _megatron_ddp_hooks(weights, calls, accumulators):
    """Megatron-Core DDP's hook on each weight's gradient accumulator (overlap_grad_reduce):
    a ``.grad`` must be there; it is added into ``main_grad`` unless the layer already wrote
    there (or zero_out_wgrad asks), then dropped."""
    for p in weights:
        p.grad_added_to_main_grad = False

        def hook(*_, p=p):
            assert p.grad is not None
            calls.append((p.grad.shape, p.grad.dtype, p.grad_added_to_main_grad))
            if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
                p.main_grad.add_(p.grad)
            p.grad = None
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
        accumulator.register_hook(hook)
        accumulators.append(accumulator)  # kept alive, as DDP keeps them


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("zero_out", [False, True])
def test_megatron_ddp_hooks_find_a_placeholder_and_skip_it(single, delay, zero_out):
    layer = _layer(single_grouped_weight=single, delay_wgrad_compute=delay,
                   fuse_wgrad_accumulation=True)
    _give_main_grads(layer, torch.float64)
    calls, accumulators = [], []
    _megatron_ddp_hooks(_weights(layer), calls, accumulators)
    for p in _weights(layer):
        p.zero_out_wgrad = zero_out
    refs = _two_steps(layer, torch.float64, "cpu")
    assert calls == [(p.shape, p.dtype, True) for _ in range(2) for p in _weights(layer)]
    assert all(p.grad_added_to_main_grad and p.grad is None for p in _weights(layer))
    assert rel_err(_main_grad(layer), refs[0][2] + refs[1][2]) < 1e-12


def test_experts_of_which_only_some_carry_the_flag_get_zeros():
    layer = _layer(single_grouped_weight=False, fuse_wgrad_accumulation=True)
    _give_main_grads(layer, torch.float64)
    _weights(layer)[0].grad_added_to_main_grad = False
    _two_steps(layer, torch.float64, "cpu")
    assert _weights(layer)[0].grad_added_to_main_grad
    assert not any(hasattr(p, "grad_added_to_main_grad") for p in _weights(layer)[1:])
    assert all(p.grad is not None and not p.grad.any() for p in _weights(layer))


@pytest.mark.parametrize("flag", ["overwrite_main_grad", "zero_out_wgrad"])
@pytest.mark.parametrize("single", [True, False])
def test_a_flag_that_is_not_a_bool_is_rejected_before_anything_runs(flag, single):
    layer = _layer(single_grouped_weight=single, delay_wgrad_compute=True,
                   fuse_wgrad_accumulation=True)
    _give_main_grads(layer, torch.float64)
    setattr(_weights(layer)[-1], flag, 1)
    name = "weight" if single else f"weight{G - 1}"
    before = _params_snapshot(layer)
    with pytest.raises(TypeError, match=rf"{name}\.{flag} must be a bool, got 1"):
        layer(torch.randn(M, K, dtype=torch.float64), SIZES)
    assert _same_snapshot(before, _params_snapshot(layer)) and not layer._pending_wgrads


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("fuse", [False, True])
def test_a_delayed_bias_waits_for_backward_dw_with_the_weight_frozen(single, fuse):
    """``delay_wgrad_compute`` with a frozen weight and a trained bias: backward leaves the
    bias gradient to ``backward_dw`` (nothing queued for the weight, no ``main_grad``
    needed for it), which gives the float64 reference's."""
    layer = _layer(delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse,
                   single_grouped_weight=single, single_grouped_bias=single)
    for weight in _weights(layer):
        weight.requires_grad_(False)
    x = torch.randn(sum(SIZES), K, dtype=_dtype("loop"), requires_grad=True)
    g = torch.randn(sum(SIZES), N, dtype=x.dtype)
    layer(x, SIZES).backward(g)
    biases = [layer.bias] if single else [getattr(layer, f"bias{i}") for i in range(G)]
    assert all(b.grad is None for b in biases) and x.grad is not None
    layer.backward_dw()
    want = reference_grads(x, layer.grouped_weight().detach(), layer.grouped_bias().detach(),
                           SIZES, g)[3]
    got = layer.bias.grad if single else torch.stack([b.grad for b in biases])
    assert rel_err(got, want) < 1e-12
    assert all(w.grad is None for w in _weights(layer))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["delay", "fuse", "both"])
@pytest.mark.parametrize("pick", ["frozen", "inputs"])
def test_per_expert_parameters_get_only_the_gradients_autograd_asks_for(backend, mode, pick):
    """Per-expert parameters with a sink: an expert frozen (``requires_grad=False``, without a
    ``main_grad``) or left out of ``backward(inputs=)`` gets nothing (no ``.grad``, its
    ``main_grad`` untouched); the others get the float64 reference's gradients."""
    dtype = _dtype(backend)
    layer = _layer(backend, delay_wgrad_compute=mode != "fuse",
                   fuse_wgrad_accumulation=mode != "delay", single_grouped_weight=False,
                   single_grouped_bias=False)
    weights = _weights(layer)
    biases = [getattr(layer, f"bias{i}") for i in range(G)]
    skipped = {1, 3}  # expert 1 has rows (5, 0, 9, 6), expert 3 too
    if pick == "frozen":
        for i in skipped:
            weights[i].requires_grad_(False)
            biases[i].requires_grad_(False)
    for i, p in enumerate(weights):
        if mode != "delay" and i not in skipped:
            p.main_grad = torch.zeros_like(p, dtype=dtype)
        elif mode != "delay" and pick == "inputs":  # frozen ones have none
            p.main_grad = torch.full_like(p, 7.0)  # untouched below
    w, b = layer.grouped_weight().detach(), layer.grouped_bias().detach()
    x = torch.randn(M, K, dtype=dtype, device=_device(backend), requires_grad=True)
    g = torch.randn(M, N, dtype=dtype, device=x.device)
    wanted = [i for i in range(G) if i not in skipped]
    inputs = [x] + [weights[i] for i in wanted] + [biases[i] for i in wanted]
    layer(x, SIZES).backward(g, inputs=inputs if pick == "inputs" else None)
    layer.backward_dw()
    ref = reference_grads(x, w, b, SIZES, g)
    assert rel_err(x.grad, ref[1]) < _tol(backend)
    for i in range(G):
        if i in skipped:
            assert weights[i].grad is None and biases[i].grad is None
            if mode != "delay" and pick == "inputs":
                assert torch.equal(weights[i].main_grad, torch.full_like(weights[i], 7.0))
        else:
            got_w = weights[i].main_grad if mode != "delay" else weights[i].grad
            assert rel_err(got_w, ref[2][i]) < _tol(backend)
            assert rel_err(biases[i].grad, ref[3][i]) < _tol(backend)
