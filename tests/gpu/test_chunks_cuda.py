"""sort_chunks_by_index on CUDA: device chunk sizes and order without a host sync."""

from __future__ import annotations

import pytest
import torch

import grouped_linear as gl
from tests.gpu.test_grouped_linear_cuda import no_host_sync
from tests.ops.test_chunks import cat_reference, inverse_of, random_chunks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tail", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_chunks_no_sync_and_exact(seed, index_dtype, tail, dtype):
    """Forward and backward with device sizes and order: no host sync; rows, probs and both
    gradients equal to the chunks concatenated in order (and by the inverse order)."""
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 65, (), generator=gen))
    sizes, order = random_chunks(gen, count, high=300)
    rows = sum(sizes) + tail
    x = torch.randn(rows, 384, generator=gen).to("cuda", dtype).requires_grad_()
    probs = torch.rand(rows, generator=gen).cuda().requires_grad_()
    grad, grad_probs = torch.randn(rows, 384, device="cuda", dtype=dtype), torch.rand(
        rows, device="cuda")
    split_sizes = torch.tensor(sizes, device="cuda", dtype=index_dtype)
    sorted_index = torch.tensor(order, device="cuda", dtype=index_dtype)
    with no_host_sync():
        out, out_probs = gl.sort_chunks_by_index(x, split_sizes, sorted_index, probs)
        torch.autograd.backward((out, out_probs), (grad, grad_probs))
    assert torch.equal(out, cat_reference(x.detach(), sizes, order))
    assert torch.equal(out_probs, cat_reference(probs.detach(), sizes, order))
    out_sizes = [sizes[i] for i in order]
    assert torch.equal(x.grad, cat_reference(grad, out_sizes, inverse_of(order)))
    assert torch.equal(probs.grad, cat_reference(grad_probs, out_sizes, inverse_of(order)))


@pytest.mark.parametrize("kind", ["list", "cpu"])
def test_host_chunks_on_cuda(kind):
    gen = torch.Generator().manual_seed(7)
    sizes, order = random_chunks(gen, 16, high=50)
    x = torch.randn(sum(sizes) + 3, 64, generator=gen).cuda()
    args = (sizes, order) if kind == "list" else (torch.tensor(sizes), torch.tensor(order))
    assert torch.equal(gl.sort_chunks_by_index(x, *args), cat_reference(x, sizes, order))


def test_unchecked_device_values_are_clamped():
    """Without GROUPED_LINEAR_DEBUG: a negative size counts as 0, chunks are cut at the last
    row, and an order that is no permutation gives rows of x (no out-of-bounds access)."""
    x = torch.randn(6, 8, device="cuda")
    out = gl.sort_chunks_by_index(x, torch.tensor([4, -2, 5], device="cuda"),
                                  torch.tensor([2, 1, 0], device="cuda"))
    assert torch.equal(out, cat_reference(x, [4, 0, 2], [2, 1, 0]))
    out = gl.sort_chunks_by_index(x, torch.tensor([1, 2, 3], device="cuda"),
                                  torch.tensor([2, 2, 7], device="cuda"))
    torch.cuda.synchronize()
    assert all(any(torch.equal(row, y) for y in x) for row in out)


@pytest.mark.parametrize("sizes, order, match", [
    ([3, 3], [0, 0], r"sorted_index\[1\] is 0, as is sorted_index\[0\]"),
    ([3, 3], [0, 2], r"sorted_index\[1\] is 2: expected a permutation"),
    ([7, -1], [1, 0], r"split_sizes\[1\] is -1"),
    ([4, 3], [1, 0], r"split_sizes sums to 7, more than the 6 rows"),
])
def test_debug_checks_device_values(monkeypatch, sizes, order, match):
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", "1")
    x = torch.randn(6, 8, device="cuda")
    with pytest.raises(ValueError, match=match):
        gl.sort_chunks_by_index(x, torch.tensor(sizes, device="cuda"),
                                torch.tensor(order, device="cuda"))


def test_other_device_rejected():
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"split_sizes is on cuda:0 but the input is on cpu"):
        gl.sort_chunks_by_index(x, torch.tensor([3, 3], device="cuda"), [1, 0])
    with pytest.raises(ValueError, match=r"sorted_index is on cuda:0 but x is on cpu"):
        gl.sort_chunks_by_index(x, [3, 3], torch.tensor([1, 0], device="cuda"))
    with pytest.raises(ValueError, match=r"probs is on cuda:0 but x is on cpu"):
        gl.sort_chunks_by_index(x, [3, 3], [1, 0], torch.rand(6, device="cuda"))


def test_compiled_matches_eager():
    """Compiled with device chunks (from torch 2.13 traced; before it, run eagerly behind a
    graph break): eager's values and gradients."""
    torch._dynamo.reset()

    def step(x, sizes, order, probs):
        out, out_probs = gl.sort_chunks_by_index(x, sizes, order, probs)
        return (out.float().square() * out_probs[:, None]).sum()

    compiled = torch.compile(step)
    gen = torch.Generator().manual_seed(3)
    sizes, order = random_chunks(gen, 8, high=40)
    sizes_d, order_d = torch.tensor(sizes, device="cuda"), torch.tensor(order, device="cuda")
    results = []
    for fn in (compiled, step):
        x = torch.randn(sum(sizes) + 2, 128, generator=torch.Generator().manual_seed(1)).to(
            "cuda", torch.bfloat16).requires_grad_()
        probs = torch.rand(sum(sizes) + 2, generator=torch.Generator().manual_seed(2)).cuda()
        probs.requires_grad_()
        loss = fn(x, sizes_d, order_d, probs)
        loss.backward()
        results.append((loss.detach(), x.grad, probs.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
