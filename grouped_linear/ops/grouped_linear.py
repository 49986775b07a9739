"""``grouped_linear``: the differentiable grouped GEMM with per-group bias.

The compute steps are ``torch.library`` custom ops (``grouped_linear::forward``,
``::dgrad``, ``::wgrad``, ``::bias_grad``) so that ``torch.compile`` can trace
them; :class:`GroupedLinearFunction` composes them into forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels import bias as bias_kernels
from ..kernels import grouped_gemm
from .splits import GroupSplits, normalize_splits
from .weight_grad import WeightGradSink

__all__ = ["grouped_linear", "apply_grouped_linear", "resolve_backend", "BACKEND_CHOICES"]

BACKEND_CHOICES = ("auto", "grouped", "loop", "triton")


# --------------------------------------------------------------------------- custom ops
# Each compute step is a plain function, registered as a torch.library custom op for
# torch.compile; eager calls go straight to the function (no dispatcher round trip).
def _forward_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor,
    host_offsets: torch.Tensor | None,
    backend: str,
    zero_tail: bool,
) -> torch.Tensor:
    out = grouped_gemm.forward(x, weight, offsets, host_offsets, backend)
    return bias_kernels.bias_epilogue_(out, bias, offsets, zero_tail)


def _dgrad_impl(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    host_offsets: torch.Tensor | None,
    backend: str,
    zero_tail: bool,
) -> torch.Tensor:
    grad_x = grouped_gemm.dgrad(grad_out, weight, offsets, host_offsets, backend)
    return bias_kernels.zero_tail_(grad_x, offsets) if zero_tail else grad_x


def _wgrad_impl(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    host_offsets: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    return grouped_gemm.wgrad(grad_out, x, offsets, host_offsets, backend)


def _bias_grad_impl(grad_out: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bias_kernels.bias_grad(grad_out, offsets, dtype)


_forward_op = torch.library.custom_op("grouped_linear::forward", _forward_impl, mutates_args=())
_dgrad_op = torch.library.custom_op("grouped_linear::dgrad", _dgrad_impl, mutates_args=())
_wgrad_op = torch.library.custom_op("grouped_linear::wgrad", _wgrad_impl, mutates_args=())
_bias_grad_op = torch.library.custom_op("grouped_linear::bias_grad", _bias_grad_impl, mutates_args=())


@_forward_op.register_fake
def _(x, weight, bias, offsets, host_offsets, backend, zero_tail):
    return x.new_empty(x.shape[0], weight.shape[1])


@_dgrad_op.register_fake
def _(grad_out, weight, offsets, host_offsets, backend, zero_tail):
    return grad_out.new_empty(grad_out.shape[0], weight.shape[2])


@_wgrad_op.register_fake
def _(grad_out, x, offsets, host_offsets, backend):
    return x.new_empty(offsets.shape[0], grad_out.shape[1], x.shape[1])


@_bias_grad_op.register_fake
def _(grad_out, offsets, dtype):
    return grad_out.new_empty(offsets.shape[0], grad_out.shape[1], dtype=dtype)


def _step(op, impl):
    """The custom op while torch.compile traces, the plain function in eager mode."""
    return op if torch.compiler.is_compiling() else impl


# --------------------------------------------------------------------------- autograd
@dataclass(frozen=True)
class _CallConfig:
    backend: str
    zero_tail: bool
    sink: WeightGradSink | None


class GroupedLinearFunction(torch.autograd.Function):
    """``y = x @ W_g^T + b_g`` per group; see :func:`grouped_linear`."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, host_offsets, config: _CallConfig):
        out = _step(_forward_op, _forward_impl)(
            x, weight, bias, offsets, host_offsets, config.backend, config.zero_tail
        )
        ctx.save_for_backward(x, weight, offsets, host_offsets)
        ctx.config = config
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets, host_offsets = ctx.saved_tensors
        config: _CallConfig = ctx.config
        # Gradients of reductions such as y.sum() arrive with zero strides.
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _step(_dgrad_op, _dgrad_impl)(
                grad_out, weight, offsets, host_offsets, config.backend, config.zero_tail
            )
        need_w = ctx.needs_input_grad[1]
        need_b = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        bias_dtype = ctx.bias_dtype

        def weight_and_bias_grads():
            grad_w = grad_b = None
            if need_w:
                grad_w = _step(_wgrad_op, _wgrad_impl)(grad_out, x, offsets, host_offsets, config.backend)
            if need_b:
                grad_b = _step(_bias_grad_op, _bias_grad_impl)(grad_out, offsets, bias_dtype)
            return grad_w, grad_b

        sink = config.sink
        if sink is None or not (need_w or need_b):
            grad_w, grad_b = weight_and_bias_grads()
        elif sink.delay:
            sink.defer(weight_and_bias_grads)
            grad_w = grad_b = None
        else:
            grad_w, grad_b = weight_and_bias_grads()
            if grad_w is not None and sink.fuse_main_grad:
                sink.accept_weight_grad(grad_w)
                grad_w = None
        return grad_x, grad_w, grad_b, None, None, None


