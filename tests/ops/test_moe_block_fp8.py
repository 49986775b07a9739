"""A whole MoE block (``permute`` given the recipe -> ``GroupedMLP`` -> ``unpermute``) under
each FP8 recipe against the same block in float64: empty experts, dropped slots, zero and
large activations. On CPU the recipes run their emulation; on CUDA (``make test-gpu``) the
device routes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import grouped_linear as gl
from tests.reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]
E, H, FFN, TOKENS, K = 6, 128, 96, 40, 2
BOUND = 7e-2  # the block's output and input gradient against float64
# With activations 30x-3000x larger the input gradient drifts further from float64 (0.09-0.14
# for every recipe; the output stays within BOUND). The cause is the forward's quantization,
# not the backward's: SwiGLU's derivative is taken at fc1's FP8-computed pre-activation, and
# once the gates are large its sigmoid switches within the FP8 error, so the gates nearest
# zero get a derivative of the wrong side (a float64 emulation with only x and W1 quantized
# gives 0.09 at 300x against 0.03 at 1x). Bounded here so that a change that makes it worse
# fails.
LARGE_DX_BOUND = 0.2


def _block(scale: float, zero_tokens: bool, seed: int = 0):
    """Module, tokens, routing (expert 1 never chosen, some slots dropped), probs, grad."""
    gen = torch.Generator().manual_seed(seed)
    mlp = gl.GroupedMLP(E, H, FFN, activation="swiglu", bias=False,
                        params_dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * H ** -0.5)
    x = torch.randn(TOKENS, H, generator=gen) * scale
    if zero_tokens:
        x[::5] = 0
    choices = torch.tensor([e for e in range(E) if e != 1])
    index = choices[torch.stack([torch.randperm(len(choices), generator=gen)[:K]
                                 for _ in range(TOKENS)])]
    index[::7, 1] = -1  # dropped slots
    probs = torch.rand(TOKENS, K, generator=gen).softmax(-1)
    grad = torch.randn(TOKENS, H, generator=gen)
    return (mlp, x.to(DEVICE, torch.bfloat16).requires_grad_(), index.to(DEVICE),
            probs.to(DEVICE).requires_grad_(), grad.to(DEVICE, torch.bfloat16))


def _run(mlp, x, index, probs, grad, recipe):
    with gl.autocast(recipe):
        rows, m_splits, row_map = gl.permute(x, index, E, recipe=recipe)
        out = gl.unpermute(mlp(rows, m_splits), row_map, probs)
    out.backward(grad)
    return out


def _reference(mlp, x, index, probs, grad):
    """Output and input gradient of the block in float64, one expert at a time."""
    w1 = mlp.fc1.weight.detach().double().cpu()
    w2 = mlp.fc2.weight.detach().double().cpu()
    x64 = x.detach().double().cpu().requires_grad_()
    index, probs = index.cpu(), probs.detach().double().cpu()
    out = torch.zeros_like(x64)
    for e in range(E):
        token, slot = (index == e).nonzero(as_tuple=True)
        rows = x64[token]
        h = (F.silu(rows @ w1[e, :FFN].T) * (rows @ w1[e, FFN:].T)) @ w2[e].T
        out = out.index_add(0, token, probs[token, slot, None] * h)
    out.backward(grad.double().cpu())
    return out.detach(), x64.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("scale, zero_tokens", [(1.0, False), (1.0, True), (3e3, True)],
                         ids=["plain", "zero tokens", "large"])
def test_fp8_block_against_float64(recipe, scale, zero_tokens):
    """Output and input gradient within the block bound of float64; every gradient finite;
    the expert no slot chose gets exactly zero weight gradients; dropped slots' probs
    gradients are zero; zero tokens give zero output rows."""
    mlp, x, index, probs, grad = _block(scale, zero_tokens)
    out = _run(mlp, x, index, probs, grad, recipe)
    want_out, want_dx = _reference(mlp, x, index, probs, grad)
    assert rel_err(out, want_out) < BOUND
    assert rel_err(x.grad, want_dx) < (LARGE_DX_BOUND if scale > 1 else BOUND)
    assert rel_err(out, want_out) > 1e-4  # it did quantize
    for tensor in (out, x.grad, probs.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad):
        assert torch.isfinite(tensor).all()
    assert torch.all(mlp.fc1.weight.grad[1] == 0) and torch.all(mlp.fc2.weight.grad[1] == 0)
    assert torch.all(probs.grad[::7, 1] == 0)
    if zero_tokens:
        assert torch.all(out[::5] == 0)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_block_with_every_slot_dropped(recipe):
    """No routed row at all: zero output, zero gradients, nothing non-finite."""
    mlp, x, index, probs, grad = _block(1.0, False)
    out = _run(mlp, x, torch.full_like(index, -1), probs, grad, recipe)
    assert torch.all(out == 0) and torch.all(x.grad == 0) and torch.all(probs.grad == 0)
    assert torch.all(mlp.fc1.weight.grad == 0) and torch.all(mlp.fc2.weight.grad == 0)
