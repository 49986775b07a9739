"""The Gluon (Hopper) block-scaled FP8 weight-gradient GEMM against float64 matmuls of the
dequantized operands.

Gluon has no CPU interpreter: the kernel tests run in ``make test-gpu``; CI compiles the kernel
for sm90 (tests/kernels/test_compiles_for_sm90.py) and runs the Triton kernel with the same
contract under the interpreter (tests/kernels/gemm/test_fp8_triton_gemm.py).
"""

import pytest
import torch

from grouped_linear.kernels.gemm import fp8_gluon_wgrad as gw
from grouped_linear.kernels.gemm import fp8_triton_gemm as fg
from grouped_linear.kernels.quantize import blocks as qb
from tests.hardware import sm90
from tests.reference import rel_err

E4M3 = torch.float8_e4m3fn
# fp32 accumulation of exact FP8 products against float64: only rounding differs
TOL = 2e-3


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, N, K", [([70, 0, 133, 1], 9, 136, 200),
                                               ([0, 0], 3, 128, 128),
                                               ([1000, 24, 300], 0, 384, 256)])
def test_blockwise_wgrad_against_float64_reference(sizes, tail, N, K):
    M = sum(sizes) + tail
    sizes_t = torch.tensor(sizes, device="cuda")
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy_t, dy_inv = qb.quantize_token_blocks(dy, sizes_t, E4M3, True, transpose=True)
    x_t, x_inv = qb.quantize_token_blocks(x, sizes_t, E4M3, True, transpose=True)
    assert gw.wgrad_supported(dy_t, dy_inv, x_t, x_inv, len(sizes))
    got = gw.blockwise_wgrad(dy_t, dy_inv, x_t, x_inv, sizes_t, M, out_dtype=torch.float32)
    want = fg.blockwise_wgrad_reference(dy_t, dy_inv.double(), x_t, x_inv.double(), sizes_t,
                                        M, out_dtype=torch.float64)
    assert got.shape == (len(sizes), N, K)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(got[g], torch.zeros_like(got[g]))
        else:
            assert rel_err(got[g], want[g]) < TOL


def test_cpu_operands_go_to_the_triton_kernel():
    a = torch.zeros(256, 64).to(E4M3)
    inv = torch.ones(1, 256)
    assert not gw.wgrad_supported(a, inv, a, inv, 1)


@pytest.mark.gpu
@sm90
def test_wgrad_factor_rows_tma_cannot_address_are_not_taken():
    sizes = torch.tensor([300], device="cuda")
    dy_t, dy_inv = qb.quantize_token_blocks(torch.randn(300, 130, device="cuda"), sizes, E4M3,
                                            True, transpose=True)
    x_t, x_inv = qb.quantize_token_blocks(torch.randn(300, 256, device="cuda"), sizes, E4M3,
                                          True, transpose=True)
    assert gw.wgrad_supported(x_t, x_inv, x_t, x_inv, 1)
    assert not gw.wgrad_supported(dy_t, dy_inv, x_t, x_inv, 1)  # 130 floats: 520-byte rows
    assert not gw.wgrad_supported(x_t, x_inv.double(), x_t, x_inv, 1)
    assert not gw.wgrad_supported(x_t, x_inv[:, :128], x_t, x_inv, 1)  # not dy's columns


@pytest.mark.gpu
@sm90
def test_many_tiles_per_program_match_the_triton_kernel_bit_for_bit():
    """More tiles than SMs (each program walks several, across groups; the loader runs into
    the next tile), skewed and empty groups, a tail: the same products in the same order as
    the Triton kernel's."""
    sizes = torch.tensor([3000, 0, 5, 1800, 700], device="cuda")
    M, N, K = 5600, 1024, 768
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy_t = qb.quantize_token_blocks(dy, sizes, E4M3, True, transpose=True)
    x_t = qb.quantize_token_blocks(x, sizes, E4M3, True, transpose=True)
    gluon = gw.blockwise_wgrad(*dy_t, *x_t, sizes, M)
    assert torch.equal(gluon, fg.blockwise_wgrad(*dy_t, *x_t, sizes, M))
    assert torch.equal(gluon[1], torch.zeros_like(gluon[1]))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, N, K", [([70, 0, 133, 1], 9, 136, 200),
                                               ([3000, 0, 5, 1800, 700], 0, 1024, 768)])
def test_group_scaled_wgrad_against_float64_and_the_triton_kernel(sizes, tail, N, K):
    """The rowwise recipes' operands (one factor per group and row, 128-token group
    alignment): each block's product joins the float32 sum unscaled, the tile is scaled once;
    against float64 and against the Triton kernel, which scales every block."""
    from grouped_linear.kernels.quantize import transposed as qt

    M = sum(sizes) + tail
    sizes_t = torch.tensor(sizes, device="cuda")
    ends = sizes_t.cumsum(0).to(torch.int32)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy_t, dy_inv, _ = qt.quantize_group_columns_t(dy, ends, E4M3, False, align=fg.BLOCK)
    x_t, x_inv, _ = qt.quantize_group_columns_t(x, ends, E4M3, False, align=fg.BLOCK)
    assert gw.wgrad_supported(dy_t, dy_inv, x_t, x_inv, len(sizes))
    got = gw.blockwise_wgrad(dy_t, dy_inv, x_t, x_inv, sizes_t, M, out_dtype=torch.float32,
                             group_scales=True)
    want = fg.blockwise_wgrad_reference(dy_t, dy_inv.double(), x_t, x_inv.double(), sizes_t,
                                        M, out_dtype=torch.float64, group_scales=True)
    triton = fg.blockwise_wgrad(dy_t, dy_inv, x_t, x_inv, sizes_t, M, torch.float32,
                                group_scales=True)
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(got[g], torch.zeros_like(got[g]))
        else:
            assert rel_err(got[g], want[g]) < TOL
            assert rel_err(got[g], triton[g]) < 1e-5
