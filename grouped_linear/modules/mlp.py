"""``GroupedMLP``: the expert feed-forward block, fc1 -> activation -> fc2."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - builds without distributed
    FSDPModule = None

from ..ops.activation import bias_activation
from ..ops.checks import check_int
from ..ops.grouped_linear import split_rows
from ..ops.splits import GroupSplits
from ..parallel.tensor_parallel import check_tp_group, check_tp_size
from .grouped_linear import GroupedLinear

__all__ = ["GroupedMLP", "ACTIVATIONS", "GATED_ACTIVATIONS"]


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _geglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {
    "swiglu": _swiglu,
    "geglu": _geglu,
    "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
GATED_ACTIVATIONS = ("swiglu", "geglu")


class _Recompute:
    """Stands in, among fc2's saved tensors, for its input until backward needs it."""


def _with_recomputed_input(fc2: GroupedLinear, h: torch.Tensor, recompute, splits,
                           is_first_microbatch) -> torch.Tensor:
    """``fc2(h)`` where autograd saves no reference to ``h`` itself: when backward unpacks
    it, ``recompute()`` builds it again (from fc1's output, which the activation's own
    backward keeps anyway). The hooks hold ``h`` only weakly: autograd keeps them with
    every tensor they packed."""
    target = weakref.ref(h)

    def pack(tensor):
        return _Recompute() if tensor is target() else tensor

    def unpack(saved):
        if isinstance(saved, _Recompute):
            with torch.no_grad():
                return recompute()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fc2(h, splits, is_first_microbatch=is_first_microbatch)


def _is_fully_sharded(module: nn.Module) -> bool:
    return FSDPModule is not None and isinstance(module, FSDPModule)


class GroupedMLP(nn.Module):
    r"""Per-expert MLP: ``fc2(act(fc1(x)))`` with ``G`` experts.

    For gated activations (``swiglu``, ``geglu``) ``fc1`` has
    ``2 * ffn_hidden_size`` outputs, the gate half first:
    ``act(h) = f(h[:, :F]) * h[:, F:]`` with ``f`` = SiLU or tanh-GELU.

    Args:
        num_experts: ``G``.
        hidden_size: model width ``H`` (fc1 input, fc2 output).
        ffn_hidden_size: expert width ``F``.
        activation: one of ``swiglu``, ``geglu``, ``gelu`` (tanh), ``relu``, ``silu``.
        recompute_activation: keep only fc1's output for backward and recompute the
            activation from it when fc2's weight gradient needs its input (saves an
            ``(M, F)`` tensor per call, costs one activation pass in backward). Eager
            only: under ``torch.compile`` the compiler decides what to recompute.
        **grouped_linear_kwargs: passed to both ``fc1`` and ``fc2``
            (``bias``, ``params_dtype``, ``device``, ``backend``, ...). With
            ``tp_size``/``tp_group``, fc1 is column-parallel (gate and up halves
            sliced alike) and fc2 row-parallel (``reduce_output`` applies to fc2).

    Shape:
        - Input: ``(M, H)`` or a list of ``G`` tensors ``(m_i, H)``; ``m_splits`` as
          for :class:`GroupedLinear`.
        - Output: ``(M, H)``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        recompute_activation: bool = False,
        **grouped_linear_kwargs,
    ) -> None:
        super().__init__()
        if not isinstance(recompute_activation, bool):
            raise TypeError(f"recompute_activation must be a bool, got {recompute_activation!r}")
        self.recompute_activation = recompute_activation
        # Checked here so that errors name this constructor's arguments, not fc1's or fc2's.
        num_experts = check_int("num_experts", num_experts)
        hidden_size = check_int("hidden_size", hidden_size)
        ffn_hidden_size = check_int("ffn_hidden_size", ffn_hidden_size)
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {tuple(ACTIVATIONS)}")
        for name in ("return_bias", "reduce_output"):
            value = grouped_linear_kwargs.get(name, name == "reduce_output")
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if grouped_linear_kwargs.get("return_bias", False):
            raise ValueError("return_bias=True is not supported by GroupedMLP")
        for name in ("parallel_mode", "tp_column_blocks"):
            if name in grouped_linear_kwargs:
                raise ValueError(f"{name}={grouped_linear_kwargs[name]!r}: GroupedMLP sets it "
                                 "itself (fc1 column-parallel, fc2 row-parallel)")
        tp_size = check_tp_size(grouped_linear_kwargs.get("tp_size", 1))
        tp_group = check_tp_group(grouped_linear_kwargs.get("tp_group"))
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        gated = activation in GATED_ACTIVATIONS
        fc1_out = ffn_hidden_size * (2 if gated else 1)
        fc1_kwargs, fc2_kwargs = dict(grouped_linear_kwargs), dict(grouped_linear_kwargs)
        fc1_kwargs.pop("reduce_output", None)  # fc2's alone
        if tp_size > 1 or tp_group is not None:
            # Tensor parallel MLP: fc1 by columns (gate and up sliced alike), fc2 by rows.
            if ffn_hidden_size % tp_size:
                raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by "
                                 f"tp_size={tp_size}")
            fc1_kwargs.update(parallel_mode="column", tp_column_blocks=2 if gated else 1)
            fc2_kwargs.update(parallel_mode="row")
            if (grouped_linear_kwargs.get("reduce_output") is False
                    and grouped_linear_kwargs.get("bias", True)):
                raise ValueError(
                    "GroupedMLP with reduce_output=False leaves fc2's reduction to the caller, "
                    "who must then add fc2's bias after it: use bias=False and add it yourself"
                )
        self.fc1 = GroupedLinear(num_experts, hidden_size, fc1_out, **fc1_kwargs)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, **fc2_kwargs)

    def forward(
        self,
        x: torch.Tensor | Sequence[torch.Tensor],
        m_splits: Sequence[int] | torch.Tensor | GroupSplits | None = None,
        *,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        x, splits = split_rows(x, m_splits, self.hidden_size, self.num_experts)
        if self.fc1.delay_wgrad_compute or _is_fully_sharded(self.fc1):
            # fc1 adds its own bias: its gradient must wait for backward_dw, or the
            # parameters are only gathered while fc1 itself runs (FSDP).
            pre = self.fc1(x, splits, is_first_microbatch=is_first_microbatch, return_bias=False)
            fc1_bias = None

            def activate(h):
                return ACTIVATIONS[self.activation](h)
        else:
            pre, fc1_bias = self.fc1(x, splits, is_first_microbatch=is_first_microbatch,
                                     return_bias=True)
            if isinstance(fc1_bias, list):
                fc1_bias = torch.stack(fc1_bias)

            def activate(h):
                return bias_activation(h, fc1_bias, splits.ends, self.activation,
                                       splits.may_have_tail)
        h = activate(pre)
        if not (self.recompute_activation and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            return self.fc2(h, splits, is_first_microbatch=is_first_microbatch)
        return _with_recomputed_input(self.fc2, h, lambda: activate(pre.detach()), splits,
                                      is_first_microbatch)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Both layers' entries checked before either loads: a rejected load changes neither.
        self.fc1.check_state_dict(state_dict, prefix + "fc1.")
        self.fc2.check_state_dict(state_dict, prefix + "fc2.")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def backward_dw(self) -> None:
        """Run the delayed weight-gradient work of both layers (``delay_wgrad_compute``)."""
        self.fc2.backward_dw()
        self.fc1.backward_dw()

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation!r}"
            + (", recompute_activation=True" if self.recompute_activation else "")
        )
