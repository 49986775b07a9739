"""The activations' names, formulas and parameters, and their plain-PyTorch reference.

With ``v = h + b[g]`` (``g`` the row's group), ``a = f(v)`` for the non-gated kinds and
``a = f(gate) * up`` for the gated ones, where ``gate`` and ``up`` are the two halves of
``v`` (``interleaved=False``: ``v[:, :F]`` then ``v[:, F:]``, the gate half first;
``interleaved=True``: ``v[:, 0::2]`` and ``v[:, 1::2]``, gate and up alternating, as
GPT-OSS stores them). ``f`` is SiLU (``swiglu``, ``silu``), tanh-GELU (``geglu``,
``gelu``), exact erf-GELU (``geglu_erf``, ``gelu_erf``), ReLU (``relu``) or squared ReLU
(``relu2``: ``relu(v) ** 2``, non-gated). Two gated kinds clamp first:

* ``gpt_oss_swiglu`` (GPT-OSS): ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
  ``a = (u + 1) * g * sigmoid(alpha * g)``;
* ``clamped_swiglu`` (DeepSeek-V4, GLM-5, Hunyuan-V4): ``a = silu(min(gate, limit)) *
  clamp(up, -limit, limit)``.

Their gradients are zero where a value was clamped (as torch's ``clamp``: a value at the
limit passes). :data:`KIND_PARAMETERS` gives each parameterised kind's parameters and
defaults. The reference computes in float32 (float64 for float64 inputs).
"""

import torch
import torch.nn.functional as F

from ._groups import row_groups

__all__ = ["ACTIVATION_KINDS", "GATED_KINDS", "KIND_PARAMETERS", "GPT_OSS_ALPHA",
           "GPT_OSS_LIMIT", "CLAMPED_SWIGLU_LIMIT", "bias_act_reference",
           "bias_act_backward_reference"]

# Each kind's function of the gate (or of the whole input), as the kernels number it.
ACTIVATION_KINDS = {"swiglu": 0, "geglu": 1, "geglu_erf": 3, "gpt_oss_swiglu": 4,
                    "clamped_swiglu": 5, "silu": 0, "gelu": 1, "gelu_erf": 3, "relu": 2,
                    "relu2": 6}
GATED_KINDS = ("swiglu", "geglu", "geglu_erf", "gpt_oss_swiglu", "clamped_swiglu")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0
CLAMPED_SWIGLU_LIMIT = 10.0  # DeepSeek-V4's, GLM-5's and Hunyuan-V4's configurations
#: The parameters a kind takes, with their defaults (the other kinds take none).
KIND_PARAMETERS = {"gpt_oss_swiglu": {"alpha": GPT_OSS_ALPHA, "limit": GPT_OSS_LIMIT},
                   "clamped_swiglu": {"limit": CLAMPED_SWIGLU_LIMIT}}

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_CUBIC = 0.044715
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def _base_activation(kind: str, value: torch.Tensor) -> torch.Tensor:
    if kind in ("swiglu", "silu", "clamped_swiglu"):
        return F.silu(value)
    if kind in ("geglu", "gelu"):
        return F.gelu(value, approximate="tanh")
    if kind in ("geglu_erf", "gelu_erf"):
        return F.gelu(value)
    if kind == "relu2":
        return F.relu(value).square()
    return F.relu(value)


def _base_activation_(kind: str, value: torch.Tensor) -> torch.Tensor:
    """:func:`_base_activation` in place (``value`` must be a tensor of the caller's own)."""
    if kind in ("swiglu", "silu", "clamped_swiglu"):
        return F.silu(value, inplace=True)
    if kind in ("geglu", "gelu"):
        return torch.ops.aten.gelu_(value, approximate="tanh")
    if kind in ("geglu_erf", "gelu_erf"):
        return torch.ops.aten.gelu_(value)
    if kind == "relu2":
        return value.relu_().square_()
    return value.relu_()


