"""The ``fp8_scaled_mm`` route's autograd function on any device: its quantization kernels
and its wgrad kernel (Triton, interpreted on CPU), torch's FP8 grouped GEMM (sm90 only)
replaced by that GEMM's dequantized float32 reference."""

import pytest
import torch

from grouped_linear.kernels.gemm import fp8_torch_gemm
from grouped_linear.ops.fp8 import Fp8Config, Fp8ScaledMMFunction
from grouped_linear.recipes import Float8Rowwise, Float8Tensorwise
from tests.reference import reference_grads, rel_err, saved_by

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [40, 0, 75, 13, 64]
K, N = 64, 48
RECIPES = [Float8Rowwise(), Float8Tensorwise(), Float8Tensorwise(power_of_two_scales=True)]


@pytest.fixture(autouse=True)
def dequantized_gemm(monkeypatch):
    """torch's FP8 grouped GEMM as its float32 reference of the dequantized operands."""
    def gemm(a, a_inv, b, b_inv, ends, out_dtype):
        return fp8_torch_gemm.dequantized_reference(a, a_inv, b, b_inv, ends).to(out_dtype)

    monkeypatch.setattr(fp8_torch_gemm, "forward", gemm)
    monkeypatch.setattr(fp8_torch_gemm, "dgrad", gemm)


def _leaves(dtype=torch.bfloat16, sizes=SIZES):
    torch.manual_seed(0)
    M, G = sum(sizes), len(sizes)
    x = torch.randn(M, K).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(G, N, K) / K ** 0.5).to(DEVICE, dtype).requires_grad_()
    b = torch.randn(G, N).to(DEVICE, dtype).requires_grad_()
    return x, w, b, torch.randn(M, N).to(DEVICE, dtype)


def _apply(x, w, b, recipe, weight_grad_ahead=True, save_original_input=False, sizes=SIZES):
    sizes = torch.tensor(sizes, device=DEVICE)
    ends = sizes.cumsum(0).to(torch.int32)
    config = Fp8Config(recipe, False, None, save_original_input)
    return Fp8ScaledMMFunction.apply(x, w, b, sizes, ends, config, None, weight_grad_ahead)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("save_original_input", [False, True])
def test_gradients_against_float64(recipe, save_original_input):
    """Every output and gradient within the FP8 bound of float64, whether backward folds x's
    factors into dy (x kept as FP8 codes, transposed) or quantizes the kept x again."""
    x, w, b, grad_out = _leaves()
    y = _apply(x, w, b, recipe, save_original_input=save_original_input)
    y.backward(grad_out)
    want = reference_grads(x, w, b, SIZES, grad_out)
    for name, got, ref in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), want):
        assert rel_err(got, ref) < 6e-2, (name, rel_err(got, ref))
    assert rel_err(w.grad, want[2]) > 1e-4  # it did quantize
    empty = [g for g, s in enumerate(SIZES) if s == 0]
    assert torch.all(w.grad[empty] == 0) and torch.all(b.grad[empty] == 0)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_backward_keeps_one_fp8_copy_of_x_in_the_wgrad_layout(recipe):
    """What backward keeps of ``x``: its FP8 codes in the token-contiguous layout the weight
    gradient reads (no row-major copy, not ``x`` itself), and nothing without a weight
    gradient ahead; the dgrad alone still works then."""
    x, w, b, grad_out = _leaves()
    for ahead in (True, False):
        saved, y = saved_by(lambda ahead=ahead: _apply(
            x, w.detach().requires_grad_(ahead), b, recipe, weight_grad_ahead=ahead))
        fp8 = [t for t in saved if t.dtype.itemsize == 1]
        assert not any(t is x or t.shape == x.shape for t in saved)
        if ahead:
            assert len(fp8) == 1 and fp8[0].shape[0] == K and fp8[0].shape[1] >= x.shape[0]
        else:
            assert not fp8
            dx, = torch.autograd.grad(y, x, grad_out)
            want = reference_grads(x, w, b, SIZES, grad_out)[1]
            assert rel_err(dx, want) < 6e-2


