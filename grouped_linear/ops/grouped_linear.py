"""``grouped_linear``: the differentiable grouped GEMM with per-group bias.

The compute steps are ``torch.library`` operators (:mod:`.linear_steps`) so that
``torch.compile`` can trace them; :class:`GroupedLinearFunction` composes them into
forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

from ..kernels._triton import HAS_TRITON, interpreting
from ..kernels.ends import group_ends
from ..kernels.gemm import triton_gemm
from ..kernels.gemm.triton_gemm import LinearLaunches
from ..recipes import Float8Recipe, check_recipe, current_recipe
from .fp8 import Fp8Config, Fp8GroupedLinearFunction, Fp8Weight, fp8_path
from .fp8_blockwise import Fp8BlockwiseFunction
from .fp8_device import Fp8DeviceGroupedLinearFunction
from .linear_steps import (
    bias_grad_impl,
    bias_grad_op,
    dgrad_impl,
    dgrad_op,
    forward_impl,
    forward_op,
    step,
    triton_backward_impl,
    triton_backward_op,
    triton_wgrad_impl,
    triton_wgrad_op,
    weight_grads_impl,
    weight_grads_op,
)
from .splits import SPLIT_DTYPES, GroupSplits, debug_checks_enabled, normalize_splits
from .triton_linear import apply_triton_linear, records_graph
from .weight_grad import WeightGradSink, route_weight_grads

__all__ = ["grouped_linear", "apply_grouped_linear", "fast_grouped_linear", "resolve_backend",
           "BACKEND_CHOICES"]

BACKEND_CHOICES = ("auto", "grouped", "loop", "triton")
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# ``auto`` picks the Triton kernels up to this many rows (see benchmarks/NOTES.md).
TRITON_AUTO_MAX_ROWS = 4096


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
        out = step(forward_op, forward_impl)(
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
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        bias_dtype = ctx.bias_dtype
        need_b = need_b and bias_dtype is not None
        # Gradients of reductions such as y.sum() arrive with zero strides.
        grad_out = grad_out.contiguous()
        if config.backend == "triton" and need_x and (need_w or need_b) and config.sink is None:
            # Small problems: the whole backward in one launch.
            grad_x, grad_w, grad_b = step(triton_backward_op, triton_backward_impl)(
                grad_out, x, weight, offsets, need_b
            )
            return grad_x, *_asked_grads(grad_w, grad_b, need_w, need_b, bias_dtype), None, None, None
        grad_x = None
        if need_x:
            grad_x = step(dgrad_op, dgrad_impl)(
                grad_out, weight, offsets, host_offsets, config.backend, config.zero_tail
            )

        def weight_and_bias_grads():
            if config.backend == "triton":
                grad_w, grad_b = step(triton_wgrad_op, triton_wgrad_impl)(grad_out, x, offsets, need_b)
                return _asked_grads(grad_w, grad_b, need_w, need_b, bias_dtype)
            if need_w:  # the bias gradient beside the weight's, from one kernel where it can
                grad_w, grad_b = step(weight_grads_op, weight_grads_impl)(
                    grad_out, x, offsets, host_offsets, config.backend, need_b,
                    bias_dtype if need_b else x.dtype)
                return grad_w, (grad_b if need_b else None)
            if need_b:
                return None, step(bias_grad_op, bias_grad_impl)(grad_out, offsets, bias_dtype)
            return None, None

        grad_w, grad_b = route_weight_grads(config.sink, need_w or need_b, weight_and_bias_grads)
        return grad_x, grad_w, grad_b, None, None, None


def _asked_grads(grad_w, grad_b, need_w: bool, need_b: bool, bias_dtype):
    """The Triton kernels' ``(grad_w, grad_b)``, each only where asked for (the bias sums are
    stored in the input dtype)."""
    if need_b and grad_b.dtype != bias_dtype:
        grad_b = grad_b.to(bias_dtype)
    return (grad_w if need_w else None), (grad_b if need_b else None)


# --------------------------------------------------------------------------- validation
def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, in_features: int,
                    out_features: int, num_rows: int = 0, num_groups: int = 1) -> str:
    """Map ``backend`` (``"auto"`` included) to the one that runs, or raise ``ValueError``.

    ``auto`` on CUDA, bf16/fp16: our Triton kernels for small problems (up to
    ``TRITON_AUTO_MAX_ROWS`` rows: one launch per GEMM, bias and tail fused,
    where launches dominate), torch's grouped GEMM above (sync-free in bf16).
    Everywhere else the per-group loop: on CPU torch's grouped GEMM is a
    slower loop; for fp32 the loop honours ``torch.backends.cuda.matmul.allow_tf32``.
    """
    if not isinstance(backend, str) or backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} is not one of {BACKEND_CHOICES}")
    if backend == "triton":
        if not (HAS_TRITON and (device.type == "cuda" or (interpreting() and device.type == "cpu"))):
            raise ValueError(
                f"backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"got device {device.type}, triton {'installed' if HAS_TRITON else 'missing'}"
            )
        if dtype not in _TRITON_DTYPES:
            raise ValueError(f"backend='triton' does not support dtype {dtype}; use 'loop'")
        if not triton_gemm.fits(num_groups, in_features, out_features):
            raise ValueError(
                f"backend='triton' takes at most {triton_gemm.MAX_GROUPS} groups of fewer than "
                f"2**31 weights each; got {num_groups} groups of {out_features}x{in_features}"
            )
        return backend
    grouped_ok = dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        device.type == "cuda" or dtype != torch.float16
    )
    if backend == "grouped":
        if not grouped_ok:
            raise ValueError(
                f"backend='grouped' does not support dtype {dtype} on {device.type}; use 'loop'"
            )
        row_alignment = 16 // dtype.itemsize  # torch's grouped GEMM: 16-byte row strides
        if in_features % row_alignment or out_features % row_alignment:
            raise ValueError(
                f"backend='grouped' needs in_features and out_features that are multiples of "
                f"{row_alignment} for {dtype} (16-byte rows); got in_features={in_features}, "
                f"out_features={out_features}; use 'loop' or 'auto'"
            )
        return backend
    if backend == "loop":
        return backend
    aligned = in_features % 8 == 0 and out_features % 8 == 0
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        if (HAS_TRITON and num_rows <= TRITON_AUTO_MAX_ROWS
                and triton_gemm.fits(num_groups, in_features, out_features)):
            return "triton"
        if aligned:
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
    *,
    keep_list: bool = False,
) -> tuple[torch.Tensor | list[torch.Tensor], Sequence[int] | torch.Tensor]:
    """Turn a tensor or a per-group list of tensors into one ``(M, in)`` tensor and its splits
    (``keep_list``: a list is checked but returned as the list, not concatenated)."""
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
        return (pieces if keep_list else torch.cat(pieces)), m_splits
    x = _check_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: expected a 2-D (rows, {in_features}) tensor")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features (shape {tuple(x.shape)}), expected {in_features}")
    if m_splits is None:
        raise ValueError("m_splits is required when x is a single tensor")
    return x, m_splits


# A list input on the FP8 device path is not concatenated: its quantization kernels read
# the pieces where they lie (one launch per pass, see kernels.quantize.piece_shifts).
# ``False`` concatenates the list first, as every other path does.
FP8_LIST_WITHOUT_CAT = True


def _fp8_pieces_path(pieces: list[torch.Tensor], weight: torch.Tensor,
                     recipe: Float8Recipe | None, cached_weight: Fp8Weight | None) -> bool:
    """Whether a list input goes to the FP8 device path as a list (``FP8_LIST_WITHOUT_CAT``):
    the recipe's GEMMs run there, no autocast recasts the pieces, and there are rows."""
    if not FP8_LIST_WITHOUT_CAT:
        return False
    first = pieces[0]
    device_type = first.device.type
    if recipe is None or torch.is_autocast_enabled(device_type) or first.dtype != weight.dtype:
        return False
    if sum(piece.shape[0] for piece in pieces) == 0 or first.device != weight.device:
        return False
    if check_recipe(recipe, first.device) is None:
        return False
    path = cached_weight.path if cached_weight is not None else fp8_path(recipe, first, weight)
    return path == "device"


