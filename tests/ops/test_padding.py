"""pad_groups / unpad_groups against float64 loop references, on CPU and (marked) CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouped_linear.ops.padding import pad_groups, unpad_groups

SPLIT_CASES = {
    "random_with_zeros": [5, 0, 17, 3, 0, 9],
    "single_nonempty": [0, 0, 23, 0],
    "aligned": [16, 32, 128],
    "all_empty": [0, 0, 0],
    "one_group": [7],
    "ones": [1, 1, 1, 1, 1],
}


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ref_pad(x: torch.Tensor, sizes: list[int], multiple: int) -> tuple[torch.Tensor, list[int]]:
    """Row-by-row float64 padding: each group followed by zero rows."""
    padded = [round_up(s, multiple) for s in sizes]
    out = torch.zeros(sum(padded), x.shape[1], dtype=torch.float64)
    src, dst = 0, 0
    for size, pad in zip(sizes, padded, strict=True):
        for i in range(size):
            out[dst + i] = x[src + i].double()
        src += size
        dst += pad
    return out, padded


def ref_unpad(yp: torch.Tensor, sizes: list[int], padded: list[int]) -> torch.Tensor:
    rows = []
    dst = 0
    for size, pad in zip(sizes, padded, strict=True):
        for i in range(size):
            rows.append(yp[dst + i].double())
        dst += pad
    return torch.stack(rows) if rows else torch.zeros(0, yp.shape[1], dtype=torch.float64)


def check_pad(sizes: list[int], multiple: int, hidden: int = 3, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    xp, padded = pad_groups(x, list(sizes), multiple=multiple)
    ref, ref_padded = ref_pad(x.detach(), sizes, multiple)
    assert padded == ref_padded and all(type(p) is int for p in padded)
    assert torch.equal(xp, ref)
    grad = torch.randn(xp.shape, generator=gen, dtype=torch.float64)
    xp.backward(grad)
    # d(sum(grad * pad(x)))/dx is grad without its padding rows.
    assert torch.equal(x.grad, ref_unpad(grad, sizes, ref_padded))

    yp = xp.detach().requires_grad_()
    y = unpad_groups(yp, sizes, padded)
    assert torch.equal(y, x.detach())
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(gy)
    assert torch.equal(yp.grad, ref_pad(gy, sizes, multiple)[0])


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize("multiple", [1, 16, 128])
def test_pad_unpad_matches_reference(case, multiple):
    check_pad(SPLIT_CASES[case], multiple)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    multiple=st.sampled_from([1, 2, 3, 8, 16]),
    hidden=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_pad_unpad_property(sizes, multiple, hidden, seed):
    check_pad(sizes, multiple, hidden, seed)


def test_splits_kinds():
    x = torch.randn(9, 2)
    xp_list, p_list = pad_groups(x, [4, 0, 5], multiple=8)
    assert p_list == [8, 0, 8]
    xp_tuple, p_tuple = pad_groups(x, (4, 0, 5), multiple=8)
    assert p_tuple == [8, 0, 8]
    for dtype in (torch.int32, torch.int64):
        xp_t, p_t = pad_groups(x, torch.tensor([4, 0, 5], dtype=dtype), multiple=8)
        assert isinstance(p_t, torch.Tensor) and p_t.dtype == torch.int64
        assert p_t.device.type == "cpu" and p_t.tolist() == [8, 0, 8]
        assert torch.equal(xp_t, xp_list)
    assert torch.equal(xp_tuple, xp_list)
    # unpad accepts every kind, in any combination
    for m, p in [([4, 0, 5], [8, 0, 8]), (torch.tensor([4, 0, 5]), p_t), ([4, 0, 5], p_t)]:
        assert torch.equal(unpad_groups(xp_list, m, p), x)
        assert torch.equal(unpad_groups(xp_list, m, p, num_rows=9), x)


def test_list_input():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 3, generator=gen, dtype=torch.float64) for n in (3, 0, 5)]
    parts = [p.requires_grad_() for p in parts]
    sizes = [3, 0, 5]
    ref, _ = ref_pad(torch.cat(parts).detach(), sizes, 4)
    for m_splits in (None, sizes, torch.tensor(sizes)):
        xp, padded = pad_groups(parts, m_splits, multiple=4)
        assert torch.equal(xp, ref)
        expected = [4, 0, 8]
        assert (padded.tolist() if isinstance(padded, torch.Tensor) else padded) == expected
    xp, padded = pad_groups(tuple(parts), multiple=4)
    grad = torch.randn(xp.shape, generator=gen, dtype=torch.float64)
    xp.backward(grad)
    assert torch.equal(parts[0].grad, grad[:3])
    assert parts[1].grad is None or parts[1].grad.shape == (0, 3)
    assert torch.equal(parts[2].grad, grad[4:9])


def test_dtypes_and_noncontiguous():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool,
                  torch.complex64):  # Triton has no complex type: those take PyTorch's path
        x = (torch.arange(7 * 4).reshape(4, 7).t() + 1).to(dtype)  # (7, 4), non-contiguous
        xp, padded = pad_groups(x, [2, 5], multiple=4)
        assert xp.dtype == dtype
        assert torch.equal(xp, ref_pad(x, [2, 5], 4)[0].to(dtype))
        assert torch.equal(unpad_groups(xp, [2, 5], padded), x)


def test_backward_of_expanded_grad():
    x = torch.randn(5, 3, requires_grad=True)
    xp, padded = pad_groups(x, [2, 3], multiple=4)
    xp.sum().backward()  # zero-stride gradient
    assert torch.equal(x.grad, torch.ones(5, 3))
    yp = torch.randn(8, 3, requires_grad=True)
    unpad_groups(yp, [2, 3], padded).sum().backward()
    assert torch.equal(yp.grad, ref_pad(torch.ones(5, 3), [2, 3], 4)[0].float())


@pytest.mark.parametrize("multiple", [1, 4])
def test_gradcheck(multiple):
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    sizes = [1, 0, 5]
    assert torch.autograd.gradcheck(lambda t: pad_groups(t, sizes, multiple)[0], (x,))
    padded = [round_up(s, multiple) for s in sizes]
    yp = torch.randn(sum(padded), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: unpad_groups(t, sizes, padded), (yp,))
    assert torch.autograd.gradgradcheck(lambda t: pad_groups(t, sizes, multiple)[0], (x,))


def test_deterministic():
    x = torch.randn(40, 8, requires_grad=True)
    outs = []
    for _ in range(2):
        x.grad = None
        xp, _ = pad_groups(x, [10, 0, 30], multiple=16)
        (xp * torch.arange(xp.numel()).view_as(xp)).sum().backward()
        outs.append((xp.detach().clone(), x.grad.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "multiple, exc, match",
    [
        (0, ValueError, "multiple is 0"),
        (-16, ValueError, "multiple is -16"),
        (2.0, TypeError, "multiple is 2.0"),
        (True, TypeError, "multiple is True"),
        ("16", TypeError, "multiple is '16'"),
    ],
)
def test_bad_multiple(multiple, exc, match):
    with pytest.raises(exc, match=match):
        pad_groups(torch.zeros(4, 2), [4], multiple=multiple)


@pytest.mark.parametrize(
    "x, m_splits, exc, match",
    [
        (torch.zeros(4), [4], ValueError, r"x has shape \(4,\)"),
        ("x", [4], TypeError, "x is str"),
        (torch.zeros(4, 2), None, ValueError, "m_splits is None"),
        (torch.zeros(4, 2), [], ValueError, "m_splits is empty"),
        (torch.zeros(4, 2), [5, -1], ValueError, r"m_splits\[1\] is -1"),
        (torch.zeros(4, 2), [1, 2], ValueError, "m_splits sums to 3 but the input has 4"),
        (torch.zeros(4, 2), torch.tensor([1, 2]), ValueError, "m_splits sums to 3"),
        (torch.zeros(4, 2), [1.5, 2.5], TypeError, r"m_splits\[0\] is 1.5"),
        (torch.zeros(4, 2), [True, 3], TypeError, r"m_splits\[0\] is True"),
        (torch.zeros(4, 2), torch.tensor([1.0, 3.0]), TypeError, "m_splits has dtype"),
        (torch.zeros(4, 2), torch.tensor([[4]]), ValueError, "m_splits has shape"),
        (torch.zeros(4, 2), "4", TypeError, "m_splits is str"),
        ([], None, ValueError, "x is an empty list"),
        ([torch.zeros(2, 2), torch.zeros(3)], None, ValueError, r"x\[1\] has shape"),
        ([torch.zeros(2, 2), torch.zeros(3, 4)], None, ValueError, r"x\[1\] has 4 columns"),
        (
            [torch.zeros(2, 2), torch.zeros(3, 2, dtype=torch.float64)],
            None,
            ValueError,
            r"x\[1\] is torch.float64",
        ),
        ([torch.zeros(2, 2), torch.zeros(3, 2)], [5], ValueError, "m_splits has length 1"),
        ([torch.zeros(2, 2), torch.zeros(3, 2)], [3, 2], ValueError, r"m_splits\[0\] is 3"),
        (
            [torch.zeros(2, 2), torch.zeros(3, 2)],
            torch.tensor([1, 4]),
            ValueError,
            r"m_splits\[0\] is 1",
        ),
    ],
)
def test_pad_errors(x, m_splits, exc, match):
    with pytest.raises(exc, match=match):
        pad_groups(x, m_splits, multiple=4)


@pytest.mark.parametrize(
    "yp, m_splits, padded, num_rows, exc, match",
    [
        (torch.zeros(8), [3], [8], None, ValueError, r"yp has shape \(8,\)"),
        (torch.zeros(8, 2), [3, 1], [8], None, ValueError, "padded_splits has length 1"),
        (torch.zeros(8, 2), [], [], None, ValueError, "m_splits is empty"),
        (torch.zeros(8, 2), [5, 1], [4, 4], None, ValueError, r"padded_splits\[0\] is 4, smaller"),
        (torch.zeros(8, 2), [3, 1], [4, 8], None, ValueError, "padded_splits sums to 12"),
        (torch.zeros(8, 2), [3, -1], [4, 4], None, ValueError, r"m_splits\[1\] is -1"),
        (torch.zeros(8, 2), [3, 1], [4, -4], None, ValueError, r"padded_splits\[1\] is -4"),
        (torch.zeros(8, 2), [3, 1], [4, 4], 5, ValueError, "num_rows is 5 but m_splits sums to 4"),
        (torch.zeros(8, 2), [3, 1], [4, 4], -1, ValueError, "num_rows is -1"),
        (torch.zeros(8, 2), [3, 1], [4, 4], 4.0, TypeError, "num_rows is 4.0"),
        (torch.zeros(8, 2), [3.0, 1], [4, 4], 4, TypeError, r"m_splits\[0\] is 3.0"),
        (torch.zeros(8, 2), [3, 1], [4.0, 4], None, TypeError, r"padded_splits\[0\] is 4.0"),
        (torch.zeros(8, 2), torch.tensor([3.0]), [8], 3, TypeError, "m_splits has dtype"),
    ],
)
def test_unpad_errors(yp, m_splits, padded, num_rows, exc, match):
    with pytest.raises(exc, match=match):
        unpad_groups(yp, m_splits, padded, num_rows=num_rows)


MAX_ROWS = 2**63 - 1


@pytest.mark.parametrize("as_tensor", [False, True])
def test_multiple_is_bounded_by_the_rows_a_tensor_holds(as_tensor):
    """Padding 4 rows in 2 groups may take up to 4 + 2*(multiple-1) rows: the largest
    multiple keeping that an int64 works (zero columns, so nothing is allocated), one more
    is a ValueError naming multiple (not an overflow in the padded sizes)."""
    largest = (MAX_ROWS - 4) // 2 + 1
    splits = torch.tensor([1, 3]) if as_tensor else [1, 3]
    for multiple in (2**100, 2**63, 2**62, largest + 1):
        with pytest.raises(ValueError, match=f"multiple is {multiple}: padding 2 groups of 4 rows"):
            pad_groups(torch.empty(4, 0), splits, multiple=multiple)
    xp, padded = pad_groups(torch.empty(4, 0), splits, multiple=largest)
    assert list(padded) == [largest, largest] and xp.shape == (2 * largest, 0)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_groups_past_int32_rows(as_tensor):
    """2**31 rows and more (zero columns: no memory): the host sizes are int64, not int32."""
    sizes = [2**31, 3, 0, 5]
    total = sum(sizes)
    splits = torch.tensor(sizes) if as_tensor else sizes
    xp, padded = pad_groups(torch.empty(total, 0), splits, multiple=4)
    want = [round_up(size, 4) for size in sizes]
    assert list(padded) == want and xp.shape == (sum(want), 0)
    y = unpad_groups(xp, splits, padded)
    assert y.shape == (total, 0)


def test_unpad_checks_the_split_devices_before_reading_values():
    """A split tensor on another device (meta: no values at all) is named before any read."""
    meta = torch.tensor([1, 3], device="meta")
    with pytest.raises(ValueError, match="m_splits is on meta but the input is on cpu"):
        unpad_groups(torch.zeros(4, 2), meta, [2, 2])
    with pytest.raises(ValueError, match="padded_splits is on meta but the input is on cpu"):
        unpad_groups(torch.zeros(4, 2), [1, 3], meta)
    with pytest.raises(TypeError, match="padded_splits has dtype torch.float32"):
        unpad_groups(torch.zeros(4, 2), [-1, 3], torch.tensor([2.0, 2.0]))


def test_unpad_sizes_past_a_tensor():
    with pytest.raises(ValueError, match=f"m_splits sums to {2**64}, more rows than a tensor"):
        unpad_groups(torch.zeros(4, 2), [2**63, 2**63], [2, 2])
    with pytest.raises(ValueError, match=f"num_rows is {2**63}: must be <= {MAX_ROWS}"):
        unpad_groups(torch.zeros(4, 2), [2, 2], [2, 2], num_rows=2**63)


# --------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _NoSync:
    """Raise on any host synchronization inside the block."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize("multiple", [1, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_dtype", [torch.int32, torch.int64])