def _activation_backward(kind: str, grad: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``grad * f'(value)``: for SiLU aten's fused derivative (one pass over ``value``)."""
    if kind in ("swiglu", "silu", "clamped_swiglu"):
        return torch.ops.aten.silu_backward(grad, value)
    if kind in ("geglu", "gelu"):
        inner = _SQRT_2_OVER_PI * (value + _GELU_CUBIC * value ** 3)
        t = torch.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1 + 3 * _GELU_CUBIC * value ** 2)
        return grad * (0.5 * (1 + t) + 0.5 * value * (1 - t * t) * d_inner)
    if kind in ("geglu_erf", "gelu_erf"):
        return grad * (0.5 * (1 + torch.erf(value * _SQRT_HALF))
                       + value * _INV_SQRT_2PI * torch.exp(-0.5 * value * value))
    if kind == "relu2":
        return grad * 2 * F.relu(value)
    return grad * (value > 0).to(value.dtype)


def _halves(value: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of a gated input."""
    if interleaved:
        return value[:, 0::2], value[:, 1::2]
    gate, up = value.chunk(2, dim=-1)
    return gate, up


def _join(gate: torch.Tensor, up: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of :func:`_halves`."""
    if interleaved:
        return torch.stack((gate, up), dim=-1).flatten(1)
    return torch.cat((gate, up), dim=-1)


def _gated(kind: str, gate: torch.Tensor, up: torch.Tensor, alpha: float,
           limit: float) -> torch.Tensor:
    if kind == "gpt_oss_swiglu":
        g = gate.clamp(max=limit)  # then in place on fresh buffers
        return up.clamp(-limit, limit).add_(1).mul_(g).mul_(torch.mul(g, alpha).sigmoid_())
    if kind == "clamped_swiglu":
        return F.silu(gate.clamp(max=limit), inplace=True).mul_(up.clamp(-limit, limit))
    return _base_activation(kind, gate) * up


def _gated_grads(kind: str, gate: torch.Tensor, up: torch.Tensor, grad_a: torch.Tensor,
                 alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "gpt_oss_swiglu":  # in place on its own buffers (a backward: no autograd)
        g = gate.clamp(max=limit)
        s = torch.mul(g, alpha).sigmoid_()
        # d/d gate: grad_a * (u + 1) * s * (1 + alpha * g * (1 - s)); d/d up: grad_a * g * s
        grad_gate = torch.sub(1, s).mul_(g).mul_(alpha).add_(1).mul_(s)
        grad_gate.mul_(up.clamp(-limit, limit).add_(1)).mul_(grad_a)
        grad_up = g.mul_(s).mul_(grad_a)
        return (grad_gate.masked_fill_(~(gate <= limit), 0),
                grad_up.masked_fill_(~((up >= -limit) & (up <= limit)), 0))
    if kind == "clamped_swiglu":  # a value at the limit passes its gradient, as clamp's does
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        zero = torch.zeros((), dtype=grad_a.dtype, device=grad_a.device)
        return (torch.where(gate <= limit, _activation_backward(kind, grad_a * u, g), zero),
                torch.where((up >= -limit) & (up <= limit), grad_a * F.silu(g), zero))
    return _activation_backward(kind, grad_a * up, gate), grad_a * _base_activation(kind, gate)


def _covered(h: torch.Tensor, ends: torch.Tensor) -> bool:
    """Whether every row of ``h`` is in a group, as the host can tell for ends on the CPU."""
    return ends.device.type == "cpu" and ends.shape[0] > 0 and int(ends[-1]) >= h.shape[0]


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the plain-PyTorch forms compute in: float64 for float64, else float32."""
    return torch.float64 if h.dtype == torch.float64 else torch.float32


def _generic(kind: str) -> bool:
    """Whether ``kind`` is ``f(gate) * up`` with no parameters (no clamping)."""
    return kind in GATED_KINDS and kind not in KIND_PARAMETERS


def _gate_only(kind: str, h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor) -> bool:
    """Whether ``f(gate) * up`` needs only the gate in the compute dtype: a gated kind without
    parameters, no bias, every row in a group."""
    return _generic(kind) and bias is None and _covered(h, ends)


def _biased(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h + bias[g]`` in the compute dtype, and the ``(M, 1)`` mask of rows in a group
    (``None`` when every row is in one, as the host can tell for group ends on the CPU)."""
    compute = _compute_dtype(h)
    value = h.to(compute)
    covered = _covered(h, ends)
    if bias is None and covered:
        return value, None
    groups = row_groups(ends, h.shape[0])
    if bias is not None:
        padded = torch.cat([bias.to(compute), bias.new_zeros(1, bias.shape[1], dtype=compute)])
        added = padded.index_select(0, groups)
        # into the converted copy where there is one (h itself is not written)
        value = value + added if value is h else value.add_(added)
    return value, (None if covered else (groups < ends.shape[0]).unsqueeze(1))


def _activated(value: torch.Tensor, kind: str, interleaved: bool, alpha: float,
               limit: float) -> torch.Tensor:
    if kind in GATED_KINDS:
        return _gated(kind, *_halves(value, interleaved), alpha, limit)
    return _base_activation(kind, value)


def bias_act_reference(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor,
                       kind: str, zero_tail: bool, interleaved: bool = False,
                       alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT,
                       probs: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable plain-PyTorch form (float32 math, float64 for float64; output in
    ``h.dtype``); with ``probs``, each row scaled by its ``(M,)`` probability."""
    if _gate_only(kind, h, bias, ends):  # only the gate is converted; up promotes exactly
        gate, up = _halves(h, interleaved)
        compute, in_group = _compute_dtype(h), None
        # f(gate) in a buffer of its own (in place on the converted copy), then in place:
        # on the CPU each fresh activation-sized buffer costs as much as a pass
        out = (_base_activation(kind, gate) if gate.dtype == compute
               else _base_activation_(kind, gate.to(compute))).mul_(up)
    else:
        value, in_group = _biased(h, bias, ends)
        out = _activated(value, kind, interleaved, alpha, limit)
    # in place where autograd records nothing (ReLU's backward reads its output)
    recorded = out.requires_grad
    if probs is not None:
        scale = probs.to(out.dtype).unsqueeze(1)
        out = out * scale if recorded else out.mul_(scale)
    if zero_tail and in_group is not None:
        out = out.masked_fill(~in_group, 0) if recorded else out.masked_fill_(~in_group, 0)
    return out.to(h.dtype)


def bias_act_backward_reference(grad_a: torch.Tensor, h: torch.Tensor,
                                bias: torch.Tensor | None, ends: torch.Tensor, kind: str,
                                interleaved: bool = False, alpha: float = GPT_OSS_ALPHA,
                                limit: float = GPT_OSS_LIMIT, probs: torch.Tensor | None = None,
                                probs_grad: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients with respect to ``h`` and (with ``probs_grad``) ``probs``, written out (no
    autograd: it also runs inside custom ops, where autograd does not record). Rows past the
    last group get zero. The gradient of ``h`` is written into ``h``'s dtype half by half
    (each half rounded once, as its float32 values are), without a float32 ``(M, W)`` copy."""
    compute = _compute_dtype(h)
    generic = _generic(kind)  # f(gate) * up
    if _gate_only(kind, h, bias, ends):
        # h as it is: only the gate is converted, the products promote up exactly
        value, in_group = h, None
    else:
        value, in_group = _biased(h, bias, ends)
    grad_a = grad_a.to(compute, copy=True)  # a copy: masked and scaled in place
    if in_group is not None:
        grad_a.masked_fill_(~in_group, 0)
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if kind not in GATED_KINDS:
        grad_probs = _scale_by_probs(grad_a, lambda: _base_activation(kind, value), probs,
                                     probs_grad)
        grad_h.copy_(_activation_backward(kind, grad_a, value))
        return grad_h, grad_probs
    gate, up = _halves(value, interleaved)
    grad_gate, grad_up = _halves(grad_h, interleaved)
    if not generic:  # the clamping gates
        grad_probs = _scale_by_probs(
            grad_a, lambda: _gated(kind, gate, up, alpha, limit), probs, probs_grad)
        grads = _gated_grads(kind, gate, up, grad_a, alpha, limit)
        grad_gate.copy_(grads[0])
        grad_up.copy_(grads[1])
        return grad_h, grad_probs
    gate = gate.to(compute)
    base = _base_activation(kind, gate)  # f(gate), for the output's and up's gradients
    grad_probs = _scale_by_probs(grad_a, lambda: base * up, probs, probs_grad)
    # The products go straight into their halves where those have the compute dtype; else
    # into buffers already held (f(gate)'s, then grad_a's) and copied: an ``out=`` of
    # another dtype would allocate a temporary for each.
    direct = grad_h.dtype == compute
    if direct:
        torch.mul(grad_a, base, out=grad_up)
        scaled = torch.mul(grad_a, up, out=base)  # f(gate) is spent: its buffer takes it
    else:
        grad_up.copy_(base.mul_(grad_a))
        scaled = grad_a.mul_(up)
    if kind == "swiglu":
        torch.ops.aten.silu_backward.grad_input(scaled, gate,
                                                grad_input=grad_gate if direct else scaled)
        if not direct:
            grad_gate.copy_(scaled)
    else:
        grad_gate.copy_(_activation_backward(kind, scaled, gate))
    return grad_h, grad_probs


def _scale_by_probs(grad_a: torch.Tensor, activated, probs: torch.Tensor | None,
                    probs_grad: bool) -> torch.Tensor | None:
    """Where ``probs`` are given: with ``probs_grad`` the ``(M,)`` gradient of ``probs``,
    ``sum(activated() * grad_a)`` per row (in ``probs``' dtype); then ``grad_a`` (a float32
    copy) scaled by them in place. Returns the gradient of ``probs`` or ``None``."""
    if probs is None:
        return None
    grad_probs = None
    if probs_grad:
        grad_probs = activated().mul_(grad_a).sum(1).to(probs.dtype)
    grad_a.mul_(probs.to(grad_a.dtype).unsqueeze(1))
    return grad_probs
