"""``grouped_mlp``: the expert MLP on given weights, fc1 -> bias + activation -> fc2, and the
block it shares with :class:`~grouped_linear.modules.GroupedMLP` (:func:`run_mlp`).

fc1 runs without its bias, the bias is folded into the fused activation
(:func:`~.activation.bias_activation`), fc2 adds its own; the splits are normalised once and
every step takes the :class:`~.splits.GroupSplits` as it is.

Routing probabilities (``probs``, one per row) enter as Megatron-Core's two conventions:
``probs_on="activation"`` scales the activation's output rows inside the fused activation,
``probs_on="input"`` scales the input rows before fc1 (fc1's bias unscaled).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from ..recipes import Float8Recipe, Float8Rowwise, check_recipe
from .activation import Activation, bias_activation, check_activation
from .checks import check_operands, check_tensor
from .fp8 import Float8WeightTensor
from .fp8.rows import Float8Rows, rows_recipe, scale_rows
from .grouped_linear import (
    apply_grouped_linear,
    flatten_rows,
    inputs_rebuilt_in_backward,
    join_inputs,
    reads_fp8_rows,
)
from .splits import GroupSplits, normalize_splits

__all__ = ["PROBS_ON", "PROBS_DTYPES", "check_probs", "check_probs_on",
           "grouped_mlp", "run_mlp"]

#: Where the routing probabilities apply: the activation's output, or fc1's input.
PROBS_ON = ("activation", "input")
PROBS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: fc1 of a block: its output without the bias, and the ``(G, W)`` bias to fold into the
#: activation (``None`` where there is none, or where fc1 added it itself).
Fc1 = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
Fc2 = Callable[[torch.Tensor], torch.Tensor]


class _Recompute:
    """Stands in, among fc2's saved tensors, for its input until backward needs it."""


