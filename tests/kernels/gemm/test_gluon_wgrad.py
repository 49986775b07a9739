"""The Gluon (Hopper) grouped weight gradient with the bias gradient beside it, against
float64 and against torch's grouped GEMM.

Gluon has no CPU interpreter: the kernel tests run in ``make test-gpu``; CI compiles the
kernel for sm90 (tests/kernels/test_compiles_for_sm90.py) and checks the reference and
:func:`supported` here on CPU.
"""

import pytest
import torch
import torch.nn.functional as F

from grouped_linear.kernels.gemm import gluon_wgrad as wg
from tests.hardware import HOPPER_GLUON, sm90
from tests.reference import rel_err

BF16_TOL = 1e-2

CASES = [  # (sizes, rows past the groups, N, K): ragged ends, empty groups, partial tiles
    ([70, 0, 133, 1], 9, 136, 256),
    ([0, 0], 4, 128, 256),
    ([300, 1000], 0, 384, 1024),
    ([64], 0, 256, 192),
    ([1, 128, 0, 255, 700], 31, 272, 1088),
    ([5000, 3], 0, 128, 520),
    # many small groups: each program's loads run ahead across tiles of 0-3 row blocks
    ([(g * 37) % 150 for g in range(300)], 5, 512, 512),
]


def _float64(dy, x, sizes):
    grad_w = torch.zeros(len(sizes), dy.shape[1], x.shape[1], dtype=torch.float64)
    grad_b = torch.zeros(len(sizes), dy.shape[1], dtype=torch.float64)
    start = 0
    for g, size in enumerate(sizes):
        rows = dy[start:start + size].double().cpu()
        grad_w[g] = rows.T @ x[start:start + size].double().cpu()
        grad_b[g] = rows.sum(0)
        start += size
    return grad_w, grad_b


def test_reference_matches_float64_on_cpu():
    torch.manual_seed(0)
    sizes = [5, 0, 9]
    dy, x = torch.randn(17, 8, dtype=torch.float64), torch.randn(17, 24, dtype=torch.float64)
    ends = torch.tensor(sizes).cumsum(0)
    grad_w, grad_b = wg.wgrad_reference(dy, x, ends, True)
    want_w, want_b = _float64(dy, x, sizes)
    assert torch.allclose(grad_w, want_w) and torch.allclose(grad_b.double(), want_b)
    assert torch.equal(grad_w[1], torch.zeros(8, 24, dtype=torch.float64))
    assert wg.wgrad_reference(dy, x, ends, False)[1] is None


def test_not_supported_off_hopper_or_on_bad_operands():
    dy, x = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16)
    assert not wg.supported(dy, x, 2)  # CPU
    if HOPPER_GLUON:
        dy, x = dy.cuda(), x.cuda()
        assert wg.supported(dy, x, 2)
        assert not wg.supported(dy.float(), x.float(), 2)
        assert not wg.supported(dy, x.half(), 2)
        assert not wg.supported(dy[:, :100], x, 2)  # strided rows
        assert not wg.supported(dy[:32], x, 2)  # row counts differ
        assert not wg.supported(dy, x, 2**31 // 128)  # output rows past int32 coordinates


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, N, K", CASES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("band_n", [1, 3, 8])
def test_wgrad_against_float64(sizes, tail, N, K, with_bias, band_n):
    torch.manual_seed(1)
    M = sum(sizes) + tail
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    # rows past the groups must not reach any sum, whatever they hold
    dy[sum(sizes):] = float("nan")
    x[sum(sizes):] = float("inf")
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    assert wg.supported(dy, x, len(sizes))
    grad_w, grad_b = wg.wgrad(dy, x, ends, with_bias,
                              config=wg.WGRAD_CONFIG._replace(band_n=band_n))
    want_w, want_b = _float64(dy, x, sizes)
    assert grad_w.shape == (len(sizes), N, K) and grad_w.dtype == torch.bfloat16
    assert rel_err(grad_w.cpu(), want_w) < BF16_TOL
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.equal(grad_w[g], torch.zeros_like(grad_w[g]))
    if with_bias:
        assert grad_b.shape == (len(sizes), N) and grad_b.dtype == torch.float32
        assert rel_err(grad_b.cpu(), want_b) < 1e-5  # float32 sums of bf16 values
    else:
        assert grad_b is None


def test_bias_dtype_outside_the_stored_ones_is_refused():
    dy, x = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16)
    ends = torch.tensor([64], dtype=torch.int32)
    with pytest.raises(ValueError, match="bias_dtype=torch.float64"):
        wg.wgrad(dy, x, ends, True, bias_dtype=torch.float64)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16])
