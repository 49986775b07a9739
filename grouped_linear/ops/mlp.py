"""``grouped_mlp``: the expert MLP on given weights, fc1 -> bias + activation -> fc2, and the
block it shares with :class:`~grouped_linear.modules.GroupedMLP` (:func:`run_mlp`).

fc1 runs without its bias, the bias is folded into the fused activation
(:func:`~.activation.bias_activation`), fc2 adds its own; the splits are normalised once and
every step takes the :class:`~.splits.GroupSplits` as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from ..recipes import Float8Recipe, check_recipe
from .activation import Activation, bias_activation, check_activation
from .checks import check_operands, check_tensor
from .grouped_linear import apply_grouped_linear, join_inputs
from .splits import GroupSplits, normalize_splits

__all__ = ["grouped_mlp", "run_mlp"]

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
    backward keeps anyway). The hooks hold ``a`` only weakly: autograd keeps them with
    every tensor they packed."""
    target = weakref.ref(a)

    def pack(tensor):
        return _Recompute() if tensor is target() else tensor

    def unpack(saved):
        if isinstance(saved, _Recompute):
            with torch.no_grad():
                return recompute()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fc2(a)


def run_mlp(x: torch.Tensor, splits: GroupSplits, fc1: Fc1, fc2: Fc2, act: Activation, *,
            recompute: bool = False) -> torch.Tensor:
    """``fc2(act(fc1(x) + b1[g]))`` over the rows of ``splits``. With ``recompute``, fc2's
    input is not kept for backward but rebuilt from fc1's output (eager only: under
    ``torch.compile`` the compiler decides what to recompute)."""
    pre, bias = fc1(x)

    def activate(h: torch.Tensor) -> torch.Tensor:
        return bias_activation(h, bias, splits.ends, act, splits.may_have_tail)

    a = activate(pre)
    if not (recompute and torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return fc2(a)
    return _with_recomputed_input(fc2, a, lambda: activate(pre.detach()))


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
    **activation_params: float,
) -> torch.Tensor:
    """The expert MLP on given weights: per group ``g``,
    ``y = act(x @ w1[g]^T + b1[g]) @ w2[g]^T + b2[g]``.

    Args:
        x: ``(M, H)``, or a list of ``G`` tensors ``(m_g, H)``.
        w1: ``(G, 2F, H)`` for a gated activation, else ``(G, F, H)``. A transposed view (of
            a ``(G, H, 2F)`` tensor) is read as it lies.
        b1: ``(G, 2F)`` / ``(G, F)`` or ``None``, in ``w1``'s row order.
        w2: ``(G, H, F)`` (or a transposed view of a ``(G, F, H)`` tensor).
        b2: ``(G, H)`` or ``None``.
        m_splits: the ``G`` group sizes, as for :func:`~grouped_linear.grouped_linear`.
        activation: ``swiglu``, ``geglu`` (tanh GELU), ``geglu_erf``, ``gpt_oss_swiglu``
            (gated); ``gelu`` (tanh), ``gelu_erf``, ``relu``, ``silu``.
        recipe: ``None`` (the input dtype, or an enclosing ``gl.autocast``'s recipe) or an
            FP8 recipe, for both GEMMs.
        gate_up_order: ``"concatenated"`` (gate rows of ``w1`` first, then up) or
            ``"interleaved"`` (gate, up, gate, up, ...: GPT-OSS's layout); gated only.
        **activation_params: ``alpha`` (default 1.702) and ``limit`` (7.0) of
            ``gpt_oss_swiglu``: ``g = min(gate, limit)``,
            ``act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``.

    Returns:
        ``(M, H)``; device splits summing to less than ``M`` leave the rows past them zero.
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
    x, m_splits = join_inputs(x, m_splits, hidden, num_groups=num_groups)
    device = check_operands(x, (("x", x), ("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)))
    autocast = torch.is_autocast_enabled(device.type)
    for name, tensor in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        if tensor is not None and not autocast and tensor.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but x has dtype {x.dtype}: "
                            "outside torch.autocast the input and weight dtypes must match")
    splits = normalize_splits(m_splits, num_groups=num_groups, num_rows=x.shape[0],
                              device=device)

    def fc1(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return apply_grouped_linear(rows, w1, None, splits, recipe=recipe), b1

    def fc2(a: torch.Tensor) -> torch.Tensor:
        return apply_grouped_linear(a, w2, b2, splits, recipe=recipe)

    return run_mlp(x, splits, fc1, fc2, act)
