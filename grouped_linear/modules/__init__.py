"""``nn.Module``s: parameters, initialisation and state-dict layouts."""

from .grouped_linear import GroupedLinear
from .mlp import GroupedMLP

__all__ = ["GroupedLinear", "GroupedMLP"]