def test_weight_gradient_not_announced_by_the_forward_is_refused():
    """A weight gradient the forward was told would not come (nothing of x kept) raises
    instead of returning a wrong one."""
    x, w, b, grad_out = _leaves()
    y = _apply(x, w, b, Float8Rowwise(), weight_grad_ahead=False)
    with pytest.raises(RuntimeError, match="not expected by the forward"):
        y.backward(grad_out)


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_route_and_emulation_take_the_same_fp8_values(recipe):
    """The route and the emulation (``fp8_emulated``) scale every operand alike: their
    outputs and gradients differ only by accumulation order and bf16 rounding."""
    import grouped_linear as gl

    x, w, b, grad_out = _leaves()
    results = []
    for run in (lambda x, w, b: _apply(x, w, b, recipe),
                lambda x, w, b: gl.grouped_linear(x.cpu(), w.cpu(), b.cpu(), SIZES,
                                                  recipe=recipe)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = run(*leaves)
        y.backward(grad_out.to(y.device))
        results.append((y, *(t.grad for t in leaves)))
    for name, a, b_ in zip(("y", "dx", "dW", "db"), *results):
        assert rel_err(a, b_) < 1e-2, (name, rel_err(a, b_))


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
def test_input_major_weight_gets_its_gradient_in_its_own_layout(recipe):
    """A weight stored ``(G, K, N)`` and passed as its transposed view: its gradient reaches
    the stored parameter contiguous (computed as ``x^T dy`` per group, nothing to copy), and
    equals the contiguous weight's up to accumulation order; the input gradient too."""
    x, w, b, grad_out = _leaves()
    stored = w.detach().transpose(1, 2).contiguous().requires_grad_()
    layouts = []
    stored.register_hook(lambda grad: layouts.append(grad.is_contiguous()))
    results = []
    for weight in (stored.transpose(1, 2), w):
        xs = x.detach().clone().requires_grad_()
        _apply(xs, weight, b.detach(), recipe).backward(grad_out)
        results.append(xs.grad)
    assert layouts == [True]
    assert rel_err(stored.grad.transpose(1, 2), w.grad) < 1e-2
    assert rel_err(results[0], results[1]) < 1e-2
    assert rel_err(stored.grad.transpose(1, 2), reference_grads(x, w, b, SIZES, grad_out)[2]) \
        < 6e-2


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_recomputes_what_backward_keeps(reentrant, monkeypatch):
    """The route under ``torch.utils.checkpoint``: the reentrant form runs the forward without
    grad (nothing of x kept, as ``weight_grad_ahead`` says) and again in backward with grad;
    the gradients equal the plain call's bit for bit."""
    import importlib

    import grouped_linear as gl

    ops = importlib.import_module("grouped_linear.ops.grouped_linear")
    monkeypatch.setattr(ops, "choose_route", lambda *args: "fp8_scaled_mm")
    x, w, b, grad_out = _leaves()
    recipe = Float8Rowwise()
    results = []
    for checkpointed in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]

        def layer(x, w, b):
            return gl.grouped_linear(x, w, b, SIZES, recipe=recipe)

        y = (torch.utils.checkpoint.checkpoint(layer, *leaves, use_reentrant=reentrant)
             if checkpointed else layer(*leaves))
        y.backward(grad_out)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for plain, checkpointed in zip(*results, strict=True):
        assert torch.equal(plain, checkpointed)
    want = reference_grads(x, w, b, SIZES, grad_out)
    assert rel_err(results[1][2], want[2]) < 6e-2


def test_gluon_kernels_take_the_operands_they_support(monkeypatch):
    """Where the Gluon kernels take the operands (sm90) the forward (with the bias) and dgrad
    run the rowwise Gluon GEMM and the wgrad the group-scaled Gluon one (stood in for here by
    the references of the same contract: the bias added before the one rounding); the
    gradients are those of the other path, the output within that path's second rounding."""
    from grouped_linear.kernels.gemm import fp8_gluon_gemm, fp8_gluon_wgrad
    from grouped_linear.kernels.gemm import fp8_triton_gemm as fg

    x, w, b, grad_out = _leaves()
    want = _apply(x, w, b, Float8Rowwise())
    want.backward(grad_out)
    want_grads = [t.grad for t in (x, w, b)]
    calls = []

    def gluon_mm(a, a_inv, b_, b_inv, ends, out_dtype, bias=None):
        calls.append("mm" if bias is None else "mm+bias")
        out = fp8_torch_gemm.dequantized_reference(a, a_inv, b_, b_inv, ends)
        if bias is not None:
            out += torch.repeat_interleave(bias.float(), torch.tensor(SIZES, device=bias.device),
                                           dim=0)
        return out.to(out_dtype)

    def gluon_wgrad(*args, **kwargs):
        calls.append("wgrad")
        return fg.blockwise_wgrad(*args, **kwargs)

    monkeypatch.setattr(fp8_gluon_gemm, "rowwise_supported", lambda a, b_: True)
    monkeypatch.setattr(fp8_gluon_gemm, "rowwise_mm", gluon_mm)
    monkeypatch.setattr(fp8_gluon_wgrad, "wgrad_supported", lambda *args: True)
    monkeypatch.setattr(fp8_gluon_wgrad, "blockwise_wgrad", gluon_wgrad)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    got = _apply(*leaves, Float8Rowwise())
    got.backward(grad_out)
    assert calls == ["mm+bias", "mm", "wgrad"]
    assert rel_err(got, want) < 4e-3  # bf16: the other path rounds before the bias too
    for a, b_ in zip((t.grad for t in leaves), want_grads):
        assert torch.equal(a, b_)
