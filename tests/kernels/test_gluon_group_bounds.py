"""The group bound of the Gluon FP8 kernels' ``supported()`` checks, on CPU.

Each of these kernels scans a table of the groups held in registers, so each takes at most
4095 groups (a table of 4096 slots), as the other Gluon kernels state. The checks are run
here on CPU tensors that answer as CUDA ones, on a faked sm90 device: operands every other
condition accepts, on either side of the bound.
"""

import pytest
import torch

from grouped_linear.kernels.gemm import fp8_gluon_gemm, fp8_gluon_wgrad, triton_gemm
from grouped_linear.kernels.quantize import blocks_gluon, transposed_gluon

E4M3 = torch.float8_e4m3fn
BOUND = 4095


class _OnCuda:
    """A CPU tensor that reports itself on a CUDA device (only the checks read it)."""

    is_cuda = True

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __getattr__(self, name: str):
        return getattr(self._tensor, name)


@pytest.fixture
def sm90(monkeypatch):
    for module in (fp8_gluon_gemm, fp8_gluon_wgrad, blocks_gluon):
        monkeypatch.setattr(module, "HAS_GLUON", True)
        monkeypatch.setattr(module, "is_sm90", lambda index: True)


def test_the_bound_is_the_other_gluon_kernels_and_the_routes():
    """The same bound as the transposed quantization's kernel, and no lower than what the
    routes reaching these kernels (``fp8_blockwise``, ``fp8_scaled_mm``) hand them."""
    assert fp8_gluon_gemm.MAX_GROUPS == blocks_gluon.MAX_GROUPS == BOUND
    assert transposed_gluon.MAX_GROUPS == BOUND
    assert fp8_gluon_wgrad.MAX_GROUPS == BOUND  # the forward kernel's, imported
    assert triton_gemm.MAX_GROUPS == BOUND


@pytest.mark.parametrize("groups", [1, BOUND, BOUND + 1, 65536])
def test_blockwise_gemm(groups, sm90):
    a = _OnCuda(torch.zeros(64, 256, dtype=E4M3))
    weight = _OnCuda(torch.zeros(groups, 1, 256, dtype=E4M3))
    assert fp8_gluon_gemm.supported(a, weight) == (groups <= BOUND)


@pytest.mark.parametrize("groups", [1, BOUND, BOUND + 1, 65536])
def test_blockwise_wgrad(groups, sm90):
    blocks = _OnCuda(torch.zeros(128, 256, dtype=E4M3))  # (columns, tokens in blocks)
    inv = _OnCuda(torch.ones(2, 128))  # one factor row per 128-token block
    assert fp8_gluon_wgrad.wgrad_supported(blocks, inv, blocks, inv, groups) == (
        groups <= BOUND)


@pytest.mark.parametrize("groups", [1, BOUND, BOUND + 1, 65536])
def test_quantize_both_layouts(groups, sm90):
    t = _OnCuda(torch.zeros(64, 256, dtype=torch.bfloat16))
    assert blocks_gluon.supported(t, groups) == (groups <= BOUND)


def test_cpu_tensors_are_refused_whatever_the_groups(sm90):
    """Without the stand-in the CPU tensors fail the device check: the fakes above change
    only what the device reports."""
    a, weight = torch.zeros(64, 256, dtype=E4M3), torch.zeros(1, 1, 256, dtype=E4M3)
    assert not fp8_gluon_gemm.supported(a, weight)
    blocks, inv = torch.zeros(128, 256, dtype=E4M3), torch.ones(2, 128)
    assert not fp8_gluon_wgrad.wgrad_supported(blocks, inv, blocks, inv, 1)
    assert not blocks_gluon.supported(torch.zeros(64, 256, dtype=torch.bfloat16), 1)