def test_bias_gradient_stored_in_bias_dtype(bias_dtype):
    """The float32 sums rounded once, to the bias's dtype, in the kernel."""
    torch.manual_seed(3)
    sizes = [200, 0, 77, 391]
    M, N, K = sum(sizes), 264, 256
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    grad_w, grad_b = wg.wgrad(dy, x, ends, True, bias_dtype=bias_dtype)
    _, sums = wg.wgrad(dy, x, ends, True)  # float32
    assert grad_b.dtype == bias_dtype and grad_b.shape == (len(sizes), N)
    assert torch.equal(grad_b, sums.to(bias_dtype))
    assert rel_err(grad_b.cpu(), _float64(dy, x, sizes)[1]) < BF16_TOL


@pytest.mark.gpu
@sm90
def test_fp16_matches_torch_grouped_mm_and_bias_sums():
    torch.manual_seed(2)
    sizes = [513, 0, 1200, 7, 260]
    M, N, K = sum(sizes), 768, 1024
    dy = torch.randn(M, N, device="cuda", dtype=torch.float16)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    grad_w, grad_b = wg.wgrad(dy, x, ends, True)
    assert rel_err(grad_w, F.grouped_mm(dy.t(), x, offs=ends)) < 1e-2
    sums = torch.stack([part.float().sum(0) for part in dy.split(sizes)])
    assert rel_err(grad_b, sums) < 1e-5


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, N, K", CASES)
def test_float32_output_is_the_unrounded_sum(sizes, tail, N, K):
    """``out_dtype=torch.float32`` (an fp32 ``main_grad``): the accumulator stored as it is,
    within float32 rounding of float64 (bf16 products are exact in float32)."""
    torch.manual_seed(4)
    M = sum(sizes) + tail
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy[sum(sizes):] = float("nan")
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    grad_w, grad_b = wg.wgrad(dy, x, ends, True, out_dtype=torch.float32)
    want_w, want_b = _float64(dy, x, sizes)
    assert grad_w.dtype == torch.float32 and grad_w.shape == (len(sizes), N, K)
    assert rel_err(grad_w.cpu(), want_w) < 1e-5
    assert rel_err(grad_b.cpu(), want_b) < 1e-5
    rounded, _ = wg.wgrad(dy, x, ends, False)
    assert torch.equal(rounded, grad_w.to(torch.bfloat16))


@pytest.mark.gpu
@sm90
def test_planned_launches_read_the_new_tensors():
    """Later calls of a geometry launch from the plan the first one kept (no new plan):
    on the new operands and outputs, each result against float64."""
    sizes, N, K = [130, 0, 64, 5], 256, 512
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    plans = None
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        dy = torch.randn(sum(sizes), N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(sum(sizes), K, device="cuda", dtype=torch.bfloat16)
        grad_w, grad_b = wg.wgrad(dy, x, ends, True)
        want_w, want_b = _float64(dy, x, sizes)
        assert rel_err(grad_w.cpu(), want_w) < BF16_TOL
        assert rel_err(grad_b.cpu(), want_b) < 1e-5
        plans = plans if plans is not None else len(wg._PLANS)
        assert len(wg._PLANS) == plans > 0
