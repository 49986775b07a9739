"""Differentiable ops composed from the kernels (autograd functions, torch.library operators).

:func:`~.grouped_linear.apply_grouped_linear` is the one entry point of a grouped linear
call: it normalises the splits (:mod:`.splits`), chooses the route (:mod:`.dispatch`) and
applies its autograd function.
"""

from .grouped_linear import grouped_linear
from .splits import GroupSplits, normalize_splits

__all__ = ["grouped_linear", "GroupSplits", "normalize_splits"]
