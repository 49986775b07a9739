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
