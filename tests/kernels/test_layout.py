"""The one-pass relayout kernel against its reference (CUDA, or the Triton interpreter)."""

import pytest
import torch

from grouped_linear.kernels import layout
from grouped_linear.kernels._triton import HAS_TRITON, use_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _ends(sizes):
    return torch.tensor(sizes, device=DEVICE).cumsum(0)


@pytest.mark.parametrize("src_sizes, dst_sizes, dst_rows", [
    ([3, 0, 17, 1], [16, 0, 32, 16], 64),     # pad to 16
    ([16, 0, 32, 16], [3, 0, 17, 1], 21),     # unpad
    ([5, 5], [8, 8], 30),                     # destination tail past the last group
    ([0, 0, 0], [0, 0, 0], 4),                # nothing to copy: zeros
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relayout_matches_reference(src_sizes, dst_sizes, dst_rows, dtype):
    src = torch.randn(max(sum(src_sizes), 1), 300, device=DEVICE).to(dtype)
    assert use_triton(src)
    got = layout.relayout(src, _ends(src_sizes), _ends(dst_sizes), dst_rows)
    want = layout.relayout_reference(src, _ends(src_sizes), _ends(dst_sizes), dst_rows)
    assert got.shape == (dst_rows, 300) and torch.equal(got, want)
    # spot-check the pairing itself: group 0's first row lands on destination row 0
    if src_sizes[0] and dst_sizes[0]:
        assert torch.equal(got[0], src[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_kernel(dtype):
    src = torch.randn(10, 300, device=DEVICE).to(dtype)
    index = torch.tensor([3, -1, 9, 10, 0, 3, -7], device=DEVICE)  # -1, 10, -7: zero rows
    assert use_triton(src)
    got = layout.gather_rows(src, index)
    assert torch.equal(got, layout.gather_rows_reference(src, index))
    assert torch.equal(got[0], src[3]) and torch.all(got[[1, 3, 6]] == 0)


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_kernel(with_weights, dtype):
    src = torch.randn(12, 300, device=DEVICE).to(dtype)
    row_map = torch.tensor([[0, 5, -1], [11, 2, 3], [-1, -1, -1], [7, 12, 1]], device=DEVICE)
    weights = torch.rand(4, 3, device=DEVICE) if with_weights else None
    got = layout.combine_rows(src, row_map, weights)
    want = layout.combine_rows_reference(src, row_map, weights)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(got, want, **tol)
    assert torch.all(got[2] == 0)  # every slot dropped
    exact = src[0].double() * (weights[0, 0].double() if with_weights else 1) + src[5].double() * (
        weights[0, 1].double() if with_weights else 1)
    torch.testing.assert_close(got[0].double(), exact, **tol)
