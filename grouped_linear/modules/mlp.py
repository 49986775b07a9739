"""``GroupedMLP``: the expert feed-forward block, fc1 -> activation -> fc2."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - builds without distributed
    FSDPModule = None

from ..ops.activation import ACTIVATIONS, GATED_ACTIVATIONS, check_activation
from ..ops.checks import check_int
from ..ops.grouped_linear import flatten_rows, split_rows
from ..ops.mlp import check_probs, check_probs_on, run_mlp
from ..ops.splits import GroupSplits
from ..parallel.tensor_parallel import check_tp_group, check_tp_size
from .grouped_linear import GroupedLinear

__all__ = ["GroupedMLP", "ACTIVATIONS", "GATED_ACTIVATIONS"]


def _is_fully_sharded(module: nn.Module) -> bool:
    return FSDPModule is not None and isinstance(module, FSDPModule)


class GroupedMLP(nn.Module):
    r"""Per-expert MLP: ``fc2(act(fc1(x)))`` with ``G`` experts; the module form of
    :func:`~grouped_linear.grouped_mlp` on its own ``fc1`` and ``fc2`` layers.

    For gated activations (``swiglu``, ``geglu``, ``geglu_erf``, ``gpt_oss_swiglu``,
    ``clamped_swiglu``) ``fc1`` has ``2 * ffn_hidden_size`` outputs, a gate and an up value per
    feature: ``act(h) = f(gate) * up`` with ``f`` = SiLU, tanh-GELU or erf-GELU, GPT-OSS's
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, or
    ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (``clamped_swiglu``).

    Args:
        num_experts: ``G``.
        hidden_size: model width ``H`` (fc1 input, fc2 output).
        ffn_hidden_size: expert width ``F``.
        activation: one of ``swiglu``, ``geglu`` (tanh GELU gate), ``geglu_erf``,
            ``gpt_oss_swiglu``, ``clamped_swiglu``, ``gelu`` (tanh), ``gelu_erf``, ``relu``,
            ``relu2`` (``relu(h) ** 2``), ``silu``.
        recompute_activation: keep only fc1's output for backward and recompute the
            activation from it when fc2's weight gradient needs its input (saves an
            ``(M, F)`` tensor per call, costs one activation pass in backward). Eager
            only: under ``torch.compile`` the compiler decides what to recompute.
        gate_up_order: where a gated activation finds gate and up among fc1's outputs:
            ``"concatenated"`` (the gate half first) or ``"interleaved"`` (gate, up, gate,
            up, ...).
        alpha, limit: ``gpt_oss_swiglu``'s parameters (default 1.702 and 7.0) and
            ``clamped_swiglu``'s ``limit`` (default 10.0); only with them.
        probs_on: where ``forward``'s ``probs`` (routing probabilities, one per row) apply:
            ``"activation"`` (the activation's output rows, fused into the activation) or
            ``"input"`` (the input rows before fc1, fc1's bias unscaled: Megatron-Core's
            ``moe_apply_probs_on_input``); see :func:`~grouped_linear.grouped_mlp`.
        **grouped_linear_kwargs: passed to both ``fc1`` and ``fc2``
            (``bias``, ``params_dtype``, ``device``, ``backend``, ...). With
            ``tp_size``/``tp_group``, fc1 is column-parallel (gate and up halves
            sliced alike) and fc2 row-parallel (``reduce_output`` applies to fc2).

    Shape:
        - Input: ``(M, H)``, ``(..., H)`` (the leading dimensions flattened into the ``M``
          rows ``m_splits`` counts) or a list of ``G`` tensors ``(m_i, H)``; ``m_splits`` as
          for :class:`GroupedLinear`.
        - ``probs``: ``(M,)`` or the input's leading shape, or ``None``.
        - Output: ``(M, H)`` (``(..., H)`` for an N-D input).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        recompute_activation: bool = False,
        *,
        gate_up_order: str = "concatenated",
        alpha: float | None = None,
        limit: float | None = None,
        probs_on: str = "activation",
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
        act = check_activation(activation, gate_up_order, {"alpha": alpha, "limit": limit})
        check_probs_on(probs_on)
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
        self.gate_up_order = gate_up_order
        self.probs_on = probs_on
        self.alpha = act.alpha if activation == "gpt_oss_swiglu" else None
        self.limit = act.limit if activation in ("gpt_oss_swiglu", "clamped_swiglu") else None
        self._act = act
        gated = act.gated
        fc1_out = ffn_hidden_size * (2 if gated else 1)
        fc1_kwargs, fc2_kwargs = dict(grouped_linear_kwargs), dict(grouped_linear_kwargs)
        fc1_kwargs.pop("reduce_output", None)  # fc2's alone
        if tp_size > 1 or tp_group is not None:
            # Tensor parallel MLP: fc1 by columns (concatenated gate and up halves sliced
            # alike; interleaved pairs stay whole in a contiguous slice), fc2 by rows.
            if ffn_hidden_size % tp_size:
                raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by "
                                 f"tp_size={tp_size}")
            fc1_kwargs.update(parallel_mode="column",
                              tp_column_blocks=2 if gated and not act.interleaved else 1)
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
        probs: torch.Tensor | None = None,
        *,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """``probs``: ``None`` or one routing probability per row, applied where
        :attr:`probs_on` says."""
        x, leading = flatten_rows(x, self.hidden_size)
        x, splits = split_rows(x, m_splits, self.hidden_size, self.num_experts)
        probs = check_probs(probs, self.probs_on, x, leading)
        if probs is not None and self.probs_on == "activation":
            # each rank scales its slice of the features: the gradient sums over the ranks
            probs = self.fc1.tp.enter(probs)
        # fc1 adds its own bias where its gradient must wait for backward_dw, or where the
        # parameters are only gathered while fc1 itself runs (FSDP); else the activation does.
        fc1_adds_bias = self.fc1.delay_wgrad_compute or _is_fully_sharded(self.fc1)

        def fc1(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            if fc1_adds_bias:
                return self.fc1(rows, splits, is_first_microbatch=is_first_microbatch,
                                return_bias=False), None
            pre, bias = self.fc1(rows, splits, is_first_microbatch=is_first_microbatch,
                                 return_bias=True)
            return pre, (torch.stack(bias) if isinstance(bias, list) else bias)

        def fc2(a: torch.Tensor) -> torch.Tensor:
            return self.fc2(a, splits, is_first_microbatch=is_first_microbatch)

        fc2_rows = self.fc2.reads_fp8_rows(x.shape[0], x.dtype, x.device)
        y = run_mlp([x], splits, fc1, fc2, self._act, recompute=self.recompute_activation,
                    probs=probs, probs_on=self.probs_on, fc2_rows=fc2_rows)
        return y.reshape(*leading, self.hidden_size) if leading is not None else y

    def check_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        """:meth:`GroupedLinear.check_state_dict` of both layers (``prefix + "fc1."``, ``"fc2."``)."""
        self.fc1.check_state_dict(state_dict, prefix + "fc1.")
        self.fc2.check_state_dict(state_dict, prefix + "fc2.")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Both layers' entries checked before either loads: a rejected load changes neither.
        self.check_state_dict(state_dict, prefix)
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
            + (", gate_up_order='interleaved'" if self._act.interleaved else "")
            + (f", alpha={self.alpha}" if self.alpha is not None else "")
            + (f", limit={self.limit}" if self.limit is not None else "")
            + (", recompute_activation=True" if self.recompute_activation else "")
            + (f", probs_on={self.probs_on!r}" if self.probs_on != "activation" else "")
        )
