"""``nn.Module``s: parameters, initialisation and state-dict layouts."""

from .grouped_linear import GroupedLinear
from .mlp import GroupedMLP
from .moe import ExpertParallelMoE

__all__ = ["GroupedLinear", "GroupedMLP", "ExpertParallelMoE"]