def _cast_for_autocast(x, weight, bias, device_type: str):
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return x, weight, bias


# Call configurations of the fast path, one per backend (device splits: a tail may exist).
_DEVICE_SPLIT_CONFIGS = {name: _CallConfig(name, True, None) for name in BACKEND_CHOICES}


def fast_grouped_linear(
    x: object, weight: torch.Tensor, bias: torch.Tensor | None, m_splits: object, backend: str
) -> torch.Tensor | None:
    """The common high-precision call in a few comparisons, or ``None`` to take the full path.

    It applies when ``x`` is a plain CUDA tensor ``(M, K)``, ``m_splits`` an integer ``(G,)``
    tensor on the same device, ``weight`` ``(G, N, K)`` and ``bias`` ``(G, N)`` (or ``None``)
    of ``x``'s dtype there, with no recipe, ``torch.autocast``, tracing or debug checks
    active. It then does what :func:`apply_grouped_linear` does for that call, minus the
    :class:`GroupSplits` it would build; anything else (and every error) goes the full way.
    Small problems are host-bound, so this is where their time goes: the checks of one
    signature (shapes, strides, dtypes, devices, backend) run once (:func:`_fast_backend`),
    later calls look their verdict up; for the ``triton`` backend the verdict carries the
    :class:`~grouped_linear.kernels.gemm.triton_gemm.LinearLaunches` of that geometry, so the
    kernels' launch plans need no key of their own.
    """
    if (type(x) is not torch.Tensor or type(m_splits) is not torch.Tensor or not x.is_cuda
            or not isinstance(weight, torch.Tensor) or type(backend) is not str
            or (bias is not None and not isinstance(bias, torch.Tensor))):
        return None  # the full path checks (and rejects) anything unusual
    shape = x.shape
    if len(shape) != 2:
        return None
    key = (shape, x.stride(), shape[0] <= TRITON_AUTO_MAX_ROWS, x.dtype, x.device,
           m_splits.shape, m_splits.dtype, m_splits.device, weight.shape, weight.stride(),
           weight.dtype, weight.device,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device), backend)
    verdict = _FAST_VERDICTS.get(key)
    if verdict is None:
        resolved = _fast_backend(x, weight, bias, m_splits, backend)
        verdict = (resolved, LinearLaunches() if resolved == "triton" else None)
        if len(_FAST_VERDICTS) >= _MAX_FAST_VERDICTS:
            _FAST_VERDICTS.clear()
        _FAST_VERDICTS[key] = verdict
    resolved, launches = verdict
    if (not resolved or current_recipe() is not None or torch.is_autocast_enabled("cuda")
            or torch.compiler.is_compiling() or debug_checks_enabled()):
        return None
    if launches is not None and not _functorch_involved(x, weight, bias):
        return apply_triton_linear(x, weight, bias, m_splits, launches)
    groups = m_splits if resolved == "triton" else group_ends(m_splits, shape[0])
    return _run(x, weight, bias, groups, None, _DEVICE_SPLIT_CONFIGS[resolved])


