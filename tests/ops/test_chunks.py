"""sort_chunks_by_index against a concatenation of the split chunks, on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grouped_linear as gl
from grouped_linear.ops.chunks import TRACEABLE, sort_chunks_by_index_reference


def cat_reference(t: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """The chunks of ``t`` (then the rows past them) concatenated in ``order``, by slicing."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = [t[starts[i]:starts[i] + sizes[i]] for i in order]
    return torch.cat([*pieces, t[sum(sizes):]])


def inverse_of(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for i, chunk in enumerate(order):
        inverse[chunk] = i
    return inverse


def random_chunks(gen: torch.Generator, count: int, high: int = 6) -> tuple[list[int], list[int]]:
    sizes = torch.randint(0, high, (count,), generator=gen)
    sizes[torch.rand(count, generator=gen) < 0.3] = 0  # empty chunks
    return sizes.tolist(), torch.randperm(count, generator=gen).tolist()


def as_kind(values: list[int], kind: str) -> list[int] | tuple[int, ...] | torch.Tensor:
    return {"list": values, "tuple": tuple(values), "int64": torch.tensor(values),
            "int32": torch.tensor(values, dtype=torch.int32)}[kind]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["list", "tuple", "int64", "int32"])
@pytest.mark.parametrize("tail", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_concatenated_chunks(seed, kind, tail, dtype):
    """Output, probs and both gradients: the chunks in sorted_index's order, rows past the
    chunks in place; gradients are the incoming ones put back by the inverse order."""
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 9, (), generator=gen))
    sizes, order = random_chunks(gen, count)
    rows = sum(sizes) + tail
    x = torch.randn(rows, 5, generator=gen).to(dtype).requires_grad_()
    probs = torch.rand(rows, generator=gen, dtype=torch.float32, requires_grad=True)
    out, out_probs = gl.sort_chunks_by_index(x, as_kind(sizes, kind), as_kind(order, kind), probs)
    assert out.dtype == dtype and out_probs.dtype == torch.float32
    assert torch.equal(out, cat_reference(x.detach(), sizes, order))
    assert torch.equal(out_probs, cat_reference(probs.detach(), sizes, order))
    grad, grad_probs = torch.randn(rows, 5, generator=gen).to(dtype), torch.rand(rows,
                                                                                 generator=gen)
    torch.autograd.backward((out, out_probs), (grad, grad_probs))
    out_sizes = [sizes[i] for i in order]
    assert torch.equal(x.grad, cat_reference(grad, out_sizes, inverse_of(order)))
    assert torch.equal(probs.grad, cat_reference(grad_probs, out_sizes, inverse_of(order)))


def test_without_probs_returns_a_tensor():
    x = torch.randn(7, 3, requires_grad=True)
    out = gl.sort_chunks_by_index(x, [3, 4], [1, 0])
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, torch.cat([x[3:], x[:3]]))
    out.sum().backward()  # an expanded (stride 0) gradient
    assert torch.equal(x.grad, torch.ones(7, 3))


@pytest.mark.parametrize("seed", range(4))
def test_reference_function(seed):
    """The plain-PyTorch reference of the module agrees with the slicing one."""
    gen = torch.Generator().manual_seed(seed)
    sizes, order = random_chunks(gen, 5)
    x, probs = torch.randn(sum(sizes) + 2, 4, generator=gen), torch.rand(sum(sizes) + 2)
    out, out_probs = sort_chunks_by_index_reference(x, sizes, torch.tensor(order), probs)
    assert torch.equal(out, cat_reference(x, sizes, order))
    assert torch.equal(out_probs, cat_reference(probs, sizes, order))


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(11, generator=gen, dtype=torch.float64, requires_grad=True)
    sizes, order = torch.tensor([2, 0, 4, 3]), torch.tensor([3, 1, 0, 2])
    assert torch.autograd.gradcheck(
        lambda a, p: gl.sort_chunks_by_index(a, sizes, order, p), (x, probs))


