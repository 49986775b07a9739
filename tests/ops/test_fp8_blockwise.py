"""The block-scaled FP8 path built on the Triton kernels (interpreted on CPU) against the
emulation of the same recipe, which the numerics tests check against float64."""

import pytest
import torch

from grouped_linear.ops.fp8 import (
    Fp8BlockwiseFunction,
    Fp8Config,
    Fp8EmulatedFunction,
    Fp8Weight,
)
from grouped_linear.recipes import Float8Blockwise
from tests.reference import rel_err, saved_by

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 2e-3  # FP8 tensor cores accumulate with fewer bits


def _run(function, x, w, b, sizes, tail, recipe, cached=None, x_grad=True, w_grad=True):
    x = x.detach().clone().requires_grad_(x_grad)
    w = w.detach().clone().requires_grad_(w_grad)
    b = b.detach().clone().requires_grad_()
    size_tensor = torch.tensor(sizes, device=DEVICE)
    ends = size_tensor.cumsum(0).to(torch.int32)
    config = Fp8Config(recipe, tail > 0, None)
    if function is Fp8BlockwiseFunction:
        y = function.apply(x, w, b, size_tensor, ends, config, cached, w_grad)
    else:
        y = function.apply(x, w, b, ends, config, None)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, y.dtype)
    y.backward(grad)
    return y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("sizes, tail", [([70, 0, 133, 1], 9), ([200], 0), ([0, 0], 5)])
