"""The cached launch path of the Triton kernels (kernels/_triton.py) on CUDA."""

import pytest
import torch

from grouped_linear.kernels import _triton, triton_gemm
from tests.reference import grouped_linear_ref, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _forward(x, weight, sizes):
    got = triton_gemm.forward(x, weight, None, sizes)
    want = grouped_linear_ref(x.double(), weight.double(), None, sizes.tolist())
    return rel_err(got, want)


def test_cached_launches_follow_the_argument_specialization(monkeypatch):
    """Aligned and misaligned inputs, repeated: each specialization gets its own binary and
    every launch, cached or not, gives the reference result; the cached path is taken."""
    torch.manual_seed(0)
    kernel = triton_gemm._grouped_mm_kernel
    kernel._compiled.clear()
    runs = []
    monkeypatch.setattr(_triton, "FAST_LAUNCH", True)
    weight = torch.randn(3, 48, 64, device="cuda") / 8
    sizes = torch.tensor([5, 0, 27], device="cuda")
    base = torch.randn(33, 64, device="cuda")
    for _ in range(3):
        aligned = base[:32]            # 16-byte aligned data pointer, rows of 64
        shifted = base.view(-1)[1:1 + 32 * 63].view(32, 63)  # odd pointer and width
        assert _forward(aligned, weight, sizes) < 1e-5
        runs.append(len(kernel._compiled))
        assert _forward(shifted, weight[:, :, :63].contiguous(), sizes) < 1e-5
    assert runs[-1] == 2 and len(kernel._compiled) == 2


def test_switch_off_gives_the_same_result(monkeypatch):
    torch.manual_seed(1)
    x = torch.randn(40, 32, device="cuda")
    weight = torch.randn(2, 16, 32, device="cuda")
    sizes = torch.tensor([17, 23], device="cuda")
    monkeypatch.setattr(_triton, "FAST_LAUNCH", False)
    slow = triton_gemm.forward(x, weight, None, sizes)
    monkeypatch.setattr(_triton, "FAST_LAUNCH", True)
    fast = triton_gemm.forward(x, weight, None, sizes)
    fast = triton_gemm.forward(x, weight, None, sizes)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)
