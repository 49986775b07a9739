"""Differentiable ops composed from the kernels (autograd functions, torch.library operators)."""

from .grouped_linear import grouped_linear
from .splits import GroupSplits, normalize_splits

__all__ = ["grouped_linear", "GroupSplits", "normalize_splits"]
