"""Argument checks shared by the ops and modules: errors name the argument and the value."""

from __future__ import annotations

import operator
import sys

import torch

__all__ = ["MAX_ROWS", "check_int", "check_matrix", "is_bool"]

# The most rows a tensor dimension (and an int64 row index or cumulative sum) can hold.
MAX_ROWS = 2**63 - 1


def is_bool(value: object) -> bool:
    """Whether ``value`` is a boolean: a Python ``bool``, a NumPy boolean (scalar or array) or a
    bool tensor. NumPy's booleans still pass ``operator.index`` (as 0 or 1) in NumPy 2.x."""
    if isinstance(value, bool):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    numpy = sys.modules.get("numpy")  # loaded wherever a NumPy value exists
    return (numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray))
            and value.dtype == numpy.bool_)


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``; ``TypeError`` (not an integer, or a
    boolean) or ``ValueError`` (out of range), each naming ``name`` and the value."""
    if not is_bool(value):
        try:
            result = operator.index(value)
        except TypeError:
            pass
        else:
            if result < minimum:
                raise ValueError(f"{name} is {result}: must be >= {minimum}")
            if maximum is not None and result > maximum:
                raise ValueError(f"{name} is {result}: must be <= {maximum}")
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
