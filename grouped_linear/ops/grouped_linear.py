"""``grouped_linear``: the differentiable grouped GEMM with per-group bias, and the one entry
point every caller goes through (:func:`apply_grouped_linear`).

A call is checked, its ``m_splits`` normalised once into a :class:`~.splits.GroupSplits`,
its route chosen once (:func:`~.dispatch.choose_route`), and the route's autograd function
applied: :mod:`.linear_function` / :mod:`.fast_path` for the high-precision routes,
:mod:`.fp8` for the FP8 ones.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from ..kernels.ends import group_ends
from ..recipes import Float8Recipe, Float8Rowwise, current_recipe
from .bias_add import add_group_bias
from .checks import DEVICE_TYPES, check_operands, check_tensor, describe, host_checks
from .dispatch import cached_verdict, choose_route
from .fast_path import apply_triton_linear, functorch_involved
from .fp8 import (
    Float8Rows,
    Float8WeightTensor,
    Fp8BlockwiseFunction,
    Fp8Config,
    Fp8EmulatedFunction,
    Fp8FusedFunction,
    Fp8ScaledMMFunction,
    Fp8Weight,
    Fp8WeightCache,
    plain_rows,
)
from .linear_function import CallConfig, run_linear
from .splits import SPLIT_DTYPES, GroupSplits, debug_checks_enabled, normalize_splits
from .weight_grad import WeightGradSink

__all__ = ["grouped_linear", "apply_grouped_linear", "flatten_rows", "inputs_rebuilt_in_backward",
           "join_inputs", "reads_fp8_rows", "split_rows", "TensorParallelHooks"]

_INPUTS_REBUILT = contextvars.ContextVar("grouped_linear_inputs_rebuilt", default=False)


@contextlib.contextmanager
def inputs_rebuilt_in_backward() -> Iterator[None]:
    """Inside, the FP8 routes keep their input for backward as it was given (as with
    ``save_original_input``), not the FP8 copies they derive from it, so that the caller's
    saved-tensor hooks can stand in for the input and rebuild it when backward needs it
    (the high-precision routes keep the input as given anyway)."""
    token = _INPUTS_REBUILT.set(True)
    try:
        yield
    finally:
        _INPUTS_REBUILT.reset(token)


class TensorParallelHooks(Protocol):
    """What a tensor-parallel layer hands the op (``grouped_linear.parallel``'s
    ``TensorParallel``): ``enter`` wraps the input (column mode: identity forward, gradient
    all-reduced), ``leave`` the output (row mode: all-reduced), ``bias_after_leave`` says
    whether the bias must be added after ``leave`` (row mode's partial outputs)."""

    bias_after_leave: bool

    def enter(self, x: torch.Tensor) -> torch.Tensor: ...

    def leave(self, out: torch.Tensor) -> torch.Tensor: ...


# Where the input may live: the devices torch.autocast and the kernels know (not "meta").

# Call configurations of the plain call, one per route (device splits: a tail may exist).
_PLAIN_CONFIGS = {name: CallConfig(name, True, None) for name in ("triton", "grouped", "loop")}


def apply_grouped_linear(
    x: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    m_splits: Sequence[int] | torch.Tensor | GroupSplits | None,
    *,
    backend: str = "auto",
    recipe: Float8Recipe | None = None,
    sink: WeightGradSink | None = None,
    weight_cache: Fp8WeightCache | None = None,
    is_first_microbatch: bool | None = None,
    tp: TensorParallelHooks | None = None,
    save_original_input: bool = False,
    weight_sources: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`grouped_linear` with what a module adds: ``sink`` (its gradient routing),
    ``weight_cache`` with ``is_first_microbatch`` (its FP8 weight across microbatches:
    ``None`` quantizes per call, ``True`` refreshes the cache, ``False`` reuses it unless
    the weight changed since, as ``weight_sources``, the parameters a stacked ``weight`` is
    made of, tell) and ``tp`` (its tensor-parallel regions). ``recipe=None`` takes
    ``gl.autocast``'s.

    Every argument is checked before any state changes (the cache, the sink's queue).
    """
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(f"is_first_microbatch must be None or a bool, got {is_first_microbatch!r}")
    if not isinstance(save_original_input, bool):
        raise TypeError(f"save_original_input must be a bool, got {save_original_input!r}")
    primary = isinstance(weight, Float8WeightTensor)
    if recipe is None:
        recipe = weight.recipe if primary else current_recipe()
    if primary and recipe != weight.recipe:
        raise ValueError(f"recipe={recipe!r}: the weight is stored in FP8 for "
                         f"{weight.recipe!r} and runs only with it")
    if isinstance(x, Float8Rows) and not x.fits(recipe):
        x = plain_rows(x)
    if recipe is None and sink is None and tp is None:
        verdict = cached_verdict(x, weight, bias, m_splits, backend)
        if (verdict is not None and verdict[0] and not torch.is_autocast_enabled("cuda")
                and not torch.compiler.is_compiling() and not debug_checks_enabled()):
            route, launches = verdict
            if launches is not None and not functorch_involved(x, weight, bias):
                return apply_triton_linear(x, weight, bias, m_splits, launches)
            if route == "triton":
                return run_linear(x, weight, bias, m_splits, None, None, _PLAIN_CONFIGS[route])
            return run_linear(x, weight, bias, None, group_ends(m_splits, x.shape[0]), None,
                              _PLAIN_CONFIGS[route])

    weight = check_tensor("weight", weight)
    if weight.dim() != 3:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: expected (G, out, in)")
    num_groups, out_features, in_features = weight.shape
    x, m_splits = join_inputs(x, m_splits, in_features, keep_list=True, num_groups=num_groups)
    pieces = x if isinstance(x, list) else None
    if pieces is not None:
        x = pieces[0]  # stands in for the input in the checks below
    if bias is not None:
        bias = check_tensor("bias", bias)
        if bias.shape != (num_groups, out_features):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)}, expected ({num_groups}, {out_features})"
            )
    # Devices and kinds of dtype before anything converts or reads a value (torch.autocast
    # would cast an integer input silently).
    device = check_operands(x, (("x", x), ("weight", weight), ("bias", bias)))
    if weight_sources is None:  # the cache follows the parameter, not an autocast copy of it
        weight_sources = (weight,)
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        if pieces is not None and x.dtype != torch.float64:
            x, pieces = torch.cat(pieces), None
        # as torch.autocast casts F.linear's operands: float64 ones are left as they are
        x, weight, bias = (t.to(dtype) if t is not None and t.dtype != torch.float64 else t
                           for t in (x, weight, bias))
    dtype = x.dtype
    num_rows = x.shape[0] if pieces is None else sum(piece.shape[0] for piece in pieces)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.dtype != dtype:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but x has dtype {dtype}: outside "
                "torch.autocast the input and parameter dtypes must match"
            )
    splits = normalize_splits(m_splits, num_groups=num_groups, num_rows=num_rows, device=device)
    route = choose_route(backend, recipe, device, dtype, in_features, out_features, num_rows,
                         num_groups)
    # Only the FP8 rowwise/tensorwise GEMMs quantize a list piece by piece where it lies.
    if pieces is not None and (route != "fp8_scaled_mm" or num_rows == 0 or tp is not None):
        x, pieces = torch.cat(pieces), None

    # FP8 rows from permute: read as they are by the rowwise GEMMs alone.
    if isinstance(x, Float8Rows) and (route != "fp8_scaled_mm" or num_rows == 0
                                      or tp is not None):
        x = plain_rows(x)

    # Checked: from here on state may change.
    bias_after = None
    if tp is not None:
        x = tp.enter(x)
        if tp.bias_after_leave:
            bias, bias_after = None, bias
    if recipe is None:
        out = _high_precision(route, x, weight, bias, splits, sink)
    else:
        cached = None
        if primary:  # stored in FP8: read as it is
            cached = Fp8Weight.from_codes(weight.codes, weight.inv, recipe, route, dgrad=False)
        elif weight_cache is not None and is_first_microbatch is not None:
            cached = weight_cache.get(weight, recipe, route, refresh=is_first_microbatch,
                                      sources=weight_sources)
        config = Fp8Config(recipe, splits.may_have_tail, sink,
                           save_original_input or _INPUTS_REBUILT.get())
        out = _fp8(route, x, pieces, weight, bias, splits, config, cached)
    if tp is not None:
        out = tp.leave(out)
    if bias_after is not None:
        out = add_group_bias(out, bias_after, splits, sink)
    return out


def reads_fp8_rows(num_groups: int, out_features: int, in_features: int,
                   recipe: Float8Recipe | None, num_rows: int, dtype: torch.dtype,
                   device: torch.device, backend: str = "auto") -> Float8Rowwise | None:
    """The rowwise recipe whose :class:`~.fp8.rows.Float8Rows` a call of this geometry reads
    as they are (its route ``fp8_scaled_mm``; ``recipe=None``: ``gl.autocast``'s), so that
    the op before it may write them; else ``None``."""
    recipe = recipe if recipe is not None else current_recipe()
    if (not isinstance(recipe, Float8Rowwise) or num_rows == 0
            or device.type not in DEVICE_TYPES or torch.is_autocast_enabled(device.type)):
        return None  # (a device the call refuses: its own check says so)
    route = choose_route(backend, recipe, device, dtype, in_features, out_features, num_rows,
                         num_groups)
    return recipe if route == "fp8_scaled_mm" else None


def _high_precision(route: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    splits: GroupSplits, sink: WeightGradSink | None) -> torch.Tensor:
    """The ``triton``, ``grouped`` or ``loop`` route (the Triton kernels read the sizes, the
    others the ends; the loop over CUDA tensors the host's ends where the host has them)."""
    config = CallConfig(route, splits.may_have_tail, sink)
    if route == "triton":
        return run_linear(x, weight, bias, splits.sizes, None, None, config)
    host_ends = None
    if route == "loop" and x.device.type != "cpu" and splits.on_host:
        host_ends = splits.host_ends()
    return run_linear(x, weight, bias, None, splits.ends, host_ends, config)


def _fp8(route: str, x: torch.Tensor, pieces: list[torch.Tensor] | None, weight: torch.Tensor,
         bias: torch.Tensor | None, splits: GroupSplits, config: Fp8Config, cached) -> torch.Tensor:
    """An FP8 route; a call without rows runs the emulation (its degenerate case), with the
    cached weight only where it was made for the emulation."""
    weight_grad_ahead = torch.is_grad_enabled() and weight.requires_grad
    if pieces is not None:
        return Fp8ScaledMMFunction.apply(None, weight, bias, splits.sizes, splits.ends, config,
                                         cached, weight_grad_ahead, *pieces)
    if route == "fp8_scaled_mm" and x.shape[0] > 0:
        return Fp8ScaledMMFunction.apply(x, weight, bias, splits.sizes, splits.ends, config,
                                         cached, weight_grad_ahead)
    if route == "fp8_fused" and x.shape[0] > 0:
        return Fp8FusedFunction.apply(x, weight, bias, splits.sizes, splits.ends, config, cached,
                                      weight_grad_ahead)
    if route == "fp8_blockwise" and x.shape[0] > 0:
        return Fp8BlockwiseFunction.apply(x, weight, bias, splits.sizes, splits.ends, config,
                                          cached, weight_grad_ahead)
    if route != "fp8_emulated":
        cached = None
    return Fp8EmulatedFunction.apply(x, weight, bias, splits.ends, config, cached)


def flatten_rows(x: torch.Tensor | Sequence[torch.Tensor], hidden: int
                 ) -> tuple[torch.Tensor | Sequence[torch.Tensor], torch.Size | None]:
    """An ``(..., H)`` tensor of more than two dimensions as its ``(rows, H)`` view and its
    leading shape; anything else as it is, with ``None`` (checked where it is used)."""
    if not isinstance(x, torch.Tensor) or x.dim() <= 2:
        return x, None
    if x.shape[-1] != hidden:
        raise ValueError(f"x has {x.shape[-1]} features (shape {tuple(x.shape)}), "
                         f"expected {hidden}")
    return x.flatten(0, -2), x.shape[:-1]


def join_inputs(
    x: torch.Tensor | Sequence[torch.Tensor],
    m_splits: Sequence[int] | torch.Tensor | GroupSplits | None,
    in_features: int,
    *,
    keep_list: bool = False,
    num_groups: int | None = None,
) -> tuple[torch.Tensor | list[torch.Tensor], Sequence[int] | torch.Tensor | GroupSplits]:
    """Check a tensor ``(M, in)`` or a per-group list of tensors ``(m_g, in)`` (``num_groups``
    of them, where given) and return it with its splits (a list's sizes where ``m_splits`` is
    ``None``); a list is concatenated unless ``keep_list``.

    With a list, ``m_splits`` is ``None``, a :class:`GroupSplits`, an integer tensor or a list
    of ints; where its sizes can be read on the host they must be the pieces' row counts.
    """
    if isinstance(x, (list, tuple)):
        pieces = [check_tensor(f"x[{i}]", piece) for i, piece in enumerate(x)]
        if not pieces:
            raise ValueError("x is an empty list: expected one tensor per group")
        if num_groups is not None and len(pieces) != num_groups:
            raise ValueError(f"x is a list of {len(pieces)} tensors, expected one per group "
                             f"({num_groups} groups)")
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
        given = None  # the sizes m_splits gives on the host, where it gives them
        if m_splits is None:
            m_splits = list_sizes
        elif isinstance(m_splits, GroupSplits):
            given = m_splits.host_sizes
        elif isinstance(m_splits, torch.Tensor):
            # Read only a CPU tensor normalize_splits takes (it rejects the others by name),
            # and not while torch.compile traces (split tensors are then never read).
            if (m_splits.device.type == "cpu" and m_splits.dtype in SPLIT_DTYPES
                    and m_splits.dim() == 1 and host_checks()):
                given = m_splits.tolist()
        elif isinstance(m_splits, (list, tuple)):
            given = m_splits
        else:
            raise TypeError(
                f"m_splits must be None, a list of ints or an integer tensor giving the rows of "
                f"each tensor of the list x ({list_sizes}), got {describe(m_splits)}"
            )
        if given is not None and list(given) != list_sizes:
            raise ValueError(
                f"m_splits={list(given)} disagrees with the sizes of the list x: {list_sizes}"
            )
        return (pieces if keep_list else torch.cat(pieces)), m_splits
    x = check_tensor("x", x, "a torch.Tensor or a list of tensors")
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: expected a 2-D (rows, {in_features}) tensor")
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features (shape {tuple(x.shape)}), expected {in_features}")
    if m_splits is None:
        raise ValueError("m_splits is required when x is a single tensor")
    return x, m_splits


def split_rows(
    x: torch.Tensor | Sequence[torch.Tensor],
    m_splits: Sequence[int] | torch.Tensor | GroupSplits | None,
    in_features: int,
    num_groups: int,
) -> tuple[torch.Tensor, GroupSplits]:
    """``x`` as one ``(M, in)`` tensor and its splits normalised, for a block of layers over the
    same rows (``GroupedMLP``): each layer's call takes the :class:`GroupSplits` as it is."""
    x, m_splits = join_inputs(x, m_splits, in_features, num_groups=num_groups)
    return x, normalize_splits(m_splits, num_groups=num_groups, num_rows=x.shape[0],
                               device=x.device)


def grouped_linear(
    x: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    m_splits: Sequence[int] | torch.Tensor | None,
    *,
    recipe: object | None = None,
    backend: str = "auto",
    save_original_input: bool = False,
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
        backend: ``"auto"``, ``"grouped"``, ``"loop"`` or ``"triton"``, for
            high-precision compute (FP8 recipes choose their GEMMs by device and dtype:
            :func:`~grouped_linear.ops.dispatch.fp8_route`).
        save_original_input: with an FP8 recipe, backward keeps ``x`` as given and
            quantizes it again for the weight gradient, instead of keeping its FP8 copy
            (TransformerEngine's flag of that name; no effect without a recipe).

    Returns:
        ``(M, out)`` tensor.
    """
    return apply_grouped_linear(x, weight, bias, m_splits, backend=backend, recipe=recipe,
                                save_original_input=save_original_input)
