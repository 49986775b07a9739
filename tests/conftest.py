import os

import torch

# Without a GPU, Triton kernels run under Triton's CPU interpreter (set before any import of triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_precision():
    torch.manual_seed(0)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.fixture(autouse=True)
def _fp8_routes_under_test(request):
    """Small FP8 calls on CUDA take the ``fp8_fused`` route by default, and the tests' problems
    are small: tests written for the other FP8 routes keep them (the threshold at 0); the
    ``fp8_fused`` route's own tests, marked so, get the default rule."""
    if request.node.get_closest_marker("fp8_fused"):
        yield
        return
    from grouped_linear import _tuning

    with _tuning.override(fp8_fused_max_work=0):
        yield
