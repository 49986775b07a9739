"""Triton kernels against their PyTorch references (CUDA, or CPU under TRITON_INTERPRET=1)."""

import pytest
import torch

from grouped_linear.kernels import bias as bias_kernels
from grouped_linear.kernels import ends as ends_kernels
from grouped_linear.kernels._triton import HAS_TRITON, use_triton
from tests.reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

CASES = [  # (sizes, tail rows, N)
    ([5, 0, 37, 1, 70], 0, 136),
    ([0, 0, 3], 9, 50),
    ([64] * 3 + [0] * 70 + [17], 5, 8),  # more groups than one BLOCK_G chunk
    ([0, 0], 4, 16),
]


def _offsets(sizes):
    return torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)


def test_kernels_take_the_triton_path():
    assert use_triton(torch.empty(1, device=DEVICE))


@pytest.mark.parametrize("sizes, tail, N", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_bias_epilogue(sizes, tail, N, dtype, zero_tail):
    M, G = sum(sizes) + tail, len(sizes)
    out = torch.randn(M, N, device=DEVICE, dtype=dtype)
    out[sum(sizes):] = float("nan")  # what a GEMM may leave in the tail
    bias = torch.randn(G, N, device=DEVICE, dtype=dtype)
    offs = _offsets(sizes)
    got = bias_kernels.bias_epilogue_(out.clone(), bias, offs, zero_tail)
    want = bias_kernels.bias_epilogue_reference_(out.clone(), bias, offs, zero_tail)
    head = sum(sizes)
    assert rel_err(got[:head], want[:head]) < (1e-6 if dtype == torch.float32 else 1e-2)
    if zero_tail:
        assert torch.all(got[head:] == 0)
    got_tail = bias_kernels.bias_epilogue_(out.clone(), None, offs, True)
    assert torch.all(got_tail[head:] == 0) and torch.equal(got_tail[:head], out[:head])


@pytest.mark.parametrize("sizes, tail, N", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_grad(sizes, tail, N, dtype):
    M = sum(sizes) + tail
    grad = torch.randn(M, N, device=DEVICE, dtype=dtype)
    offs = _offsets(sizes)
    got = bias_kernels.bias_grad(grad, offs, dtype)
    ref = torch.stack([grad[s - n:s].double().sum(0) for n, s in
                       zip(sizes, torch.tensor(sizes).cumsum(0).tolist())])
    assert got.dtype == dtype and got.shape == (len(sizes), N)
    assert rel_err(got, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got, bias_kernels.bias_grad(grad, offs, dtype))  # deterministic


@pytest.mark.parametrize("sizes, tail, N", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bias_grad_off_triton_on_the_cpu(monkeypatch, sizes, tail, N, dtype):
    """Without Triton on the CPU the bias gradient adds each row into its group's sum in row
    order: float64 sums of the groups within float32 rounding, the tail (NaN here) left out,
    empty groups zero, and the reference's segment sums bit for bit."""
    M = sum(sizes) + tail
    grad = torch.randn(M, N, dtype=dtype)
    grad[sum(sizes):] = float("nan")
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    monkeypatch.setattr(bias_kernels, "use_triton", lambda t: False)
    got = bias_kernels.bias_grad(grad, offs, torch.float32)
    starts = [e - n for n, e in zip(sizes, offs.tolist())]
    want = torch.stack([grad[s:s + n].double().sum(0) for s, n in zip(starts, sizes)])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-6
    assert all(torch.all(got[g] == 0) for g, n in enumerate(sizes) if n == 0)
    assert torch.equal(got, bias_kernels.bias_grad_reference(grad, offs, torch.float32))


def test_bias_grad_large_group_int64_safe_indexing():
    grad = torch.randn(300, 7, device=DEVICE)
    offs = torch.tensor([0, 300], device=DEVICE, dtype=torch.int32)
    got = bias_kernels.bias_grad(grad, offs, torch.float32)
    assert torch.all(got[0] == 0) and rel_err(got[1], grad.double().sum(0)) < 1e-6


@pytest.mark.parametrize("splits, M", [
    ([3, 0, 5, 2], 10), ([3, 0, 5, 2], 7), ([-4, 6, 2], 5), ([2**40, 1], 100), ([0], 0),
    (list(range(300)), 10**6),
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_group_ends(splits, M, dtype):
    t = torch.tensor(splits, device=DEVICE, dtype=torch.int64).clamp(max=torch.iinfo(dtype).max)
    t = t.to(dtype)
    got = ends_kernels.group_ends(t, M)
    want, run = [], 0
    for s in t.tolist():
        run += max(s, 0)
        want.append(min(run, M))
    assert got.dtype == torch.int32 and got.tolist() == want


def test_group_ends_of_strided_splits():
    table = torch.tensor([[3, 50], [0, 50], [5, 50]], device=DEVICE)
    assert ends_kernels.group_ends(table[:, 0], 7).tolist() == [3, 3, 7]


@pytest.mark.parametrize("sizes, tail", [([1100, 0, 513, 3], 7), ([0, 2048], 0), ([511, 512, 1], 600)])
def test_bias_grad_multi_chunk_groups(sizes, tail):
    """Groups longer than one row chunk: partial sums per chunk, then the fixed-order pass."""
    grad = torch.randn(sum(sizes) + tail, 9, device=DEVICE)
    got = bias_kernels.bias_grad(grad, _offsets(sizes), torch.float32)
    bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
    ref = torch.stack([grad[s:e].double().sum(0) for s, e in zip(bounds[:-1], bounds[1:])])
    assert rel_err(got, ref) < 1e-6