def test_cuda_sync_free(case, multiple, dtype, split_dtype):
    sizes = SPLIT_CASES[case]
    num_rows, groups = sum(sizes), len(sizes)
    x_cpu = torch.randn(num_rows, 5).to(dtype)
    xp_cpu, padded_cpu = pad_groups(x_cpu.requires_grad_(), sizes, multiple)
    rows = sum(padded_cpu)
    bound = num_rows + groups * (multiple - 1)
    grad_cpu = torch.randn(bound, 5).to(dtype)
    xp_cpu.backward(grad_cpu[:rows])
    gy_cpu = torch.randn(num_rows, 5).to(dtype)

    x = x_cpu.detach().cuda().requires_grad_()
    splits = torch.tensor(sizes, dtype=split_dtype, device="cuda")
    grad, gy = grad_cpu.cuda(), gy_cpu.cuda()
    with _NoSync():
        xp, padded = pad_groups(x, splits, multiple)
        xp.backward(grad)
        yp = xp.detach().requires_grad_()
        y = unpad_groups(yp, splits, padded, num_rows=num_rows)
        y.backward(gy)
    torch.cuda.synchronize()
    assert xp.shape == (bound, 5)
    assert padded.device.type == "cuda" and padded.dtype == torch.int64
    assert padded.tolist() == padded_cpu
    assert torch.equal(xp[:rows].cpu(), xp_cpu.detach())
    assert not xp[rows:].any()
    assert torch.equal(x.grad.cpu(), x_cpu.grad)
    assert torch.equal(y.cpu(), x_cpu.detach())
    assert torch.equal(yp.grad[:rows].cpu(), pad_groups(gy_cpu, sizes, multiple)[0])
    assert not yp.grad[rows:].any()