@pytest.mark.parametrize("sizes, order", [([], []), ([0, 0], [1, 0]), ([5], [0])])
def test_degenerate_chunks_copy_x(sizes, order):
    """No chunks, empty chunks or one chunk: the output is x (a new tensor)."""
    x = torch.randn(5, 2)
    out = gl.sort_chunks_by_index(x, sizes, order)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_empty_rows_and_features():
    for shape in [(0, 4), (6, 0)]:
        x = torch.randn(*shape, requires_grad=True)
        sizes = [shape[0] // 2, shape[0] - shape[0] // 2]
        out = gl.sort_chunks_by_index(x, sizes, [1, 0])
        assert out.shape == shape
        out.sum().backward()
        assert x.grad.shape == shape


def test_numpy_and_tensor_entries():
    x = torch.randn(6, 2)
    expected = cat_reference(x, [2, 4], [1, 0])
    assert torch.equal(gl.sort_chunks_by_index(x, [np.int64(2), 4], [torch.tensor(1), 0]),
                       expected)
    assert torch.equal(gl.sort_chunks_by_index(x, torch.tensor([2, 4], dtype=torch.uint8),
                                               torch.tensor([1, 0], dtype=torch.int8)), expected)


def test_non_contiguous_x():
    base = torch.randn(9, 8)
    x = base[:, ::2]
    assert torch.equal(gl.sort_chunks_by_index(x, [4, 5], [1, 0]), cat_reference(x, [4, 5], [1, 0]))


# ----------------------------------------------------------------------------- bad input

X = torch.zeros(6, 2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=torch.zeros(6)), ValueError, r"x has shape \(6,\): expected a 2-D"),
    (dict(x=[[0.0]]), TypeError, r"x is list"),
    (dict(x=torch.zeros(6, 2, dtype=torch.int32)), TypeError, r"x has dtype torch.int32"),
    (dict(x=torch.zeros(6, 2, device="meta")), ValueError, r"x is on meta"),
    (dict(split_sizes=3), TypeError, r"split_sizes is int"),
    (dict(split_sizes=torch.tensor([3.0, 3.0])), TypeError, r"split_sizes has dtype torch.float32"),
    (dict(split_sizes=torch.tensor([True, False])), TypeError, r"split_sizes is a bool tensor"),
    (dict(split_sizes=torch.tensor([[3, 3]])), ValueError, r"split_sizes has shape \(1, 2\)"),
    (dict(split_sizes=[3, True]), TypeError, r"split_sizes\[1\] is True"),
    (dict(split_sizes=[3, 1.5]), TypeError, r"split_sizes\[1\] is 1.5"),
    (dict(split_sizes=[4, -1]), ValueError, r"split_sizes\[1\] is -1: .*non-negative"),
    (dict(split_sizes=torch.tensor([4, -1])), ValueError, r"split_sizes\[1\] is -1"),
    (dict(split_sizes=[4, 3]), ValueError, r"split_sizes sums to 7, more than the 6 rows of x"),
    (dict(split_sizes=torch.tensor([4, 3])), ValueError, r"split_sizes sums to 7"),
    (dict(split_sizes=[3, 1, 2]), ValueError,
     r"sorted_index has 2 entries but split_sizes has 3"),
    (dict(sorted_index="10"), TypeError, r"sorted_index is str"),
    (dict(sorted_index=torch.tensor([1.0, 0.0])), TypeError, r"sorted_index has dtype"),
    (dict(sorted_index=torch.tensor([[1, 0]])), ValueError, r"sorted_index has shape \(1, 2\)"),
    (dict(sorted_index=[1, False]), TypeError, r"sorted_index\[1\] is False"),
    (dict(sorted_index=[1, "0"]), TypeError, r"sorted_index\[1\] is '0'"),
    (dict(sorted_index=[1, 2]), ValueError, r"sorted_index\[1\] is 2: expected a permutation"),
    (dict(sorted_index=[-1, 0]), ValueError, r"sorted_index\[0\] is -1"),
    (dict(sorted_index=[1, 1]), ValueError, r"sorted_index\[1\] is 1, as is sorted_index\[0\]"),
    (dict(sorted_index=torch.tensor([0, 0])), ValueError, r"sorted_index\[1\] is 0, as is"),
    (dict(sorted_index=torch.tensor([0, 255], dtype=torch.uint8)), ValueError,
     r"sorted_index\[1\] is 255"),
    (dict(probs=[0.5] * 6), TypeError, r"probs must be a torch.Tensor or None, got \[0.5, .*\(list\)"),
    (dict(probs=torch.zeros(6, dtype=torch.int64)), TypeError, r"probs has dtype torch.int64"),
    (dict(probs=torch.zeros(5)), ValueError, r"probs has shape \(5,\): expected \(6,\)"),
    (dict(probs=torch.zeros(6, 1)), ValueError, r"probs has shape \(6, 1\)"),
    (dict(probs=torch.zeros(6, device="meta")), ValueError, r"probs is on meta"),
])
def test_bad_input(kwargs, error, match):
    args = dict(x=X, split_sizes=[2, 4], sorted_index=[1, 0], probs=None) | kwargs
    with pytest.raises(error, match=match):
        gl.sort_chunks_by_index(**args)


def test_rejected_call_leaves_grads_alone():
    x = torch.randn(6, 2, requires_grad=True)
    x.grad = torch.ones(6, 2)
    with pytest.raises(ValueError):
        gl.sort_chunks_by_index(x, [3, 3], [0, 0])
    assert torch.equal(x.grad, torch.ones(6, 2))


def test_compiled_matches_eager():
    """Traced whole (fullgraph from torch 2.13) with tensor arguments: eager's values and
    gradients."""
    torch._dynamo.reset()

    def step(x, sizes, order, probs):
        out, out_probs = gl.sort_chunks_by_index(x * 2, sizes, order, probs)
        return (out.square() * out_probs[:, None]).sum()

    compiled = torch.compile(step, fullgraph=TRACEABLE, backend="aot_eager")
    sizes, order = torch.tensor([3, 0, 2, 4]), torch.tensor([2, 3, 0, 1])
    results = []
    for fn in (compiled, step):
        x = torch.randn(10, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                        requires_grad=True)
        probs = torch.rand(10, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            probs.copy_(torch.rand(10, generator=torch.Generator().manual_seed(2)))
        loss = fn(x, sizes, order, probs)
        loss.backward()
        results.append((loss.detach(), x.grad, probs.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not TRACEABLE, reason="traced from torch 2.13 only")
def test_traced_values_are_clamped_not_read():
    """While torch.compile traces, CPU tensors are not read (as device tensors on CUDA): a
    negative size counts as 0, the chunks are cut at the last row, and an index that is no
    permutation stays in bounds."""
    torch._dynamo.reset()
    compiled = torch.compile(gl.sort_chunks_by_index, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 2, dtype=torch.float64)  # the interpreter's kernels are not traced
    out = compiled(x, torch.tensor([4, -2, 5]), torch.tensor([2, 1, 0]))
    assert torch.equal(out, cat_reference(x, [4, 0, 2], [2, 1, 0]))
    out = compiled(x, torch.tensor([1, 2, 3]), torch.tensor([2, 2, 7]))
    assert out.shape == x.shape and all(any(torch.equal(row, y) for y in x) for row in out)
