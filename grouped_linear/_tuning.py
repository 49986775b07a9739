"""The thresholds that choose between implementations, in one place.

Each value was set by a measurement (``docs/design.md`` says which); they stay values, not
constants in the code, so that tests can move a threshold to reach both sides of it on
small problems. :func:`override` is that hook: the one way to change them, for a ``with``
block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Tuning", "current", "override"]


@dataclass(frozen=True)
class Tuning:
    """Attributes:
        triton_auto_max_rows: ``backend="auto"`` sends bf16/fp16 CUDA calls of up to this many
            rows to the Triton kernels (one launch per GEMM, bias and tail fused), larger ones
            to the grouped GEMMs.
        fp8_fused_max_work: FP8 CUDA calls whose rows x
            in_features x out_features is at most this run the ``fp8_fused`` route (one
            launch per GEMM, quantization inside: small calls are bound by host time);
            larger ones the FP8 GEMM routes.
        fp8_fused_max_weights: and whose groups x in_features x out_features is at most
            this (``Float8Blockwise``: :attr:`fp8_fused_max_block_weights`): the fused
            kernels' time grows with the weight they read and write per step, the GEMM
            routes' host time does not.
    """

    triton_auto_max_rows: int = 4096
    fp8_fused_max_work: int = 2**32
    fp8_fused_max_weights: int = 2**27
    fp8_fused_max_block_weights: int = 2**26


_current = Tuning()


def current() -> Tuning:
    """The thresholds in force."""
    return _current


@contextlib.contextmanager
def override(**changes: int) -> Iterator[Tuning]:
    """Replace some thresholds inside a ``with`` block (tests reach both sides of one this way).
    Unknown names raise ``TypeError``."""
    global _current
    previous = _current
    _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
