"""The GEMM kernels of each backend and the bias kernels, against float64 loops."""

import pytest
import torch

from grouped_linear.kernels import bias as bias_kernels
from grouped_linear.kernels.gemm import torch_gemm as grouped_gemm
from tests.reference import rel_err

SIZES = [5, 0, 12, 1, 7]


def _offsets(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("backend", grouped_gemm.BACKENDS)
def test_three_gemms(backend):
    G, K, N, M = len(SIZES), 16, 24, sum(SIZES)
    x, w, dy = torch.randn(M, K), torch.randn(G, N, K), torch.randn(M, N)
    offs = _offsets(SIZES)
    bounds = torch.tensor([0] + SIZES).cumsum(0).tolist()
    out = grouped_gemm.forward(x, w, offs, None, backend)
    dx = grouped_gemm.dgrad(dy, w, offs, None, backend)
    dw = grouped_gemm.wgrad(dy, x, offs, None, backend)
    for g in range(G):
        s, e = bounds[g], bounds[g + 1]
        assert rel_err(out[s:e], x[s:e].double() @ w[g].double().t()) < 1e-5
        assert rel_err(dx[s:e], dy[s:e].double() @ w[g].double()) < 1e-5
        assert rel_err(dw[g], dy[s:e].double().t() @ x[s:e].double()) < 1e-5
    assert torch.all(dw[1] == 0)


def test_loop_zero_fills_tail_rows():
    x, w = torch.randn(10, 4), torch.randn(2, 3, 4)
    offs = torch.tensor([3, 7], dtype=torch.int32)
    assert torch.all(grouped_gemm.forward(x, w, offs, None, "loop")[7:] == 0)
    assert torch.all(grouped_gemm.dgrad(torch.randn(10, 3), w, offs, None, "loop")[7:] == 0)


def test_bias_epilogue_and_grad():
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # 8 rows: the last two in no group
    out = torch.randn(8, 5)
    bias = torch.randn(3, 5)
    expected = out.clone()
    expected[:2] += bias[0]
    expected[2:6] += bias[2]
    expected[6:] = 0
    assert torch.allclose(bias_kernels.bias_epilogue_(out.clone(), bias, offs, True), expected)
    with_tail = bias_kernels.bias_epilogue_(out.clone(), None, offs, True)
    assert torch.all(with_tail[6:] == 0) and torch.equal(with_tail[:6], out[:6])
    grad = torch.randn(8, 5, dtype=torch.bfloat16)
    db = bias_kernels.bias_grad(grad, offs, torch.bfloat16)
    ref = torch.stack([grad[:2].double().sum(0), torch.zeros(5, dtype=torch.float64),
                       grad[2:6].double().sum(0)])
    assert db.dtype == torch.bfloat16 and rel_err(db, ref) < 1e-2