@pytest.mark.gpu
@cuda
def test_cuda_splits_short_and_bad():
    x_cpu = torch.randn(12, 3)
    # splits summing to less than M: rows past the sum are dropped, get zero gradient
    x = x_cpu.cuda().requires_grad_()
    splits = torch.tensor([3, 0, 4], device="cuda")
    with _NoSync():
        xp, padded = pad_groups(x, splits, 4)
        xp.sum().backward()
        y = unpad_groups(xp.detach(), splits, padded, num_rows=12)
    torch.cuda.synchronize()
    assert xp.shape == (12 + 3 * 3, 3) and padded.tolist() == [4, 0, 4]
    assert torch.equal(xp[:8].cpu(), pad_groups(x_cpu[:7], [3, 0, 4], 4)[0])
    assert not xp[8:].any()
    assert torch.equal(x.grad.cpu(), torch.cat([torch.ones(7, 3), torch.zeros(5, 3)]))
    assert torch.equal(y[:7].cpu(), x_cpu[:7]) and not y[7:].any()
    # bad values are clamped on the device, never read out of bounds
    bad = torch.tensor([5, -3, 100, 2], device="cuda")
    with _NoSync():
        xp, padded = pad_groups(x, bad, 16)
        y = unpad_groups(xp, bad, padded, num_rows=12)
    torch.cuda.synchronize()
    assert xp.shape == (12 + 4 * 15, 3) and y.shape == (12, 3)
    assert int(padded.sum()) <= xp.shape[0]
    # without num_rows the output size is read back (allowed to sync)
    m_dev, p_dev = torch.tensor([3, 0, 4], device="cuda"), torch.tensor([4, 0, 4], device="cuda")
    y = unpad_groups(xp, m_dev, p_dev)
    assert y.shape == (7, 3)


@pytest.mark.gpu
@cuda
def test_cuda_input_host_splits():
    x_cpu = torch.randn(9, 4, requires_grad=True)
    xp_cpu, padded_cpu = pad_groups(x_cpu, [4, 0, 5], 8)
    xp_cpu.sum().backward()
    x = x_cpu.detach().cuda().requires_grad_()
    xp, padded = pad_groups(x, [4, 0, 5], 8)
    xp.sum().backward()
    assert padded == padded_cpu and torch.equal(xp.cpu(), xp_cpu.detach())
    assert torch.equal(x.grad.cpu(), x_cpu.grad)
    assert torch.equal(unpad_groups(xp, [4, 0, 5], padded).cpu(), x_cpu.detach())
