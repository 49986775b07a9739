"""The Gluon (Hopper) bf16/fp16 grouped GEMM with the bias in its epilogue, against float64
matmuls and against torch's grouped GEMM.

Gluon has no CPU interpreter: the kernel tests run in ``make test-gpu``; CI compiles the
kernel for sm90 (tests/kernels/test_compiles_for_sm90.py) and checks the reference and
:func:`supported` here on CPU.
"""

import pytest
import torch
import torch.nn.functional as F

from grouped_linear.kernels.gemm import gluon_gemm as bg
from tests.hardware import HOPPER_GLUON, sm90
from tests.reference import rel_err

BF16_TOL = 1e-2

CASES = [  # (sizes, rows past the groups, K, N): ragged ends, empty groups, narrow outputs
    ([70, 0, 133, 1], 9, 256, 136),
    ([0, 0], 4, 256, 128),
    ([300, 1000], 0, 1024, 384),
    ([64], 0, 192, 256),
    ([1, 128, 0, 255, 700], 31, 1088, 272),
]


def _float64_reference(x, weight, sizes, bias, transposed):
    out = torch.zeros(x.shape[0], weight.shape[2] if transposed else weight.shape[1],
                      dtype=torch.float64, device=x.device)
    start = 0
    for g, size in enumerate(sizes):
        w = weight[g].double()
        rows = x[start:start + size].double() @ (w if transposed else w.T)
        out[start:start + size] = rows + (bias[g].double() if bias is not None else 0)
        start += size
    return out


def test_reference_matches_float64_loop_on_cpu():
    torch.manual_seed(0)
    sizes = [5, 0, 9]
    x, weight = torch.randn(17, 24, dtype=torch.float64), torch.randn(3, 8, 24, dtype=torch.float64)
    bias = torch.randn(3, 8, dtype=torch.float64)
    ends = torch.tensor(sizes).cumsum(0)
    got = bg.grouped_mm_reference(x, weight, ends, bias)
    assert torch.allclose(got, _float64_reference(x, weight, sizes, bias, False))
    assert torch.equal(got[14:], torch.zeros(3, 8, dtype=torch.float64))
    dy = torch.randn(17, 8, dtype=torch.float64)
    got = bg.grouped_mm_reference(dy, weight, ends, transposed_weight=True)
    assert torch.allclose(got, _float64_reference(dy, weight, sizes, None, True))


