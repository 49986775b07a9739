"""``ExpertParallelMoE``: a routed MoE feed-forward block whose experts are spread over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ops.checks import check_int
from ..ops.permutation import permute, unpermute
from ..parallel.expert_parallel import combine, dispatch
from .grouped_linear import _check_entry
from .mlp import GroupedMLP

__all__ = ["ExpertParallelMoE"]


class ExpertParallelMoE(nn.Module):
    r"""Router (top-k softmax) -> permute -> dispatch -> local experts -> combine -> unpermute.

    Args:
        hidden_size: token width ``H``.
        ffn_hidden_size: expert width.
        num_experts: ``E``, over all ranks of ``ep_group``.
        top_k: experts per token; their probabilities are renormalised to sum to 1.
        ep_group: the expert-parallel process group (default: the world when
            ``torch.distributed`` is initialised, else a single process).
        **mlp_kwargs: passed to the local :class:`GroupedMLP` (``activation``,
            ``bias``, ``params_dtype``, ``recipe``, ...).

    Rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)``; the router is
    replicated (reduce its gradient like any data-parallel parameter).
    Shape: ``(T, H) -> (T, H)``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 *, ep_group: object | None = None, **mlp_kwargs) -> None:
        super().__init__()
        hidden_size = check_int("hidden_size", hidden_size)
        num_experts = check_int("num_experts", num_experts)
        top_k = check_int("top_k", top_k)
        distributed = dist.is_available() and dist.is_initialized()
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if distributed else 1
        self.ep_rank = dist.get_rank(ep_group) if distributed else 0
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by {self.ep_size} ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        # the experts first: GroupedMLP checks params_dtype and device before the router
        # uses them (registered after it, so the state dict keeps its order)
        experts = GroupedMLP(self.num_local_experts, hidden_size, ffn_hidden_size, **mlp_kwargs)
        factory = {k: mlp_kwargs[k] for k in ("device",) if k in mlp_kwargs}
        self.router = nn.Linear(hidden_size, num_experts, bias=False,
                                dtype=mlp_kwargs.get("params_dtype"), **factory)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_routed(x)[0]

    def forward_routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(y (T, H), router probabilities (T, E) float32, routed rows per expert (E,))``,
        for callers that add a load-balancing loss."""
        self._check_input(x)
        probs = F.softmax(self.router(x).float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)
        top_probs = (top_probs / top_probs.sum(dim=-1, keepdim=True)).to(x.dtype)
        # rows permuted as FP8 codes where the local fc1 reads them (not sent over ranks)
        recipe = None
        if self.ep_size == 1:
            recipe = self.experts.fc1.reads_fp8_rows(x.shape[0] * self.top_k, x.dtype,
                                                     x.device)
        x_perm, counts, row_map = permute(x, top_experts, self.num_experts, recipe=recipe)
        if self.ep_size > 1:
            x_local, local_counts, plan = dispatch(x_perm, counts, self.ep_group)
            y_perm = combine(self.experts(x_local, local_counts), plan)
        else:
            y_perm = self.experts(x_perm, counts)
        return unpermute(y_perm, row_map, top_probs), probs, counts

    def _check_input(self, x: object) -> None:
        """``x`` must be a ``(tokens, H)`` floating tensor of the router's dtype (any floating
        dtype under ``torch.autocast``) on its device: checked before routing."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x is {type(x).__name__}: expected a (tokens, {self.hidden_size}) "
                            "tensor")
        weight = self.router.weight
        if not x.is_floating_point():
            raise TypeError(f"x has dtype {x.dtype}: expected a floating-point tensor")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"x has dtype {x.dtype} but the parameters have dtype {weight.dtype}: "
                            "outside torch.autocast they must match")
        if x.device != weight.device:
            raise ValueError(f"x is on {x.device} but the parameters are on {weight.device}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x is {tuple(x.shape)}: expected a (tokens, {self.hidden_size}) "
                             "tensor")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Every entry checked before the router (loaded first) or an expert changes: a
        # rejected load changes nothing.
        key, shape = prefix + "router.weight", tuple(self.router.weight.shape)
        if key in state_dict:
            _check_entry(key, state_dict[key], shape)
        self.experts.check_state_dict(state_dict, prefix + "experts.")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, ep_size={self.ep_size}, "
                f"local_experts={self.num_local_experts}")
