"""The compute steps: a half-precision output with a bias is rounded once from the float32
product plus bias on every backend (the loop is ``torch.nn.functional.linear`` per group)."""

import pytest
import torch
import torch.nn.functional as F

import grouped_linear as gl
from tests.reference import rel_err

SIZES = [30, 0, 50, 20]
# The triton backend runs where Triton does: CUDA, else the CPU interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, N = 64, 48


def _linear_per_group(x, weight, bias, sizes):
    outs, start = [], 0
    for g, size in enumerate(sizes):
        outs.append(F.linear(x[start:start + size], weight[g], bias[g]))
        start += size
    return torch.cat(outs)


@pytest.mark.parametrize("backend, dtype", [
    ("loop", torch.bfloat16), ("loop", torch.float16), ("grouped", torch.bfloat16),
    ("triton", torch.bfloat16), ("triton", torch.float16)])
def test_half_precision_output_with_bias_matches_f_linear(backend, dtype):
    torch.manual_seed(0)
    G = len(SIZES)
    x = (torch.randn(sum(SIZES), K) * 3).to(dtype)
    weight = torch.randn(G, N, K).to(dtype)
    bias = (torch.randn(G, N) * 10).to(dtype)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    got = gl.grouped_linear(x.to(device), weight.to(device), bias.to(device), SIZES,
                            backend=backend).cpu()
    want = _linear_per_group(x, weight, bias, SIZES)
    assert got.dtype == dtype
    if device == "cuda":  # another summation order than the CPU's: within half precision
        assert rel_err(got, want) < 1e-2
        return
    if backend == "loop":  # F.linear per group, whatever torch's CPU half GEMM rounds
        assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
        return
    # the other backends round the float32 product plus bias once (so does F.linear where
    # torch's CPU half GEMM accumulates in float32; not on every CPU in fp16)
    once = _linear_per_group(x.float(), weight.float(), bias.float(), SIZES).to(dtype)
    assert torch.equal(got, once), float((got.float() - once.float()).abs().max())