# --------------------------------------------------------------------------- validation
def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, in_features: int,
                    out_features: int) -> str:
    """Map ``backend`` (``"auto"`` included) to the one that runs, or raise ``ValueError``.

    ``auto`` picks torch's grouped GEMM for bf16/fp16 on CUDA (sync-free there
    and faster than a loop once groups are many or unaligned) and the
    per-group loop everywhere else (on CPU torch's grouped GEMM is a slower
    loop; for fp32 the loop honours ``torch.backends.cuda.matmul.allow_tf32``).
    """
    if not isinstance(backend, str) or backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} is not one of {BACKEND_CHOICES}")
    if backend == "triton":
        raise ValueError(
            "backend='triton' is not available in this version; use 'auto', 'grouped' or 'loop'"
        )
    grouped_ok = dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        device.type == "cuda" or dtype != torch.float16
    )
    if backend == "grouped":
        if not grouped_ok:
            raise ValueError(
                f"backend='grouped' does not support dtype {dtype} on {device.type}; use 'loop'"
            )
        return backend
    if backend == "loop":
        return backend
    aligned = in_features % 8 == 0 and out_features % 8 == 0
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and aligned:
        return "grouped"
    return "loop"


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def join_inputs(
    x: torch.Tensor | Sequence[torch.Tensor],
    m_splits: Sequence[int] | torch.Tensor | None,
    in_features: int,
) -> tuple[torch.Tensor, Sequence[int] | torch.Tensor]:
    """Turn a tensor or a per-group list of tensors into one ``(M, in)`` tensor and its splits."""
    if isinstance(x, (list, tuple)):
        pieces = [_check_tensor(f"x[{i}]", piece) for i, piece in enumerate(x)]
        if not pieces:
            raise ValueError("x is an empty list: expected one tensor per group")
        for i, piece in enumerate(pieces):
            if piece.dim() != 2 or piece.shape[1] != in_features:
                raise ValueError(
                    f"x[{i}] has shape {tuple(piece.shape)}, expected (rows, {in_features})"
                )
            if piece.dtype != pieces[0].dtype or piece.device != pieces[0].device:
                raise TypeError(
                    f"x[{i}] is {piece.dtype} on {piece.device} but x[0] is "
                    f"{pieces[0].dtype} on {pieces[0].device}"
                )
        list_sizes = [piece.shape[0] for piece in pieces]
        if m_splits is None:
            m_splits = list_sizes
        elif not (isinstance(m_splits, torch.Tensor) and m_splits.device.type != "cpu"):
            given = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
            if given != list_sizes:
                raise ValueError(
                    f"m_splits={given} disagrees with the sizes of the list x: {list_sizes}"
                )
        return torch.cat(pieces), m_splits
    x = _check_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: expected a 2-D (rows, {in_features}) tensor")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features (shape {tuple(x.shape)}), expected {in_features}")
    if m_splits is None:
        raise ValueError("m_splits is required when x is a single tensor")
    return x, m_splits


def _cast_for_autocast(x, weight, bias):
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return x, weight, bias


def apply_grouped_linear(
    x: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    m_splits: Sequence[int] | torch.Tensor | None,
    *,
    backend: str = "auto",
    sink: WeightGradSink | None = None,
) -> torch.Tensor:
    """:func:`grouped_linear` plus the module's gradient routing (``sink``)."""
    weight = _check_tensor("weight", weight)
    if weight.dim() != 3:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: expected (G, out, in)")
    num_groups, out_features, in_features = weight.shape
    x, m_splits = join_inputs(x, m_splits, in_features)
    if bias is not None:
        bias = _check_tensor("bias", bias)
        if bias.shape != (num_groups, out_features):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)}, expected ({num_groups}, {out_features})"
            )
    x, weight, bias = _cast_for_autocast(x, weight, bias)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")
        if tensor.dtype != x.dtype:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but x has dtype {x.dtype}: outside "
                "torch.autocast the input and parameter dtypes must match"
            )
    if not (x.is_floating_point()):
        raise TypeError(f"x has dtype {x.dtype}: expected a floating-point tensor")
    splits: GroupSplits = normalize_splits(
        m_splits, num_groups=num_groups, num_rows=x.shape[0], device=x.device
    )
    resolved = resolve_backend(backend, x.device, x.dtype, in_features, out_features)
    host_offsets = None
    if x.device.type != "cpu" and splits.on_host:
        host_offsets = splits.host_offsets()
    config = _CallConfig(resolved, splits.may_have_tail, sink)
    return GroupedLinearFunction.apply(x, weight, bias, splits.offsets, host_offsets, config)


def grouped_linear(
    x: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    m_splits: Sequence[int] | torch.Tensor | None,
    *,
    recipe: object | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Grouped linear map: ``y[rows of g] = x[rows of g] @ weight[g]^T + bias[g]``.

    Args:
        x: ``(M, in)`` tensor, or a list of ``G`` tensors ``(m_g, in)``.
        weight: ``(G, out, in)``.
        bias: ``(G, out)`` or ``None``.
        m_splits: ``G`` group sizes (list of ints or an integer tensor on any
            device); optional when ``x`` is a list. Device splits may sum to
            less than ``M``: the rows past the sum get zero output and zero
            gradient.
        recipe: ``None`` (compute in the input dtype).
        backend: ``"auto"``, ``"grouped"`` or ``"loop"``.

    Returns:
        ``(M, out)`` tensor.
    """
    if recipe is not None:
        raise ValueError(f"recipe={recipe!r} is not supported: only recipe=None (no FP8) is available")
    return apply_grouped_linear(x, weight, bias, m_splits, backend=backend)
