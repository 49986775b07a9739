"""The launch wrapper of the Triton kernels (kernels/_triton.py) off the GPU: under the CPU
interpreter every launch takes Triton's own path, and the wrapper passes the JIT function's
attributes through (the sm90 compile test reads them)."""

import pytest
import torch

from grouped_linear.kernels import _triton, triton_gemm
from grouped_linear.kernels._triton import HAS_TRITON, interpreting

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def test_wrapper_exposes_the_jit_function():
    kernel = triton_gemm._grouped_mm_kernel
    assert kernel.jit_fn is not kernel
    assert kernel.fn is kernel.jit_fn.fn  # the Python function under the JIT
    assert getattr(kernel, "params", None) is getattr(kernel.jit_fn, "params", None)


@pytest.mark.skipif(not interpreting() or torch.cuda.is_available(),
                    reason="the interpreter path (CPU CI)")
def test_interpreted_launches_are_not_cached():
    kernel = triton_gemm._grouped_mm_kernel
    kernel._compiled.clear()
    x = torch.randn(12, 16)
    weight = torch.randn(2, 8, 16)
    out = triton_gemm.forward(x, weight, None, torch.tensor([5, 7]))
    torch.testing.assert_close(out[:5], x[:5] @ weight[0].t())
    torch.testing.assert_close(out[5:], x[5:] @ weight[1].t())
    assert kernel._compiled == {} and _triton.FAST_LAUNCH
