"""The Gluon (Hopper) block-scaled FP8 GEMMs against float64 matmuls of the dequantized
operands and against the Triton kernels they replace on sm90.

Gluon has no CPU interpreter: the kernel tests run in ``make test-gpu``; CI compiles the kernels
for sm90 (tests/kernels/test_compiles_for_sm90.py) and runs the Triton kernels with the
same contracts under the interpreter (tests/kernels/gemm/test_fp8_triton_gemm.py).
"""

import pytest
import torch

from grouped_linear.kernels.gemm import fp8_gluon_gemm as gg
from grouped_linear.kernels.gemm import fp8_triton_gemm as fg
from tests.hardware import sm90
from tests.reference import rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# fp32 accumulation of exact FP8 products against float64: only rounding differs
TOL = 2e-3


def _fp8(*shape, dtype=E4M3):
    return (torch.randn(*shape, device="cuda") * 40).clamp(-448, 448).to(dtype)


def _factors(*shape):
    return torch.rand(*shape, device="cuda") * 0.1 + 0.01


CASES = [  # (sizes, rows past the groups, R, W): ragged ends, empty groups, one block deep
    ([70, 0, 133, 1], 9, 208, 136),
    ([0, 0], 4, 256, 128),
    ([300, 1000], 0, 2048, 384),
    ([64], 0, 256, 128),
    ([1, 128, 0, 255, 700], 31, 1040, 272),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, R, W", CASES)
@pytest.mark.parametrize("b_dtype", [E4M3, E5M2])
def test_grouped_mm_against_float64_reference(sizes, tail, R, W, b_dtype):
    G, M = len(sizes), sum(sizes) + tail
    a, weight = _fp8(M, R), _fp8(G, W, R, dtype=b_dtype)
    a_inv, w_inv = _factors(M, -(-R // 128)), _factors(G, -(-W // 128), -(-R // 128))
    sizes_t = torch.tensor(sizes, device="cuda")
    assert gg.supported(a, weight)
    got = gg.grouped_mm(a, a_inv, weight, w_inv, sizes_t, out_dtype=torch.float32)
    want = fg.grouped_mm_reference(a, a_inv.double(), weight, w_inv.double(), sizes_t,
                                   transpose_weight=True, out_dtype=torch.float64)
    assert got.shape == (M, W)
    assert rel_err(got, want) < TOL
    assert torch.equal(got[sum(sizes):], torch.zeros_like(got[sum(sizes):]))


@pytest.mark.gpu
@sm90
def test_grouped_mm_bf16_output_matches_triton_kernel():
    sizes = torch.tensor([513, 0, 1200, 7], device="cuda")
    M, R, W = 1720 + 40, 1024, 512
    a, weight = _fp8(M, R), _fp8(4, W, R)
    a_inv, w_inv = _factors(M, R // 128), _factors(4, W // 128, R // 128)
    got = gg.grouped_mm(a, a_inv, weight, w_inv, sizes)
    want = fg.grouped_mm(a, a_inv, weight, w_inv, sizes, transpose_weight=True)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@sm90
def test_device_sizes_past_the_rows_are_clamped():
    a, weight = _fp8(100, 128), _fp8(2, 128, 128)
    a_inv, w_inv = _factors(100, 1), _factors(2, 1, 1)
    sizes = torch.tensor([60, 500], device="cuda")  # sums past M: the second group ends at 100
    got = gg.grouped_mm(a, a_inv, weight, w_inv, sizes, out_dtype=torch.float32)
    want = fg.grouped_mm_reference(a, a_inv.double(), weight, w_inv.double(), sizes,
                                   transpose_weight=True, out_dtype=torch.float64)
    assert rel_err(got, want) < TOL


@pytest.mark.gpu
@sm90
def test_unsupported_operands_are_refused():
    a, weight = _fp8(64, 200), _fp8(1, 128, 200)  # 200-byte rows: not a TMA row pitch
    assert not gg.supported(a, weight)
    a, weight = _fp8(64, 256), _fp8(1, 128, 256)
    assert gg.supported(a, weight)
    assert not gg.supported(_fp8(64, 128), _fp8(1, 128, 128))  # one block: nothing to overlap
    assert not gg.supported(a[:, :128], weight[:, :, :128])  # not contiguous
    assert not gg.supported(a.float(), weight)


def test_cpu_operands_go_to_the_triton_kernels():
    a = torch.zeros(64, 256).to(E4M3)
    weight = torch.zeros(1, 128, 256).to(E4M3)
    assert not gg.supported(a, weight)
