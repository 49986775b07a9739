"""The stateful weight-gradient paths used out of order or with bad gradient buffers:
``backward_dw``, ``delay_wgrad_compute``, ``fuse_wgrad_accumulation`` and ``main_grad``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import grouped_linear as gl
from tests.bad_input import reference
from tests.bad_input.checks import assert_unchanged, count, expect_rejected, snapshot

G, K, N = 3, 4, 5
SIZES = [2, 0, 4]
M = sum(SIZES)
F64 = torch.float64


def _layer(single: bool = True, **kwargs: object) -> gl.GroupedLinear:
    return gl.GroupedLinear(G, K, N, params_dtype=F64, single_grouped_weight=single,
                            single_grouped_bias=single, **kwargs)


def _weights(layer: gl.GroupedLinear) -> list[nn.Parameter]:
    return [p for name, p in layer.named_parameters() if name.startswith("weight")]


def _step(layer: nn.Module, x: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward over ``SIZES``; returns the input and the output gradient."""
    x = torch.randn(M, K, dtype=F64, requires_grad=True) if x is None else x
    grad = torch.randn(M, N, dtype=F64)
    layer(x, SIZES).backward(grad)
    return x, grad


def _reference_grads(layer: gl.GroupedLinear, x: torch.Tensor, grad: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(dW (G, N, K), db (G, N))`` for ``grad`` at ``x``."""
    weight = layer.grouped_weight().detach().clone().requires_grad_()
    bias = layer.grouped_bias().detach().clone().requires_grad_()
    reference.linear(x.detach(), weight, bias, SIZES).backward(grad)
    return weight.grad, bias.grad


# --------------------------------------------------------------------------- nothing queued
def _fresh_delayed() -> tuple[nn.Module, Callable[[], None]]:
    layer = _layer(delay_wgrad_compute=True)
    return layer, layer.backward_dw


def _not_delayed() -> tuple[nn.Module, Callable[[], None]]:
    layer = _layer()
    _step(layer)
    return layer, layer.backward_dw


def _forward_without_backward() -> tuple[nn.Module, Callable[[], None]]:
    layer = _layer(delay_wgrad_compute=True)
    layer(torch.randn(M, K, dtype=F64, requires_grad=True), SIZES)
    return layer, layer.backward_dw


def _after_a_flush() -> tuple[nn.Module, Callable[[], None]]:
    layer = _layer(delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    for weight in _weights(layer):
        weight.main_grad = torch.zeros_like(weight)
    _step(layer)
    layer.backward_dw()
    return layer, layer.backward_dw


def _mlp_fresh() -> tuple[nn.Module, Callable[[], None]]:
    mlp = gl.GroupedMLP(G, K, 3, delay_wgrad_compute=True)
    return mlp, mlp.backward_dw


NOTHING_QUEUED = {"fresh delayed layer": _fresh_delayed, "layer without delay": _not_delayed,
                  "forward without backward": _forward_without_backward,
                  "second backward_dw": _after_a_flush, "fresh delayed GroupedMLP": _mlp_fresh}


@pytest.mark.parametrize("case", NOTHING_QUEUED)
def test_backward_dw_with_nothing_queued_changes_nothing(case: str) -> None:
    count("order")
    module, backward_dw = NOTHING_QUEUED[case]()
    before = snapshot(module)
    backward_dw()
    assert_unchanged(before, module)


# --------------------------------------------------------------------------- main_grad missing
@pytest.mark.parametrize("single", [True, False], ids=["single weight", "per-expert weights"])
def test_backward_dw_without_main_grad_keeps_the_queue_for_a_retry(single: bool) -> None:
    """``main_grad`` deleted between backward and ``backward_dw``: refused by name with the
    queued gradient kept; once ``main_grad`` is back the retry gives the reference."""
    layer = _layer(single, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    weights = _weights(layer)
    buffers = [torch.randn_like(w) for w in weights]
    starts = [b.clone() for b in buffers]
    for weight, buffer in zip(weights, buffers):
        weight.main_grad = buffer
    x, grad = _step(layer)
    for weight in weights:
        del weight.main_grad
    expect_rejected("order", layer.backward_dw, "main_grad", state=layer)

    for weight, buffer in zip(weights, buffers):
        weight.main_grad = buffer
    layer.backward_dw()
    count("valid")
    d_weight, d_bias = _reference_grads(layer, x, grad)
    got = torch.stack(buffers) if not single else buffers[0]
    start = torch.stack(starts) if not single else starts[0]
    torch.testing.assert_close(got - start, d_weight)
    biases = [p for name, p in layer.named_parameters() if name.startswith("bias")]
    torch.testing.assert_close(torch.stack([b.grad for b in biases]).view(G, N), d_bias)


# --------------------------------------------------------------------------- main_grad malformed
def _expanded(weight: nn.Parameter) -> torch.Tensor:
    """A ``main_grad`` of the right shape whose elements all share one memory location."""
    return torch.zeros((1,) * weight.dim(), dtype=weight.dtype).expand(weight.shape)


MAIN_GRADS: dict[str, tuple[str, Callable[[nn.Parameter], object]]] = {
    "expanded": ("aliasing", _expanded),
    "wrong shape": ("shape", lambda w: torch.zeros(w.numel(), dtype=w.dtype)),
    "int64": ("dtype", lambda w: torch.zeros(w.shape, dtype=torch.int64)),
    "on meta": ("device", lambda w: torch.zeros(w.shape, dtype=w.dtype, device="meta")),
    "str": ("type", lambda w: "main_grad"),
    "None": ("type", lambda w: None),
}


@pytest.mark.parametrize("delay", [False, True], ids=["fused", "fused and delayed"])
@pytest.mark.parametrize("single", [True, False], ids=["single weight", "per-expert weights"])
@pytest.mark.parametrize("case", MAIN_GRADS)
def test_a_malformed_main_grad_is_refused_at_forward(case: str, single: bool,
                                                     delay: bool) -> None:
    kind, make = MAIN_GRADS[case]
    layer = _layer(single, delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
    weights = _weights(layer)
    for weight in weights:
        weight.main_grad = torch.zeros_like(weight)
    weights[-1].main_grad = make(weights[-1])
    x = torch.randn(M, K, dtype=F64, requires_grad=True)
    expect_rejected(kind, lambda: layer(x, SIZES), "main_grad", state=layer)


# --------------------------------------------------------------------------- the input changed
@pytest.mark.parametrize("fuse", [False, True], ids=["delayed", "delayed and fused"])
def test_input_changed_in_place_before_backward_dw_is_refused(fuse: bool) -> None:
    """The delayed weight gradient reads the forward's input: an in-place change of it after
    backward would give a wrong gradient, so ``backward_dw`` refuses and changes nothing."""
    layer = _layer(delay_wgrad_compute=True, fuse_wgrad_accumulation=fuse)
    for weight in _weights(layer):
        weight.main_grad = torch.zeros_like(weight)
    x, _ = _step(layer)
    with torch.no_grad():
        x.mul_(2)
    count("aliasing")
    before = snapshot(layer)
    # as autograd refuses a saved tensor changed in place: the same RuntimeError
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        layer.backward_dw()
    assert_unchanged(before, layer)


# --------------------------------------------------------------------------- input-only backward
@pytest.mark.parametrize("recipe", [None, gl.recipes.Float8Rowwise()], ids=["high precision", "fp8"])
@pytest.mark.parametrize("delay, fuse", [(True, False), (False, True), (True, True)],
                         ids=["delayed", "fused", "delayed and fused"])
def test_input_only_backward_leaves_the_parameter_gradients(recipe: object, delay: bool,
                                                            fuse: bool) -> None:
    """``torch.autograd.grad(y, x)`` asks for the input gradient only: no weight or bias
    gradient may land in ``.grad`` or ``main_grad``, now or at ``backward_dw``."""
    count("order")
    layer = _layer(delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse, recipe=recipe)
    for weight in _weights(layer):
        weight.main_grad = torch.randn_like(weight)
    before = snapshot(layer)
    x = torch.randn(M, K, dtype=F64, requires_grad=True)
    grad = torch.randn(M, N, dtype=F64)
    (d_x,) = torch.autograd.grad(layer(x, SIZES), x, grad)
    layer.backward_dw()
    assert_unchanged(before, layer)
    if recipe is None:
        weight = layer.grouped_weight().detach()
        x_ref = x.detach().clone().requires_grad_()
        reference.linear(x_ref, weight, layer.grouped_bias().detach(), SIZES).backward(grad)
        torch.testing.assert_close(d_x, x_ref.grad)
