"""Triton, when it is importable (CUDA builds of torch bring it; CPU builds need the extra).

Without Triton the kernel modules still import: ``triton.jit`` becomes a no-op
decorator and only the plain-PyTorch references run.
"""

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton installed
    HAS_TRITON = False

    class _Stub:
        constexpr = object

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

    triton = tl = _Stub()

__all__ = ["triton", "tl", "HAS_TRITON", "interpreting", "use_triton"]


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``tensor``'s device."""
    return HAS_TRITON and (tensor.is_cuda or (interpreting() and tensor.device.type == "cpu"))
