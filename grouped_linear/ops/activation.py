"""Differentiable ``act(h + bias[g])`` (times each row's routing probability, where given): the
expert MLP's activation with fc1's bias folded in, and the check of an activation's name,
gate/up layout and parameters."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..kernels import activation as act_kernels
from ..recipes import Float8Rowwise
from .fp8.rows import Float8Rows
from .steps import bias_grad_impl, bias_grad_op, compute_op, register_fake, step

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "GATE_UP_ORDERS", "Activation",
           "check_activation", "bias_activation"]

#: Every activation's name (see :mod:`grouped_linear.kernels.activation` for the formulas).
ACTIVATIONS = tuple(act_kernels.ACTIVATION_KINDS)
#: The gated ones: fc1 has ``2 * F`` outputs, a gate and an up value per feature.
GATED_ACTIVATIONS = act_kernels.GATED_KINDS
#: Where a gated activation finds its gate and up values among fc1's ``2 * F`` outputs.
GATE_UP_ORDERS = ("concatenated", "interleaved")


@dataclass(frozen=True)
class Activation:
    """A checked activation: its ``kind`` (a name of :data:`ACTIVATIONS`), whether gate and
    up values alternate (``interleaved``) and the clamping kinds' ``alpha`` and ``limit``
    (``gpt_oss_swiglu``: both; ``clamped_swiglu``: ``limit``; ignored by the others)."""

    kind: str
    interleaved: bool = False
    alpha: float = act_kernels.GPT_OSS_ALPHA
    limit: float = act_kernels.GPT_OSS_LIMIT

    @property
    def gated(self) -> bool:
        return self.kind in GATED_ACTIVATIONS


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_activation(activation: object, gate_up_order: object = "concatenated",
                     params: dict[str, object] | None = None) -> Activation:
    """``activation`` with its ``gate_up_order`` and parameters (``alpha`` and ``limit`` for
    ``gpt_oss_swiglu``, ``limit`` for ``clamped_swiglu``; a ``None`` value counts as not
    given, the kind's default of :data:`~grouped_linear.kernels.activation.KIND_PARAMETERS`
    then applies), checked and resolved."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if not isinstance(gate_up_order, str) or gate_up_order not in GATE_UP_ORDERS:
        raise ValueError(f"gate_up_order={gate_up_order!r} is not one of {GATE_UP_ORDERS}")
    if gate_up_order == "interleaved" and activation not in GATED_ACTIVATIONS:
        raise ValueError(f"gate_up_order='interleaved' applies to the gated activations "
                         f"{GATED_ACTIVATIONS}, not to activation={activation!r}")
    given = {name: value for name, value in (params or {}).items() if value is not None}
    defaults = act_kernels.KIND_PARAMETERS.get(activation, {})
    for name, value in given.items():
        if name not in ("alpha", "limit"):
            raise TypeError(f"unexpected keyword argument {name!r}: the activations' parameters "
                            f"are alpha (gpt_oss_swiglu) and limit (gpt_oss_swiglu, "
                            f"clamped_swiglu)")
        if name not in defaults:
            takers = [kind for kind, names in act_kernels.KIND_PARAMETERS.items() if name in names]
            raise ValueError(f"{name}={value!r} applies only to activation in {takers}, "
                             f"not to activation={activation!r}")
    alpha = _real("alpha", given.get("alpha", defaults.get("alpha", act_kernels.GPT_OSS_ALPHA)))
    if not math.isfinite(alpha):
        raise ValueError(f"alpha={alpha!r} must be finite")
    limit = _real("limit", given.get("limit", defaults.get("limit", act_kernels.GPT_OSS_LIMIT)))
    if not limit >= 0:
        raise ValueError(f"limit={limit!r} must be >= 0 (inf: no clamping)")
    return Activation(activation, gate_up_order == "interleaved", alpha, limit)


def _forward_impl(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor, kind: str,
                  zero_tail: bool, interleaved: bool, alpha: float, limit: float,
                  probs: torch.Tensor | None) -> torch.Tensor:
    return act_kernels.bias_act_forward(h, bias, ends, kind, zero_tail, interleaved, alpha,
                                        limit, probs)


