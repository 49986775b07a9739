"""``nn.Module``s: parameters, initialisation and state-dict layouts."""

from .fp8_primary import to_fp8_weights
from .grouped_linear import GroupedLinear
from .mlp import GroupedMLP
from .moe import ExpertParallelMoE

__all__ = ["GroupedLinear", "GroupedMLP", "ExpertParallelMoE", "to_fp8_weights"]
