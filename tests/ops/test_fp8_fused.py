"""The ``fp8_fused`` route (small FP8 calls, one launch per GEMM) against the emulation of
the same recipe, through the public calls: outputs and every gradient, the module's weight
cache, stored FP8 weights, gradients routed into ``main_grad``, a retained graph; and where
the dispatch rule sends a call. The route is forced (the rule sends only CUDA calls to it);
on CPU its kernels run under Triton's interpreter."""

import importlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear import _tuning
from grouped_linear.ops.dispatch import TORCH_GROUPED_MAX_GROUPS, fp8_route
from grouped_linear.ops.fp8.primary import Float8WeightTensor
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import rel_err

ops_linear = importlib.import_module("grouped_linear.ops.grouped_linear")
RECIPES = [Float8Rowwise(), Float8Blockwise(), Float8Tensorwise(),
           Float8Rowwise(fp8_format="hybrid"), Float8Blockwise(power_of_two_scales=True),
           Float8Tensorwise(fp8_format="hybrid", power_of_two_scales=True)]
IDS = ["rowwise", "blockwise", "tensorwise", "rowwise-hybrid", "blockwise-pow2",
       "tensorwise-hybrid-pow2"]
SIZES = [9, 0, 140, 4]
G, K, N = len(SIZES), 160, 136
TOL = 1e-5  # the same FP8 values multiplied in float32 on both sides
# On a GPU the numerics test runs the kernels themselves (elsewhere here, on CPU tensors,
# the kernel module's references stand in for them, as under the interpreter the kernels).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def count_fused_calls(monkeypatch) -> list:
    """A list that grows by one at each forward of the fused route's function."""
    from grouped_linear.ops.fp8 import fused as fused_module

    calls = []
    real = fused_module.Fp8FusedFunction.forward

    def counting(ctx, *args):
        calls.append(1)
        return real(ctx, *args)

    monkeypatch.setattr(fused_module.Fp8FusedFunction, "forward", staticmethod(counting))
    return calls


@pytest.fixture
def fused(monkeypatch):
    """Every FP8 call in the test takes the fused route; returns a counter of its calls."""
    monkeypatch.setattr(ops_linear, "choose_route", lambda *args: "fp8_fused")
    return count_fused_calls(monkeypatch)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), K, generator=gen)
    w = torch.randn(G, N, K, generator=gen) * 0.05
    b = torch.randn(G, N, generator=gen)
    dy = torch.randn(sum(SIZES), N, generator=gen)
    return x, w, b, dy


