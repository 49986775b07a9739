"""CUDA paths of the grouped linear layer (run by ``make test-gpu``)."""

import contextlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels.gemm import gluon_gemm, gluon_wgrad, triton_gemm
from grouped_linear.ops.dispatch import fp8_route, resolve_backend
from tests.hardware import sm90
from tests.reference import gathered_reference, reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [300, 0, 1, 517, 64, 0, 129, 1000]  # unaligned, empty groups
K, N = 256, 384


@contextlib.contextmanager
def no_host_sync():
    """Any host synchronization inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _inputs(dtype, rows, bias=True):
    G = len(SIZES)
    x = torch.randn(rows, K, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda", dtype=dtype) / K ** 0.5).requires_grad_()
    b = torch.randn(G, N, device="cuda", dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


@pytest.mark.parametrize("backend", ["auto", "grouped", "triton"])
@pytest.mark.parametrize("tail", [0, 37])
def test_bf16_device_splits_no_sync_and_correct(backend, tail):
    """bf16 forward+backward with CUDA splits: no host sync, zero tail rows, <1e-2 error."""
    rows = sum(SIZES) + tail
    x, w, b = _inputs(torch.bfloat16, rows)
    splits = torch.tensor(SIZES, device="cuda")
    grad_out = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    grad_out[sum(SIZES):] = 1.0
    x.grad = None
    with no_host_sync():
        y = gl.grouped_linear(x, w, b, splits, backend=backend)
        y.backward(grad_out)
    ref = reference_grads(x, w, b, SIZES, grad_out)
    for name, got, want in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 1e-2, (name, rel_err(got, want))
    assert torch.all(y[sum(SIZES):] == 0) and torch.all(x.grad[sum(SIZES):] == 0)
    for g in (1, 5):
        assert torch.all(w.grad[g] == 0) and torch.all(b.grad[g] == 0)


def test_module_and_mlp_no_sync_with_device_splits():
    layer = gl.GroupedLinear(len(SIZES), K, N, params_dtype=torch.bfloat16, device="cuda")
    mlp = gl.GroupedMLP(len(SIZES), K, 128, params_dtype=torch.bfloat16, device="cuda")
    splits = torch.tensor(SIZES, device="cuda", dtype=torch.int32)
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with no_host_sync():
        layer(x, splits).sum().backward()
        mlp(x, splits).sum().backward()
    ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones(sum(SIZES), N))
    assert rel_err(layer.weight.grad, ref[2]) < 1e-2
    assert all(torch.isfinite(p.grad).all() for p in mlp.parameters())


def test_autocast_bf16_with_fp32_master_weights_no_sync():
    layer = gl.GroupedLinear(len(SIZES), K, N, device="cuda")
    splits = torch.tensor(SIZES, device="cuda")
    x = torch.randn(sum(SIZES), K, device="cuda")
    with no_host_sync(), torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x, splits)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.float32
    ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones(sum(SIZES), N))
    assert rel_err(y, ref[0]) < 1e-2 and rel_err(layer.weight.grad, ref[2]) < 1e-2


@pytest.mark.parametrize("backend", ["auto", "loop", "triton"])
@pytest.mark.parametrize("split_kind", ["list", "cuda"])
def test_fp32_tf32_off_matches_to_1e5(backend, split_kind):
    x, w, b = _inputs(torch.float32, sum(SIZES))
    splits = SIZES if split_kind == "list" else torch.tensor(SIZES, device="cuda")
    y = gl.grouped_linear(x, w, b, splits, backend=backend)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = reference_grads(x, w, b, SIZES, grad_out)
    for got, want in zip((y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 1e-5


def test_per_expert_layout_delay_and_main_grad_on_cuda():
    G = len(SIZES)
    layer = gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device="cuda",
                             single_grouped_weight=False, delay_wgrad_compute=True,
                             fuse_wgrad_accumulation=True)
    for i in range(G):
        p = getattr(layer, f"weight{i}")
        p.main_grad = torch.zeros(N, K, device="cuda", dtype=torch.float32)
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(sum(SIZES), N, device="cuda", dtype=torch.bfloat16)
    layer(x, torch.tensor(SIZES, device="cuda")).backward(grad_out)
    assert layer.weight0.main_grad.abs().sum() == 0
    layer.backward_dw()
    ref = reference_grads(x, layer.grouped_weight(), layer.grouped_bias(), SIZES, grad_out)
    main = torch.stack([getattr(layer, f"weight{i}").main_grad for i in range(G)])
    assert rel_err(main, ref[2]) < 1e-2
    assert layer.weight0.grad is None


@pytest.mark.parametrize("backend", ["grouped", "triton"])
def test_deterministic_on_cuda(backend):
    x, w, b = _inputs(torch.bfloat16, sum(SIZES))
    splits = torch.tensor(SIZES, device="cuda")
    grad_out = torch.randn(sum(SIZES), N, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        for t in (x, w, b):
            t.grad = None
        y = gl.grouped_linear(x, w, b, splits, backend=backend)
        y.backward(grad_out)
        runs.append([t.clone() for t in (y, x.grad, w.grad, b.grad)])
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


@pytest.mark.parametrize("backend", ["grouped", "triton"])
def test_bad_device_splits_never_read_out_of_bounds(backend):
    """Splits summing past M, or negative, are clamped on the device: finite, no crash."""
    x, w, b = _inputs(torch.bfloat16, 100)
    for bad in ([90, 0, 50, 7, 0, 0, 3, 400], [-5, 200, 0, 0, 0, 0, 0, 0]):
        y = gl.grouped_linear(x, w, b, torch.tensor(bad, device="cuda"), backend=backend)
        y.sum().backward()
        torch.cuda.synchronize()
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_debug_mode_validates_device_splits(monkeypatch):
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", "1")
    x, w, b = _inputs(torch.bfloat16, 10)
    with pytest.raises(ValueError, match=r"m_splits\[0\] is -1"):
        gl.grouped_linear(x, w, b, torch.tensor([-1, 11, 0, 0, 0, 0, 0, 0], device="cuda"))
    with pytest.raises(ValueError, match=r"m_splits sums to 12, more than the 10 input rows"):
        gl.grouped_linear(x, w, b, torch.tensor([12, 0, 0, 0, 0, 0, 0, 0], device="cuda"))


def test_list_input_on_cuda():
    pieces = [torch.randn(s, K, device="cuda", dtype=torch.bfloat16) for s in SIZES]
    _, w, b = _inputs(torch.bfloat16, 1)
    y = gl.grouped_linear(pieces, w, b, None)
    ref = reference_grads(torch.cat(pieces), w, b, SIZES, torch.ones(sum(SIZES), N))
    assert rel_err(y, ref[0]) < 1e-2


def test_mlp_recompute_activation_on_cuda_saves_memory_and_matches():
    torch.manual_seed(0)
    kwargs = {"params_dtype": torch.bfloat16, "device": "cuda"}
    plain = gl.GroupedMLP(4, 256, 512, **kwargs)
    lean = gl.GroupedMLP(4, 256, 512, recompute_activation=True, **kwargs)
    lean.load_state_dict(plain.state_dict())
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor([1000, 0, 2000, 1096], device="cuda")
    results, held = [], []
    for mlp in (plain, lean):
        xi = x.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = mlp(xi, splits)
        held.append(torch.cuda.memory_allocated() - before)  # output + saved for backward
        y.float().square().sum().backward()
        results.append((y, xi.grad, *(p.grad for p in mlp.parameters())))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    saved = 4096 * 512 * 2  # the (M, F) bf16 activation output no longer kept
    assert held[0] - held[1] >= saved, held


@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_backend_runs_the_gluon_kernels_on_hopper(monkeypatch, dtype, with_bias):
    """Forward, dgrad and weight gradient of the ``grouped`` backend go through the Gluon
    kernels (bias in the forward's epilogue, its gradient beside the weight's, tail rows
    zero) and match float64; an operand the GEMM cannot take (a reduction of 64, under its
    pipeline depth) goes to torch's GEMM with the same results; a frozen weight leaves
    the bias gradient to its own reduction. With every step in the Gluon kernels, fp16 too
    runs without a host sync (torch's fp16 grouped GEMM has one)."""
    calls = []
    gemm, wgrad = gluon_gemm.grouped_mm, gluon_wgrad.wgrad

    def counting_gemm(*args, **kwargs):
        calls.append("dgrad" if kwargs.get("transposed_weight", False) else "forward")
        return gemm(*args, **kwargs)

    def counting_wgrad(*args, **kwargs):
        calls.append("wgrad+bias" if args[3] else "wgrad")
        return wgrad(*args, **kwargs)

    monkeypatch.setattr(gluon_gemm, "grouped_mm", counting_gemm)
    monkeypatch.setattr(gluon_wgrad, "wgrad", counting_wgrad)
    tail = 21
    rows = sum(SIZES) + tail
    x, w, b = _inputs(dtype, rows, bias=with_bias)
    splits = torch.tensor(SIZES, device="cuda")
    grad_out = torch.randn(rows, N, device="cuda", dtype=dtype)

    def check(x, w, b, calls_wanted, sync_free=False):
        calls.clear()
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        with no_host_sync() if sync_free else contextlib.nullcontext():
            y = gl.grouped_linear(x, w, b, splits, backend="grouped")
            y.backward(grad_out)
        assert sorted(calls) == calls_wanted
        ref = reference_grads(x, w, b, SIZES, grad_out)
        grads = (y, x.grad, w.grad) + ((b.grad,) if b is not None else ())
        for name, got, want in zip(("y", "dx", "dW", "db"), grads, ref):
            if got is not None:
                assert got.dtype == dtype, (name, got.dtype)
                assert rel_err(got, want) < 1e-2, (name, rel_err(got, want))
        assert torch.all(y[sum(SIZES):] == 0) and torch.all(x.grad[sum(SIZES):] == 0)

    wgrad_call = "wgrad+bias" if with_bias else "wgrad"
    check(x, w, b, sorted(["dgrad", "forward", wgrad_call]), sync_free=True)
    narrow = torch.randn(rows, 64, device="cuda", dtype=dtype, requires_grad=True)
    w64 = torch.randn(len(SIZES), N, 64, device="cuda", dtype=dtype, requires_grad=True)
    # the forward's reduction (64) is under the GEMM's depth; the dgrad's and wgrad's are not
    check(narrow, w64, b, sorted(["dgrad", wgrad_call]))
    w.requires_grad_(False)
    check(x, w, b, ["dgrad", "forward"])
    assert w.grad is None


def _spread(rows: int, groups: int) -> list[int]:
    """``rows`` spread over ``groups`` (most of them empty when groups outnumber rows)."""
    sizes = [0] * groups
    for i in range(rows):
        sizes[(i * 7919) % groups] += 1
    return sizes


@pytest.mark.parametrize("groups", [1024, 1025, 4095, 4096, 65536])
@pytest.mark.parametrize("rows", [1000, 8192])  # either side of triton_auto_max_rows
@pytest.mark.parametrize("dtype, split_kind", [(torch.bfloat16, "list"),
                                               (torch.bfloat16, "cuda"),
                                               (torch.float16, "cuda")],
                         ids=["bf16-list", "bf16-cuda", "fp16-cuda"])
def test_auto_takes_more_groups_than_torch_grouped_gemm(groups, rows, dtype, split_kind):
    """torch's CUDA grouped GEMM refuses 1024 groups or more: ``auto`` runs the Triton
    kernels up to their 4095 groups (a group table of 4096 slots), the loop past them, and
    matches float64; empty groups' weight gradients are zero."""
    Kc, Nc = 64, 32
    want_route = "triton" if groups <= triton_gemm.MAX_GROUPS else "loop"
    assert resolve_backend("auto", torch.device("cuda"), dtype, Kc, Nc, rows,
                           groups) == want_route
    sizes = _spread(rows, groups)
    x = torch.randn(rows, Kc, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(groups, Nc, Kc, device="cuda") / Kc ** 0.5).to(dtype)
    b = torch.randn(groups, Nc, device="cuda", dtype=dtype)
    w.requires_grad_()
    b.requires_grad_()
    splits = sizes if split_kind == "list" else torch.tensor(sizes, device="cuda")
    y = gl.grouped_linear(x, w, b, splits)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = gathered_reference(x, w, b, sizes, grad_out)
    for name, got, want in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 1e-2, (name, rel_err(got, want))
    empty = torch.tensor(sizes, device="cuda") == 0
    assert torch.all(w.grad[empty] == 0) and torch.all(b.grad[empty] == 0)


def test_grouped_backend_up_to_torch_group_limit():
    """``backend="grouped"`` runs 1023 groups (the most torch's grouped GEMM takes; the Gluon
    GEMMs on Hopper) and names its limit at 1024."""
    G = 1023
    sizes = _spread(8192, G)
    x = torch.randn(8192, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(G, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(sizes, device="cuda")
    y = gl.grouped_linear(x, w, b, splits, backend="grouped")
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = reference_grads(x, w, b, sizes, grad_out)
    for name, got, want in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 1e-2, (name, rel_err(got, want))
    more = torch.zeros(1024, N, K, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"backend='grouped' takes at most 1023 groups"):
        gl.grouped_linear(x, more, None, torch.tensor(_spread(8192, 1024), device="cuda"),
                          backend="grouped")


_ROW, _BLOCK = gl.recipes.Float8Rowwise(), gl.recipes.Float8Blockwise()


@pytest.mark.parametrize("recipe, G, Kc, Nc, rows", [
    (_ROW, 1025, 128, 64, 4000),
    (_BLOCK, 1025, 128, 64, 4000),  # one 128-deep block: the Triton blockwise GEMMs
    (_BLOCK, 4095, 256, 256, 2000),  # the Gluon blockwise kernels on sm90, 4096-slot tables
    (_ROW, 4096, 128, 64, 4000),
    (_BLOCK, 4096, 128, 64, 4000),
    (_ROW, 65536, 32, 16, 4000),
    (_BLOCK, 65536, 32, 16, 4000),
], ids=lambda v: type(v).__name__ if isinstance(v, gl.recipes.Float8Recipe) else str(v))
def test_fp8_recipes_with_more_groups_than_torch_grouped_gemm(recipe, G, Kc, Nc, rows):
    """Rowwise past torch's FP8 grouped GEMM's groups runs the emulation, blockwise its own
    kernels up to their 4095 groups and the emulation past them; all within the FP8
    tolerance of float64, with empty groups' weight gradients zero."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 recipes need sm89+")
    blockwise = isinstance(recipe, gl.recipes.Float8Blockwise) and G <= triton_gemm.MAX_GROUPS
    assert fp8_route(recipe, torch.device("cuda"), torch.bfloat16, Kc, Nc, G, rows) == (
        "fp8_blockwise" if blockwise else "fp8_emulated")
    sizes = _spread(rows, G)
    x = torch.randn(rows, Kc, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, Nc, Kc, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    b = torch.randn(G, Nc, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(sizes, device="cuda")
    y = gl.grouped_linear(x, w, b, splits, recipe=recipe)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = gathered_reference(x, w, b, sizes, grad_out)
    for name, got, want in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 6e-2, (name, rel_err(got, want))
    empty = splits == 0
    assert torch.all(w.grad[empty] == 0) and torch.all(b.grad[empty] == 0)
