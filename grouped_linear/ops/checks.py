"""Argument checks shared by the ops and modules: errors name the argument and the value."""

from __future__ import annotations

import operator

import torch

__all__ = ["check_int", "check_matrix"]


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum``; ``TypeError`` (not an integer, or a bool) or
    ``ValueError`` (too small), each naming ``name`` and the value."""
    if not isinstance(value, bool):
        try:
            result = operator.index(value)
        except TypeError:
            pass
        else:
            if result < minimum:
                raise ValueError(f"{name} is {result}: must be >= {minimum}")
            return result
    raise TypeError(
        f"{name} is {value!r} of type {type(value).__name__}: expected an int >= {minimum}"
    )


def check_matrix(x: object, name: str) -> torch.Tensor:
    """``x`` if it is a 2-D tensor; else ``TypeError`` (not a tensor) or ``ValueError`` (another
    rank), each naming ``name`` and what it got."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} is {type(x).__name__}: expected a torch.Tensor")
    if x.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: expected a 2-D tensor")
    return x