def _step(x, w, b, dy, recipe, splits=SIZES, **kwargs):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = gl.grouped_linear(x, w, b, splits, recipe=recipe, **kwargs)
    y.backward(dy)
    return (y, x.grad, w.grad) + (() if b is None else (b.grad,))


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_the_emulation(recipe, bias, fused, monkeypatch):
    """Output, input, weight and bias gradients as the emulated route computes them; the
    empty expert's weight gradient zero (rows past the splits, which only device splits
    allow: tests/kernels/gemm/test_fp8_fused_gemm.py)."""
    x, w, b, dy = (t.to(DEVICE) for t in _inputs())
    splits = torch.tensor(SIZES)
    got = _step(x, w, b if bias else None, dy, recipe, splits)
    assert fused
    monkeypatch.setattr(ops_linear, "choose_route", lambda *args: "fp8_emulated")
    want = _step(x, w, b if bias else None, dy, recipe, splits)
    for name, a, c in zip(("y", "dx", "dw", "db"), got, want):
        assert rel_err(a, c) < TOL, name
    assert torch.all(got[2][1] == 0)


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
def test_bf16_within_the_recipes_tolerance_of_float64(recipe, fused):
    """bf16 operands: within FP8's tolerance of the float64 product (6e-2 per GEMM)."""
    x, w, b, dy = (t.bfloat16() for t in _inputs())
    y, dx, dw, db = _step(x, w, b, dy, recipe)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    start, want_y, want_dx, want_dw = 0, torch.zeros_like(y, dtype=torch.float64), \
        torch.zeros_like(x64), torch.zeros_like(w64)
    for g, size in enumerate(SIZES):
        rows = slice(start, start + size)
        want_y[rows] = x64[rows] @ w64[g].T + b[g].double()
        want_dx[rows] = dy64[rows] @ w64[g]
        want_dw[g] = dy64[rows].T @ x64[rows]
        start += size
    assert y.dtype == torch.bfloat16
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert rel_err(got, want) < 6e-2


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
def test_module_cache_and_stored_weights(recipe, fused):
    """A module's cached FP8 weight (``is_first_microbatch``) and an FP8 primary weight run
    the route on their codes: the same results as quantizing in the call."""
    torch.manual_seed(0)
    layer = gl.GroupedLinear(G, K, N, recipe=recipe)
    x, _, _, dy = _inputs()
    first = layer(x, SIZES, is_first_microbatch=True)
    assert layer._fp8_weights.entry.route == "fp8_fused"
    again = layer(x, SIZES, is_first_microbatch=False)
    plain = layer(x, SIZES)
    assert torch.equal(first, again) and torch.equal(first, plain)
    stored = gl.to_fp8_weights(layer)
    assert isinstance(stored.weight, Float8WeightTensor)
    out = stored(x, SIZES)
    out.backward(dy)
    assert torch.equal(out, first) and stored.weight.grad.shape == (G, N, K)


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
def test_main_grad_and_a_retained_graph(recipe, fused):
    """The weight gradient accumulated into a float32 ``main_grad`` (bias sums included),
    and a second backward of a retained graph giving the same gradients again."""
    torch.manual_seed(0)
    layer = gl.GroupedLinear(G, K, N, recipe=recipe, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(G, N, K)
    x, _, _, dy = _inputs()
    y = layer(x, SIZES)
    y.backward(dy, retain_graph=True)
    once = layer.weight.main_grad.clone()
    y.backward(dy)
    assert rel_err(layer.weight.main_grad, 2 * once) < 1e-6
    torch.manual_seed(0)
    plain = gl.GroupedLinear(G, K, N, recipe=recipe)
    plain(x, SIZES).backward(dy)
    assert rel_err(once, plain.weight.grad) < TOL


def test_without_a_weight_gradient_nothing_of_x_is_kept(fused):
    x, w, b, dy = _inputs()
    x.requires_grad_()
    y = gl.grouped_linear(x, w, None, SIZES, recipe=Float8Rowwise())  # w needs no grad
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert all(t.shape != x.shape for t in saved)
    y.backward(dy)
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.fp8_fused
def test_the_rule_sends_small_cuda_calls(monkeypatch):
    """Rows x in x out up to ``fp8_fused_max_work`` and groups x in x out up to
    ``fp8_fused_max_weights`` (blockwise: ``fp8_fused_max_block_weights``): ``fp8_fused``,
    for every recipe in bf16/fp16 on CUDA; float32, CPU, large calls, large weights or a
    call whose rows are not given (``num_rows=None``) take the other routes. Nothing runs
    (the device's capabilities are faked)."""
    from grouped_linear.kernels.gemm import fp8_torch_gemm
    from grouped_linear.ops import dispatch

    for recipe in (Float8Rowwise(), Float8Blockwise(), Float8Tensorwise()):
        assert fp8_route(recipe, torch.device("cpu"), torch.bfloat16, 2048, 768, 64,
                         8) == "fp8_emulated"
    monkeypatch.setattr(fp8_torch_gemm, "available", lambda device: True)
    monkeypatch.setattr(fp8_torch_gemm, "gemm_accepts", lambda *args: True)
    monkeypatch.setattr(dispatch, "_fp8_gemms_on", lambda device: True)
    cuda0 = torch.device("cuda", 0)
    tuning = _tuning.current()
    rows = tuning.fp8_fused_max_work // (2048 * 768)
    for recipe in (Float8Rowwise(), Float8Blockwise(), Float8Tensorwise()):
        weights = (tuning.fp8_fused_max_block_weights if isinstance(recipe, Float8Blockwise)
                   else tuning.fp8_fused_max_weights)
        groups = weights // (2048 * 768)  # the most groups of this size the rule takes
        assert 8 <= groups < 4095
        for dtype in (torch.bfloat16, torch.float16):
            assert fp8_route(recipe, cuda0, dtype, 2048, 768, groups, rows) == "fp8_fused"
        for G, M in ((groups, rows + 1), (groups + 1, 8)):
            assert fp8_route(recipe, cuda0, torch.bfloat16, 2048, 768, G, M) != "fp8_fused"
        assert fp8_route(recipe, cuda0, torch.bfloat16, 2048, 768, 8) != "fp8_fused"
        assert fp8_route(recipe, cuda0, torch.float32, 2048, 768, 8, 8) != "fp8_fused"
        with _tuning.override(fp8_fused_max_work=0):
            assert fp8_route(recipe, cuda0, torch.bfloat16, 2048, 768, 8, 8) != "fp8_fused"
        # past the weight bound, where no FP8 GEMM route takes the call (fp16 input; more
        # groups than torch's grouped GEMMs take): still fused, not the emulation
        assert fp8_route(recipe, cuda0, torch.float16, 2048, 768, groups + 1, 8) == "fp8_fused"
        many = 2 * TORCH_GROUPED_MAX_GROUPS
        assert fp8_route(recipe, cuda0, torch.bfloat16, 2048, 768, many, 8) == (
            "fp8_blockwise" if isinstance(recipe, Float8Blockwise) else "fp8_fused")