def test_not_supported_off_hopper_or_on_bad_operands():
    x, weight = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 128, 256,
                                                                        dtype=torch.bfloat16)
    assert not bg.supported(x, weight)  # CPU
    if HOPPER_GLUON:
        x, weight = x.cuda(), weight.cuda()
        assert bg.supported(x, weight)
        assert not bg.supported(x.float(), weight.float())
        assert not bg.supported(x, weight.half())
        assert not bg.supported(x[:, :128], weight)  # strided rows, wrong depth
        assert not bg.supported(x[:, :64].contiguous(), weight[:, :, :64].contiguous())
        assert not bg.supported(torch.randn(64, 136, device="cuda", dtype=torch.bfloat16),
                                torch.randn(2, 136, 256, device="cuda", dtype=torch.bfloat16),
                                transposed_weight=True)  # dgrad depth not whole blocks


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, K, N", CASES)
@pytest.mark.parametrize("gemm", ["forward with bias", "forward", "dgrad"])
def test_grouped_mm_against_float64_reference(sizes, tail, K, N, gemm):
    torch.manual_seed(1)
    G, M = len(sizes), sum(sizes) + tail
    transposed = gemm == "dgrad"
    if transposed:  # weight (G, R, K): the reduction R in whole blocks
        block_k = bg.MM_CONFIG[2]
        blocks = max(-(-N // block_k), bg.MM_CONFIG.stages - 1)
        weight = torch.randn(G, blocks * block_k, K, device="cuda", dtype=torch.bfloat16)
    else:
        weight = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, weight.shape[1] if transposed else K, device="cuda",
                    dtype=torch.bfloat16)
    width = weight.shape[2] if transposed else weight.shape[1]
    bias = (torch.randn(G, width, device="cuda", dtype=torch.bfloat16)
            if gemm == "forward with bias" else None)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    assert bg.supported(x, weight, transposed)
    got = bg.grouped_mm(x, weight, ends, bias, transposed_weight=transposed)
    want = _float64_reference(x, weight, sizes, bias, transposed)
    assert got.shape == (M, width) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < BF16_TOL
    assert torch.equal(got[sum(sizes):], torch.zeros_like(got[sum(sizes):]))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("config", [
    bg.MM_CONFIG, bg.MMConfig(128, 128, 64, 8, 4, group_m=1),
    bg.MMConfig(128, 128, 64, 4, 3, group_m=3), bg.MMConfig(128, 256, 64, 8, 3, tma_store=True),
    bg.MMConfig(64, 128, 64, 4, 4, group_m=2, tma_store=True)])
@pytest.mark.parametrize("transposed", [False, True])
def test_configs_and_fp16_match_torch_grouped_mm(config, transposed):
    torch.manual_seed(2)
    sizes = [513, 0, 1200, 7, 260]
    M, K, N = sum(sizes), 1024, 768
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        weight = torch.randn(len(sizes), N, K, device="cuda", dtype=dtype) / 32
        ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        if transposed:
            x = torch.randn(M, N, device="cuda", dtype=dtype)
        bias = torch.randn(len(sizes), K if transposed else N, device="cuda", dtype=dtype)
        got = bg.grouped_mm(x, weight, ends, None if transposed else bias,
                            transposed_weight=transposed, config=config)
        want = F.grouped_mm(x, weight if transposed else weight.transpose(-2, -1), offs=ends)
        if not transposed:
            want += torch.repeat_interleave(bias, torch.tensor(sizes, device="cuda"), dim=0)
        assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@sm90
def test_device_ends_past_the_rows_are_clamped_and_decreasing_ends_are_empty():
    torch.manual_seed(3)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3, 128, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(3, 128, device="cuda", dtype=torch.bfloat16)
    got = bg.grouped_mm(x, weight, torch.tensor([100, 95, 1000], device="cuda"), bias)
    want = _float64_reference(x, weight, [100, 0, 200], bias, False)
    assert rel_err(got, want) < BF16_TOL


@pytest.mark.gpu
@sm90
def test_rows_and_columns_past_two_to_the_31_elements():
    # 2^31 / 4096 rows: the output's element offsets pass int32
    M, K, N = 2**31 // 4096 + 384, 128 + 64, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1, N, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
    got = bg.grouped_mm(x, weight, torch.tensor([M], device="cuda"), bias)
    tail = slice(M - 256, M)
    want = x[tail].double() @ weight[0].double().T + bias[0].double()
    assert rel_err(got[tail], want) < BF16_TOL


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("gemm", ["forward with bias", "dgrad"])
def test_a_weight_stored_input_major_is_read_in_place(gemm):
    """``weight`` the ``transpose(1, 2)`` view of a contiguous ``(G, K, N)`` tensor (a layer
    stored input-major): taken as it is and equal to the contiguous weight's result."""
    torch.manual_seed(4)
    sizes, K, N = [700, 0, 45, 1300], 1024, 640
    stored = torch.randn(len(sizes), K, N, device="cuda", dtype=torch.bfloat16)
    weight = stored.transpose(1, 2)
    assert not weight.is_contiguous()
    transposed = gemm == "dgrad"
    x = torch.randn(sum(sizes) + 5, N if transposed else K, device="cuda", dtype=torch.bfloat16)
    bias = None if transposed else torch.randn(len(sizes), N, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    assert bg.supported(x, weight, transposed)
    got = bg.grouped_mm(x, weight, ends, bias, transposed_weight=transposed)
    assert rel_err(got, _float64_reference(x, weight, sizes, bias, transposed)) < BF16_TOL
    want = bg.grouped_mm(x, weight.contiguous(), ends, bias, transposed_weight=transposed)
    assert rel_err(got, want) < 1e-3


@pytest.mark.gpu
@sm90
def test_planned_launches_read_the_new_tensors():
    """Later calls of a geometry launch from the plan the first one kept (no new plan):
    on the new operands, bias and output, each result against float64."""
    sizes, K, N = [200, 0, 77], 256, 384
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    plans = None
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        x = torch.randn(sum(sizes), K, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(3, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        bias = torch.randn(3, N, device="cuda", dtype=torch.bfloat16)
        out = bg.grouped_mm(x, weight, ends, bias)
        assert rel_err(out, _float64_reference(x, weight, sizes, bias, False)) < BF16_TOL
        plans = plans if plans is not None else len(bg._PLANS)
        assert len(bg._PLANS) == plans > 0
