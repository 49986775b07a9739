"""The compute steps as ``torch.library`` operators, for ``torch.compile`` to trace.

Each step is a plain function (eager calls go to it directly); here it also becomes the
operator ``torch.ops.grouped_linear.<name>`` with its schema inferred from the type
hints, one ``CompositeExplicitAutograd`` kernel (the function itself) and a fake
(shape-only) implementation. The autograd functions of :mod:`grouped_linear.ops` call
these operators only while compiling, inside their own forward and backward, so the
operators need no autograd kernel of their own. Registered this way rather than with
``torch.library.custom_op``: a compiled step then reaches the function through the
dispatcher directly, without custom_op's Python autograd and device-dispatch layers
(host time that a small compiled step pays once per operator call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["compute_op", "register_fake"]

_LIBRARY = torch.library.Library("grouped_linear", "DEF")


def compute_op(name: str, impl: Callable) -> Callable:
    """Define ``grouped_linear::<name>`` with ``impl`` as its kernel on every device;
    returns the operator (``torch.ops.grouped_linear.<name>.default``)."""
    _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    return getattr(torch.ops.grouped_linear, name).default


def register_fake(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the shape-only implementation of ``grouped_linear::<name>``."""

    def decorator(fake: Callable) -> Callable:
        torch.library.register_fake(f"grouped_linear::{name}", fake, lib=_LIBRARY)
        return fake

    return decorator