@pytest.mark.parametrize("pow2", [False, True])
def test_triton_blockwise_matches_the_emulation(sizes, tail, pow2):
    G, K, N = len(sizes), 200, 136
    M = sum(sizes) + tail
    recipe = Float8Blockwise(power_of_two_scales=pow2)
    x = (torch.randn(M, K) * torch.logspace(-2, 2, K)).to(DEVICE)
    w = (torch.randn(G, N, K) / 16).to(DEVICE)
    b = torch.randn(G, N).to(DEVICE)
    got = _run(Fp8BlockwiseFunction, x, w, b, sizes, tail, recipe)
    want = _run(Fp8EmulatedFunction, x, w, b, sizes, tail, recipe)
    for name, a, c in zip(("y", "dx", "dW", "db"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, c) < TOL, (name, rel_err(a, c))
    assert torch.all(got[0][sum(sizes):] == 0) and torch.all(got[1][sum(sizes):] == 0)


def test_triton_blockwise_uses_the_cached_weight():
    recipe = Float8Blockwise()
    sizes, K, N = [40, 24], 128, 128
    x = torch.randn(64, K).to(DEVICE)
    w = torch.randn(2, N, K).to(DEVICE)
    b = torch.zeros(2, N).to(DEVICE)
    cache = Fp8Weight(w, recipe, "fp8_blockwise")
    assert cache.forward_inv.shape == (2, 1, 1)
    fresh = _run(Fp8BlockwiseFunction, x, w, b, sizes, 0, recipe)
    cached = _run(Fp8BlockwiseFunction, x, w, b, sizes, 0, recipe, cache)
    assert torch.equal(fresh[0], cached[0])
    stale = _run(Fp8BlockwiseFunction, x, w * 2, b, sizes, 0, recipe, cache)
    assert torch.equal(stale[0], fresh[0])  # the forward reads the cache, not the weight


@pytest.mark.parametrize("x_grad, w_grad", [(True, False), (False, True)])
def test_triton_blockwise_with_one_operand_frozen(x_grad, w_grad):
    """Only the gradient asked for, each against the emulation (a frozen weight: each operand
    quantized into the one layout its GEMM reads)."""
    sizes, tail, K, N = [70, 0, 133], 9, 200, 136
    recipe = Float8Blockwise()
    x = torch.randn(sum(sizes) + tail, K).to(DEVICE)
    w = (torch.randn(len(sizes), N, K) / 16).to(DEVICE)
    b = torch.randn(len(sizes), N).to(DEVICE)
    got = _run(Fp8BlockwiseFunction, x, w, b, sizes, tail, recipe, x_grad=x_grad, w_grad=w_grad)
    want = _run(Fp8EmulatedFunction, x, w, b, sizes, tail, recipe)
    assert (got[1] is None) != x_grad and (got[2] is None) != w_grad
    for name, a, c in zip(("y", "dx", "dW", "db"), got, want):
        if a is not None:
            assert rel_err(a, c) < TOL, (name, rel_err(a, c))


def test_one_read_keeps_fp8_blocks_of_x_instead_of_x():
    """Where the weight's gradient may be wanted the forward saves x's FP8 token blocks (both
    layouts from one read), not x; where it cannot be, x itself (the dgrad needs nothing)."""
    sizes, K, N = [70, 60], 256, 128
    x = torch.randn(130, K, device=DEVICE, requires_grad=True)
    w = torch.randn(2, N, K, device=DEVICE, requires_grad=True)
    size_tensor = torch.tensor(sizes, device=DEVICE)
    config = Fp8Config(Float8Blockwise(), False, None)
    y = Fp8BlockwiseFunction.apply(x, w, None, size_tensor, size_tensor.cumsum(0).int(), config,
                                   None, True)
    saved = y.grad_fn.saved_tensors
    assert saved[0] is None and saved[1].dtype == torch.float8_e4m3fn
    assert saved[1].shape == (K, (-(-130 // 128) + 2) * 128)
    y = Fp8BlockwiseFunction.apply(x, w, None, size_tensor, size_tensor.cumsum(0).int(), config,
                                   None, False)
    assert y.grad_fn.saved_tensors[0] is x and y.grad_fn.saved_tensors[1] is None


def test_input_major_weight_gets_its_gradient_in_its_own_layout():
    """A weight stored ``(G, K, N)`` and passed as its transposed view: its gradient reaches
    the stored parameter contiguous (``x^T dy`` per group, nothing to copy) and equals the
    contiguous weight's up to accumulation order."""
    sizes, K, N = [70, 0, 133, 1], 256, 128
    torch.manual_seed(5)
    x = torch.randn(sum(sizes), K).to(DEVICE, torch.bfloat16)
    w = (torch.randn(len(sizes), N, K) / 16).to(DEVICE, torch.bfloat16)
    grad = torch.randn(sum(sizes), N).to(DEVICE, torch.bfloat16)
    size_tensor = torch.tensor(sizes, device=DEVICE)
    config = Fp8Config(Float8Blockwise(), False, None)
    stored = w.transpose(1, 2).contiguous().requires_grad_()
    layouts = []
    stored.register_hook(lambda g: layouts.append(g.is_contiguous()))
    grads = []
    for weight in (stored.transpose(1, 2), w.clone().requires_grad_()):
        Fp8BlockwiseFunction.apply(x, weight, None, size_tensor,
                                   size_tensor.cumsum(0).to(torch.int32), config, None,
                                   True).backward(grad)
        grads.append(weight.grad if weight.is_leaf else stored.grad.transpose(1, 2))
    assert layouts == [True]
    assert rel_err(grads[0], grads[1]) < 1e-2


def test_save_original_input_keeps_x_and_the_default_numerics():
    """With ``save_original_input`` the forward keeps ``x`` itself (no FP8 token blocks) and
    backward quantizes it again: the output and every gradient equal the default path's bit
    for bit (the same blocks of the same values), and the emulation's within its bound."""
    sizes, tail, K, N = [70, 0, 133, 1], 9, 200, 136
    recipe = Float8Blockwise()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(sizes) + tail, K, generator=gen).to(DEVICE)
    w = (torch.randn(len(sizes), N, K, generator=gen) / 16).to(DEVICE)
    b = torch.randn(len(sizes), N, generator=gen).to(DEVICE)
    grad = torch.randn(sum(sizes) + tail, N, generator=gen).to(DEVICE)
    size_tensor = torch.tensor(sizes, device=DEVICE)
    ends = size_tensor.cumsum(0).to(torch.int32)
    results = {}
    for keep in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        config = Fp8Config(recipe, True, None, keep)
        saved, y = saved_by(lambda leaves=leaves, config=config: Fp8BlockwiseFunction.apply(
            *leaves, size_tensor, ends, config, None, True))
        y.backward(grad)
        kept_x = any(t is not None and t.data_ptr() == leaves[0].data_ptr() for t in saved)
        fp8 = [t for t in saved if t is not None and t.dtype == recipe.forward_dtype]
        assert kept_x == keep and bool(fp8) != keep, keep
        results[keep] = (y.detach(), *(t.grad for t in leaves))
    xe, we, be = (t.clone().requires_grad_() for t in (x, w, b))
    ye = Fp8EmulatedFunction.apply(xe, we, be, ends, Fp8Config(recipe, True, None), None)
    ye.backward(grad)
    for name, kept, default, emulated in zip(("y", "dx", "dW", "db"), results[True],
                                             results[False], (ye, xe.grad, we.grad, be.grad)):
        assert torch.equal(kept, default), name
        assert rel_err(kept, emulated) < TOL, (name, rel_err(kept, emulated))
