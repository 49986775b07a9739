"""Argument checks shared by the ops and modules: errors name the argument and the value."""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable

import torch

__all__ = ["MAX_ROWS", "DEVICE_TYPES", "check_int", "host_checks", "check_matrix", "check_operands",
           "check_tensor", "describe", "is_bool"]

# The most rows a tensor dimension (and an int64 row index or cumulative sum) can hold.
MAX_ROWS = 2**63 - 1


def host_checks() -> bool:
    """Whether checks that read tensor values on the host run: not while ``torch.compile``
    traces (the kernels then treat out-of-range entries as dropped instead)."""
    return not torch.compiler.is_compiling()


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


DEVICE_TYPES = ("cpu", "cuda")


def check_operands(x: torch.Tensor, tensors: Iterable[tuple[str, torch.Tensor | None]]
                   ) -> torch.device:
    """``x``'s device once it is CPU or CUDA and every named tensor (``None`` skipped) is a
    floating-point tensor on it: ``ValueError`` (device) or ``TypeError`` (dtype) naming the
    first that is not. Nothing reads a value."""
    device = x.device  # read once: every read builds a new torch.device
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"x is on {device}: expected a tensor on one of {DEVICE_TYPES}")
    for name, tensor in tensors:
        if tensor is None:
            continue
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {device}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} has dtype {tensor.dtype}: expected a floating-point tensor")
    return device


def describe(value: object) -> str:
    """``value`` for an error message: its repr where short, and its type."""
    text = repr(value)
    kind = type(value).__name__
    return f"{text} ({kind})" if len(text) <= 40 and "\n" not in text else kind


def check_tensor(name: str, value: object, what: str = "a torch.Tensor") -> torch.Tensor:
    """``value`` if it is a tensor, else ``TypeError`` naming ``name`` and the value."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {what}, got {describe(value)}")
    return value