def _with_recomputed_input(fc2: Fc2, a: torch.Tensor,
                           recompute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fc2(a)`` where autograd saves no reference to ``a`` itself: when backward unpacks
    it, ``recompute()`` builds it again (from fc1's output, which the activation's own
    backward keeps anyway). An FP8 fc2 keeps ``a`` as given rather than its FP8 copies, and
    quantizes the rebuilt ``a`` in backward. The hooks hold ``a`` only weakly: autograd
    keeps them with every tensor they packed."""
    target = weakref.ref(a)

    def pack(tensor):
        return _Recompute() if tensor is target() else tensor

    def unpack(saved):
        if isinstance(saved, _Recompute):
            with torch.no_grad():
                return recompute()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), inputs_rebuilt_in_backward():
        return fc2(a)


def check_probs_on(probs_on: object) -> str:
    """``probs_on`` if it is one of :data:`PROBS_ON`, else ``ValueError`` naming it."""
    if not isinstance(probs_on, str) or probs_on not in PROBS_ON:
        raise ValueError(f"probs_on={probs_on!r} is not one of {PROBS_ON}")
    return probs_on


def check_probs(probs: object, probs_on: object, x: torch.Tensor,
                leading: torch.Size | None = None) -> torch.Tensor | None:
    """``probs`` as a contiguous ``(M,)`` tensor for the ``(M, H)`` rows ``x`` (given as
    ``(M,)`` or as ``leading``, the shape of the rows of an N-D input), or ``None``; checks
    ``probs_on`` too. Type, dtype and device are checked before the shape; nothing is read."""
    check_probs_on(probs_on)
    if probs is None:
        return None
    probs = check_tensor("probs", probs, "a torch.Tensor or None")
    if probs.dtype not in PROBS_DTYPES:
        raise TypeError(f"probs has dtype {probs.dtype}: expected one of {PROBS_DTYPES}")
    if probs.device != x.device:
        raise ValueError(f"probs is on {probs.device} but x is on {x.device}")
    shapes = [(x.shape[0],)] + ([tuple(leading)] if leading is not None else [])
    if tuple(probs.shape) not in shapes:
        raise ValueError(f"probs has shape {tuple(probs.shape)}: expected one probability per "
                         f"row of x, of shape {' or '.join(map(str, shapes))}")
    return probs.reshape(-1).contiguous()


def _scale_rows(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``probs[:, None] * x`` in float32 (float64 where either is), rounded to ``x.dtype``;
    FP8 rows keep their codes, their factors scaled."""
    if isinstance(x, Float8Rows):
        return scale_rows(x, probs)
    compute = torch.float64 if torch.float64 in (x.dtype, probs.dtype) else torch.float32
    return (x.to(compute) * probs.to(compute).unsqueeze(1)).to(x.dtype)


def run_mlp(rows: list[torch.Tensor], splits: GroupSplits, fc1: Fc1, fc2: Fc2,
            act: Activation, *, recompute: bool = False, probs: torch.Tensor | None = None,
            probs_on: str = "activation", fc2_rows: Float8Rowwise | None = None
            ) -> torch.Tensor:
    """``fc2(act(fc1(x) + b1[g]))`` over the rows of ``splits``, ``x`` handed over as
    ``rows = [x]`` and taken out of it: where the caller keeps no reference of its own, ``x``
    is freed once fc1 has read it (what fc1 saves for backward stays; an FP8 fc1 keeps its
    own copies, not ``x``), before fc2 allocates. With ``probs`` (``(M,)``,
    checked by :func:`check_probs`) each row's activation output (``probs_on="activation"``)
    or input (``"input"``) times its probability. With ``recompute``, fc2's input is not kept
    for backward, in any precision, but rebuilt from fc1's output (eager only: under
    ``torch.compile`` the compiler decides what to recompute). ``fc2_rows``: the rowwise
    recipe whose FP8 rows fc2 reads as they are (:func:`~.grouped_linear.reads_fp8_rows`):
    the activation writes its output so, unless it is recomputed."""
    x = rows.pop()
    if probs is not None and probs_on == "input":
        x, probs = _scale_rows(x, probs), None
    pre, bias = fc1(x)
    del x

    def activate(h: torch.Tensor, p: torch.Tensor | None,
                 fp8: Float8Rowwise | None = None) -> torch.Tensor:
        return bias_activation(h, bias, splits.ends, act, splits.may_have_tail, p, fp8)

    if not (recompute and torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return fc2(activate(pre, probs, rows_recipe(fc2_rows, pre)))
    a = activate(pre, probs)
    kept = probs.detach() if probs is not None else None
    return _with_recomputed_input(fc2, a, lambda: activate(pre.detach(), kept))


def _check_shape(name: str, tensor: torch.Tensor | None, expected: tuple[int, ...],
                 what: str) -> None:
    if tensor is not None and tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {what} = {expected}")


def grouped_mlp(
    x: torch.Tensor | Sequence[torch.Tensor],
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    m_splits: Sequence[int] | torch.Tensor | GroupSplits | None,
    *,
    activation: str = "swiglu",
    recipe: Float8Recipe | None = None,
    gate_up_order: str = "concatenated",
    probs: torch.Tensor | None = None,
    probs_on: str = "activation",
    **activation_params: float,
) -> torch.Tensor:
    """The expert MLP on given weights: per group ``g``,
    ``y = act(x @ w1[g]^T + b1[g]) @ w2[g]^T + b2[g]``.

    Args:
        x: ``(M, H)`` or ``(..., H)`` (the leading dimensions flattened into the ``M`` rows
            that ``m_splits`` counts), or a list of ``G`` tensors ``(m_g, H)``.
        w1: ``(G, 2F, H)`` for a gated activation, else ``(G, F, H)``. A transposed view (of
            a ``(G, H, 2F)`` tensor) is read as it lies.
        b1: ``(G, 2F)`` / ``(G, F)`` or ``None``, in ``w1``'s row order.
        w2: ``(G, H, F)`` (or a transposed view of a ``(G, F, H)`` tensor).
        b2: ``(G, H)`` or ``None``.
        m_splits: the ``G`` group sizes, as for :func:`~grouped_linear.grouped_linear`.
        activation: ``swiglu``, ``geglu`` (tanh GELU), ``geglu_erf``, ``gpt_oss_swiglu``,
            ``clamped_swiglu`` (gated); ``gelu`` (tanh), ``gelu_erf``, ``relu``, ``relu2``
            (``relu(h) ** 2``), ``silu``.
        recipe: ``None`` (the input dtype, or an enclosing ``gl.autocast``'s recipe) or an
            FP8 recipe, for both GEMMs.
        gate_up_order: ``"concatenated"`` (gate rows of ``w1`` first, then up) or
            ``"interleaved"`` (gate, up, gate, up, ...: GPT-OSS's layout); gated only.
        probs: ``None`` or one routing probability per row of ``x`` (the permuted rows:
            e.g. the ``permuted_probs`` :func:`~grouped_linear.permute` returns when given
            the router's probabilities, padding rows 0):
            ``(M,)``, or ``x``'s leading shape for an N-D ``x``; float16, bfloat16, float32
            or float64 on ``x``'s device. Differentiable.
        probs_on: ``"activation"``: ``y = (probs[:, None] * act(...)) @ w2^T + b2``, fused
            into the activation; ``"input"``: fc1 reads ``probs[:, None] * x`` (in float32,
            rounded to ``x``'s dtype; fc1's bias is not scaled), Megatron-Core's
            ``moe_apply_probs_on_input``.
        **activation_params: ``alpha`` (default 1.702) and ``limit`` (7.0) of
            ``gpt_oss_swiglu``: ``g = min(gate, limit)``,
            ``act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``; ``limit``
            (10.0) of ``clamped_swiglu``: ``act = silu(min(gate, limit)) * clamp(up, -limit,
            limit)``.

    Returns:
        ``(M, H)`` (``(..., H)`` for an N-D ``x``); device splits summing to less than ``M``
        leave the rows past them zero.
    """
    act = check_activation(activation, gate_up_order, activation_params)
    w1 = check_tensor("w1", w1)
    w2 = check_tensor("w2", w2)
    if w1.dim() != 3:
        raise ValueError(f"w1 has shape {tuple(w1.shape)}: expected (G, "
                         f"{'2F' if act.gated else 'F'}, H)")
    if w2.dim() != 3:
        raise ValueError(f"w2 has shape {tuple(w2.shape)}: expected (G, H, F)")
    num_groups, width, hidden = w1.shape
    ffn = w2.shape[2]
    _check_shape("w2", w2, (num_groups, hidden, ffn), "(G, H, F) with G, H from w1")
    if width != (2 * ffn if act.gated else ffn):
        raise ValueError(
            f"w1 has shape {tuple(w1.shape)} but w2 has F={ffn} features: activation="
            f"{act.kind!r} needs w1 of shape (G, {'2F' if act.gated else 'F'}, H) = "
            f"{(num_groups, 2 * ffn if act.gated else ffn, hidden)}")
    if b1 is not None:
        _check_shape("b1", check_tensor("b1", b1), (num_groups, width), "(G, w1.shape[1])")
    if b2 is not None:
        _check_shape("b2", check_tensor("b2", b2), (num_groups, hidden), "(G, H)")
    recipe = check_recipe(recipe)
    x, leading = flatten_rows(x, hidden)
    x, m_splits = join_inputs(x, m_splits, hidden, num_groups=num_groups)
    device = check_operands(x, (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)))
    autocast = torch.is_autocast_enabled(device.type)
    for name, tensor in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        if tensor is not None and not autocast and tensor.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but x has dtype {x.dtype}: "
                            "outside torch.autocast the input and weight dtypes must match")
    probs = check_probs(probs, probs_on, x, leading)
    splits = normalize_splits(m_splits, num_groups=num_groups, num_rows=x.shape[0],
                              device=device)

    def fc1(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return apply_grouped_linear(rows, w1, None, splits, recipe=recipe), b1

    def fc2(a: torch.Tensor) -> torch.Tensor:
        return apply_grouped_linear(a, w2, b2, splits, recipe=recipe)

    fc2_rows = reads_fp8_rows(num_groups, hidden, ffn, w2.recipe if isinstance(
        w2, Float8WeightTensor) else recipe, x.shape[0], x.dtype, device)
    rows = [x]
    del x  # run_mlp takes the input over: it may go once fc1 has read it
    y = run_mlp(rows, splits, fc1, fc2, act, probs=probs, probs_on=probs_on, fc2_rows=fc2_rows)
    return y.reshape(*leading, hidden) if leading is not None else y