def _backward_impl(grad_a: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None,
                   ends: torch.Tensor, kind: str, zero_tail: bool, interleaved: bool,
                   alpha: float, limit: float, probs: torch.Tensor | None, probs_grad: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``h`` and of ``probs`` (an empty tensor where not asked for: an
    operator returns tensors only)."""
    grad_h, grad_probs = act_kernels.bias_act_backward(
        grad_a, h, bias, ends, kind, zero_tail, interleaved, alpha, limit, probs, probs_grad)
    return grad_h, (grad_probs if grad_probs is not None else h.new_empty(0))


_forward_op = compute_op("bias_act", _forward_impl)
_backward_op = compute_op("bias_act_backward", _backward_impl)


@register_fake("bias_act")
def _(h, bias, ends, kind, zero_tail, interleaved, alpha, limit, probs):
    width = h.shape[1] // 2 if kind in GATED_ACTIVATIONS else h.shape[1]
    return h.new_empty(h.shape[0], width)


@register_fake("bias_act_backward")
def _(grad_a, h, bias, ends, kind, zero_tail, interleaved, alpha, limit, probs, probs_grad):
    grad_probs = probs.new_empty(h.shape[0]) if probs is not None and probs_grad else None
    return torch.empty_like(h), (grad_probs if grad_probs is not None else h.new_empty(0))


class BiasActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias, ends, act: Activation, zero_tail, probs,
                fp8: Float8Rowwise | None = None):
        ctx.save_for_backward(h, bias, ends, probs)
        ctx.act, ctx.zero_tail = act, zero_tail
        if fp8 is not None:  # the output as fc2's FP8 rows, written by the activation
            codes, inv = act_kernels.bias_act_forward_fp8(
                h, bias, ends, act.kind, fp8.forward_dtype, fp8.power_of_two_scales,
                act.interleaved, act.alpha, act.limit, probs)
            return Float8Rows(codes, inv, fp8, h.dtype)
        return step(_forward_op, _forward_impl)(h, bias, ends, act.kind, zero_tail,
                                                act.interleaved, act.alpha, act.limit, probs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_a):
        h, bias, ends, probs = ctx.saved_tensors
        act: Activation = ctx.act
        probs_grad = probs is not None and ctx.needs_input_grad[5]
        grad_h, grad_probs = step(_backward_op, _backward_impl)(
            grad_a.contiguous(), h, bias, ends, act.kind, ctx.zero_tail, act.interleaved,
            act.alpha, act.limit, probs, probs_grad
        )
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            grad_bias = step(bias_grad_op, bias_grad_impl)(grad_h, ends, bias.dtype)
        return grad_h, grad_bias, None, None, None, (grad_probs if probs_grad else None), None


def bias_activation(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor,
                    kind: str | Activation, zero_tail: bool,
                    probs: torch.Tensor | None = None,
                    fp8: Float8Rowwise | None = None) -> torch.Tensor:
    """``(M, W) -> (M, F)``: ``act(h + bias[g])`` per row group, each row times its
    ``probs`` value where given.

    ``bias``: ``(G, W)`` or ``None``, in ``h``'s column layout; ``ends``: ``(G,)`` int32
    cumulative group ends on ``h``'s device; ``kind``: a name of :data:`ACTIVATIONS` (gate half
    first if gated, a clamping kind with its default parameters) or an
    :class:`Activation` from :func:`check_activation`; ``probs``: ``(M,)`` contiguous
    floating-point on ``h``'s device, or ``None`` (checked by the callers); ``fp8``: a rowwise
    recipe whose FP8 rows the next layer reads (:class:`~.fp8.rows.Float8Rows`, the
    activation's values quantized per row by its own kernel), or ``None``.
    """
    act = kind if isinstance(kind, Activation) else check_activation(kind)
    return BiasActivationFunction.apply(h, bias, ends, act, zero_tail, probs, fp8)