# :func:`fast_grouped_linear`'s verdicts by call signature: the backend ("" where the fast
# path does not apply) and, for ``triton``, that geometry's launches. The cache starts over
# when full.
_FAST_VERDICTS: dict[tuple, tuple[str, LinearLaunches | None]] = {}
_MAX_FAST_VERDICTS = 1024


def _fast_backend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  m_splits: torch.Tensor, backend: str) -> str:
    """The backend a call of this signature resolves to, or "" when the fast path does not
    apply to it (see :func:`fast_grouped_linear`)."""
    device = x.device
    if m_splits.device != device or weight.dim() != 3 or m_splits.dim() != 1:
        return ""
    dtype = x.dtype
    num_groups, out_features, in_features = weight.shape
    if (x.shape[1] != in_features or m_splits.shape[0] != num_groups
            or weight.dtype != dtype or weight.device != device
            or m_splits.dtype not in SPLIT_DTYPES or not x.is_floating_point()):
        return ""
    if bias is not None and (bias.shape != (num_groups, out_features) or bias.dtype != dtype
                             or bias.device != device):
        return ""
    return resolve_backend(backend, device, dtype, in_features, out_features, x.shape[0],
                           num_groups)


def _functorch_involved(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a functorch transform is active or an argument is one's (possibly dead)
    wrapper: then only ``GroupedLinearFunction.apply`` may record the call."""
    return (torch._C._are_functorch_transforms_active() or is_functorch_wrapped_tensor(x)
            or is_functorch_wrapped_tensor(weight)
            or (bias is not None and is_functorch_wrapped_tensor(bias)))


# ``autograd.Function.apply``'s C implementation bound to GroupedLinearFunction: the Python
# ``apply`` in front of it only adds functorch handling (transforms, dead wrappers), which
# :func:`_run` checks for itself; a few µs per call on hosts where small steps are host-bound.
_apply_without_functorch = torch._C._FunctionBase.__dict__["apply"].__get__(
    None, GroupedLinearFunction)


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: torch.Tensor,
         host_offsets: torch.Tensor | None, config: _CallConfig) -> torch.Tensor:
    """The autograd function where a graph is needed (or traced), else the forward step
    alone: inference builds no autograd node."""
    if torch.compiler.is_compiling() or _functorch_involved(x, weight, bias):
        return GroupedLinearFunction.apply(x, weight, bias, groups, host_offsets, config)
    if not records_graph(x, weight, bias):
        return forward_impl(x, weight, bias, groups, host_offsets, config.backend,
                            config.zero_tail)
    return _apply_without_functorch(x, weight, bias, groups, host_offsets, config)


def apply_grouped_linear(
    x: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    m_splits: Sequence[int] | torch.Tensor | None,
    *,
    backend: str = "auto",
    sink: WeightGradSink | None = None,
    recipe: Float8Recipe | None = None,
    cached_weight: Fp8Weight | None = None,
) -> torch.Tensor:
    """:func:`grouped_linear` plus the module's gradient routing (``sink``) and FP8
    weight cache (``cached_weight``, from :func:`~grouped_linear.ops.fp8.quantize_weight`)."""
    if sink is None and recipe is None:
        out = fast_grouped_linear(x, weight, bias, m_splits, backend)
        if out is not None:
            return out
    weight = _check_tensor("weight", weight)
    if weight.dim() != 3:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: expected (G, out, in)")
    num_groups, out_features, in_features = weight.shape
    # A list input stays a list only for the FP8 device path, which quantizes it piece by
    # piece (no concatenation pass); every other path concatenates it here.
    x, m_splits = join_inputs(x, m_splits, in_features, keep_list=recipe is not None)
    pieces = None
    if isinstance(x, list):
        pieces = x
        if not _fp8_pieces_path(pieces, weight, recipe, cached_weight):
            x, pieces = torch.cat(pieces), None
        else:
            x = pieces[0]  # stands in for the input in the checks below
    if bias is not None:
        bias = _check_tensor("bias", bias)
        if bias.shape != (num_groups, out_features):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)}, expected ({num_groups}, {out_features})"
            )
    device = x.device  # read once: every read builds a new torch.device
    device_type = device.type
    x, weight, bias = _cast_for_autocast(x, weight, bias, device_type)
    dtype = x.dtype
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {dtype}: expected a floating-point tensor")
    num_rows = x.shape[0] if pieces is None else sum(piece.shape[0] for piece in pieces)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {device}")
        if tensor.dtype != dtype:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but x has dtype {dtype}: outside "
                "torch.autocast the input and parameter dtypes must match"
            )
    splits: GroupSplits = normalize_splits(
        m_splits, num_groups=num_groups, num_rows=num_rows, device=device
    )
    resolved = resolve_backend(backend, device, dtype, in_features, out_features, num_rows,
                               num_groups)
    if recipe is not None and check_recipe(recipe, device) is not None:
        fp8_config = Fp8Config(recipe, splits.may_have_tail, sink)
        path = cached_weight.path if cached_weight is not None else fp8_path(recipe, x, weight)
        if pieces is not None:  # path "device", checked by _fp8_pieces_path
            return Fp8DeviceGroupedLinearFunction.apply(None, weight, bias, splits.offsets,
                                                        fp8_config, cached_weight, *pieces)
        if path == "device" and x.shape[0] > 0:
            return Fp8DeviceGroupedLinearFunction.apply(x, weight, bias, splits.offsets,
                                                        fp8_config, cached_weight)
        if path == "triton" and x.shape[0] > 0:
            return Fp8BlockwiseFunction.apply(x, weight, bias, splits.size_tensor, splits.offsets,
                                              fp8_config, cached_weight,
                                              torch.is_grad_enabled() and weight.requires_grad)
        if path != "emulated":  # no rows: the emulation handles the degenerate case
            cached_weight = None
        return Fp8GroupedLinearFunction.apply(x, weight, bias, splits.offsets, fp8_config,
                                              cached_weight)
    if resolved == "triton":
        groups = splits.size_tensor
    else:
        groups = splits.offsets
    host_offsets = None
    if resolved == "loop" and device_type != "cpu" and splits.on_host:
        host_offsets = splits.host_offsets()
    return _run(x, weight, bias, groups, host_offsets,
                _CallConfig(resolved, splits.may_have_tail, sink))


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
        recipe: ``None`` (compute in the input dtype, or the recipe of an enclosing
            ``gl.autocast``) or an FP8 recipe from :mod:`grouped_linear.recipes`.
        backend: ``"auto"``, ``"grouped"``, ``"loop"`` or ``"triton"`` (for
            high-precision compute; FP8 recipes run real FP8 GEMMs on sm90 for bf16
            inputs where :func:`~grouped_linear.ops.fp8.fp8_path` allows, emulation elsewhere).

    Returns:
        ``(M, out)`` tensor.
    """
    if recipe is None:
        recipe = current_recipe()
    return apply_grouped_linear(x, weight, bias, m_splits, backend=backend, recipe=recipe)
