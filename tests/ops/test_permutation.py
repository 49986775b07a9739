"""permute / unpermute against float64 loop references, on CPU and (marked) CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grouped_linear as gl
from grouped_linear.ops.permutation import TRACEABLE, permute, unpermute
from grouped_linear.recipes import Float8Rowwise
from tests.reference import saved_by


def ref_permute(x: torch.Tensor, topk: list[list[int]], num_experts: int, multiple: int):
    """Loop reference: (x_perm float64, padded counts, row_map)."""
    tokens, k = len(topk), (len(topk[0]) if topk else 0)
    rows, counts = [], []
    row_map = [[-1] * k for _ in range(tokens)]
    for e in range(num_experts):
        count = 0
        for t in range(tokens):
            for j in range(k):
                if topk[t][j] == e:
                    row_map[t][j] = len(rows)
                    rows.append(x[t].double())
                    count += 1
        padded = (count + multiple - 1) // multiple * multiple
        rows.extend([torch.zeros(x.shape[1], dtype=torch.float64)] * (padded - count))
        counts.append(padded)
    x_perm = torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=torch.float64)
    return x_perm, counts, row_map


def ref_unpermute(y: torch.Tensor, row_map: list[list[int]], probs: torch.Tensor | None):
    out = torch.zeros(len(row_map), y.shape[1], dtype=torch.float64)
    for t, slots in enumerate(row_map):
        for j, row in enumerate(slots):
            if row >= 0:
                weight = 1.0 if probs is None else float(probs[t, j])
                out[t] += weight * y[row].double()
    return out


def random_routing(gen, tokens, k, num_experts, drop=0.2, distinct=True):
    if distinct and k <= num_experts:
        topk = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(tokens)])
        topk = topk.reshape(tokens, k)
    else:
        topk = torch.randint(0, num_experts, (tokens, k), generator=gen)
    dropped = torch.rand(tokens, k, generator=gen) < drop
    return topk.masked_fill(dropped, -1)


def check_routing(topk: torch.Tensor, num_experts: int, multiple: int, hidden=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens, k = topk.shape
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    x_perm, m_splits, row_map = permute(x, topk, num_experts, multiple)
    ref, ref_counts, ref_map = ref_permute(x.detach(), topk.tolist(), num_experts, multiple)
    assert m_splits.dtype == torch.int64 and m_splits.tolist() == ref_counts
    assert row_map.dtype == torch.int64 and row_map.tolist() == ref_map
    assert torch.equal(x_perm, ref)

    grad = torch.randn(x_perm.shape, generator=gen, dtype=torch.float64)
    x_perm.backward(grad)
    ref_grad = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            if ref_map[t][j] >= 0:
                ref_grad[t] += grad[ref_map[t][j]]
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-12, atol=1e-12)

    y = torch.randn(x_perm.shape, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(tokens, k, generator=gen, dtype=torch.float64, requires_grad=True)
    out = unpermute(y, row_map, probs)
    torch.testing.assert_close(out, ref_unpermute(y.detach(), ref_map, probs.detach()))
    gout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(gout)
    ref_gy = torch.zeros_like(y)
    ref_gp = torch.zeros_like(probs)
    for t in range(tokens):
        for j in range(k):
            row = ref_map[t][j]
            if row >= 0:
                ref_gy[row] += probs[t, j].detach() * gout[t]
                ref_gp[t, j] = (gout[t] * y[row].detach()).sum()
    torch.testing.assert_close(y.grad, ref_gy)
    torch.testing.assert_close(probs.grad, ref_gp)

    # a plain sum of the permuted rows gives each token times its routed-slot count
    plain = unpermute(x_perm.detach(), row_map)
    kept = (topk >= 0).sum(1, keepdim=True).double()
    torch.testing.assert_close(plain, kept * x.detach())


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("multiple", [1, 16, 128])
def test_matches_reference(k, multiple):
    gen = torch.Generator().manual_seed(k)
    topk = random_routing(gen, tokens=11, k=k, num_experts=8)
    check_routing(topk, 8, multiple, seed=k)


def test_empty_experts_and_dropped():
    topk = torch.tensor([[2, -1], [-1, -1], [2, 5], [5, 2], [-1, 0]])
    check_routing(topk, 7, 4)  # experts 1, 3, 4, 6 empty; token 1 fully dropped
    check_routing(torch.full((4, 2), -1), 3, 16)  # everything dropped
    check_routing(torch.zeros(6, 1, dtype=torch.int32), 1, 1)  # one expert
    check_routing(torch.tensor([[1, 1], [0, 1]]), 2, 1)  # repeated expert in a token
    check_routing(torch.zeros(0, 3, dtype=torch.int64), 4, 8)  # no tokens


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 12),
    k=st.integers(1, 4),
    num_experts=st.integers(1, 6),
    multiple=st.sampled_from([1, 2, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_property(tokens, k, num_experts, multiple, seed):
    gen = torch.Generator().manual_seed(seed)
    topk = random_routing(gen, tokens, k, num_experts, drop=0.3, distinct=False)
    check_routing(topk, num_experts, multiple, hidden=2, seed=seed)


def test_gradcheck():
    topk = torch.tensor([[0, 2], [2, -1], [1, 0], [-1, 2]])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: permute(t, topk, 3, 2)[0], (x,))
    _, _, row_map = permute(x, topk, 3, 2)
    y = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(unpermute, (y, row_map, probs))
    assert torch.autograd.gradcheck(lambda t: unpermute(t, row_map), (y,))


@pytest.mark.parametrize("weighted", [None, "constant", "trained"])
def test_unpermute_keeps_the_rows_only_for_the_weights_gradient(weighted):
    """``y_perm`` is saved for backward only when ``probs`` needs a gradient; the gradient
    of ``y_perm`` is the same either way."""
    topk = torch.tensor([[0, 2], [2, -1], [1, 0], [-1, 2]])
    _, _, row_map = permute(torch.zeros(4, 3), topk, 3)
    y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    probs = None if weighted is None else torch.rand(4, 2, dtype=torch.float64,
                                                      requires_grad=weighted == "trained")
    saved, out = saved_by(lambda: unpermute(y, row_map, probs))
    assert any(t is y for t in saved) == (weighted == "trained")
    torch.testing.assert_close(out, ref_unpermute(y.detach(), row_map.tolist(), probs))
    grad_out = torch.randn(4, 3, dtype=torch.float64)
    out.backward(grad_out)
    grad_y = torch.zeros_like(y)
    for t, slots in enumerate(row_map.tolist()):
        for j, row in enumerate(slots):
            if row >= 0:
                grad_y[row] += grad_out[t] * (1.0 if probs is None else probs[t, j].item())
                if weighted == "trained":
                    torch.testing.assert_close(probs.grad[t, j], grad_out[t] @ y[row].detach())
    torch.testing.assert_close(y.grad, grad_y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_under_an_fp8_recipe_keeps_the_rows_in_fp8(dtype):
    """Inside ``gl.autocast(recipe)`` the rows kept for the weights' gradient are FP8 codes
    with 128-column tile factors, not ``y_perm``: the output and ``y_perm``'s gradient are
    the plain call's, the weights' gradient within half an E4M3 step of each product."""
    gen = torch.Generator().manual_seed(5)
    topk = random_routing(gen, 24, 4, 8, drop=0.2)
    _, _, row_map = permute(torch.zeros(24, 1), topk, 8)
    y = (torch.randn(96, 200, generator=gen) * 3).to(dtype).requires_grad_()
    probs = torch.rand(24, 4, generator=gen, requires_grad=True)
    grad_out = torch.randn(24, 200, generator=gen).to(dtype)
    plain = unpermute(y, row_map, probs)
    plain.backward(grad_out)
    want_y, want_p = y.grad, probs.grad
    y.grad = probs.grad = None
    with gl.autocast(Float8Rowwise()):
        saved, out = saved_by(lambda: unpermute(y, row_map, probs))
    assert not any(t is y for t in saved)
    assert [t.shape for t in saved if t.dtype == torch.float8_e4m3fn] == [y.shape]
    assert torch.equal(out, plain)
    out.backward(grad_out)
    assert torch.equal(y.grad, want_y)
    exact = torch.zeros(24, 4, dtype=torch.float64)
    bound = torch.zeros(24, 4, dtype=torch.float64)
    for t, slots in enumerate(row_map.tolist()):
        for j, row in enumerate(slots):
            if row >= 0:
                products = y[row].detach().double() * grad_out[t].double()
                exact[t, j], bound[t, j] = products.sum(), products.abs().sum() / 16
    assert ((probs.grad.double() - exact).abs() <= bound * (1 + 1e-3) + 1e-6).all()
    assert not torch.equal(probs.grad, want_p)  # it did quantize
    with gl.autocast(Float8Rowwise()):  # weights without a gradient: nothing of y kept
        saved, _ = saved_by(lambda: unpermute(y, row_map, probs.detach()))
    assert not any(t.shape == y.shape for t in saved)


def test_low_precision_combine():
    gen = torch.Generator().manual_seed(3)
    topk = random_routing(gen, 16, 8, 8, drop=0.0)
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    x_perm, _, row_map = permute(x, topk, 8)
    assert x_perm.dtype == torch.bfloat16
    probs = torch.rand(16, 8, generator=gen, requires_grad=True)  # float32 probs, bf16 rows
    y = x_perm.detach().requires_grad_()
    out = unpermute(y, row_map, probs)
    assert out.dtype == torch.bfloat16
    ref = ref_unpermute(y.detach(), row_map.tolist(), probs.detach())
    # accumulated in float32 and rounded once: within one bf16 rounding of the exact sum
    assert ((out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
    out.backward(torch.ones_like(out))
    assert y.grad.dtype == torch.bfloat16 and probs.grad.dtype == torch.float32
    ref_gp = torch.stack([y.detach()[row_map[t]].double().sum(-1) for t in range(16)])
    torch.testing.assert_close(probs.grad.double(), ref_gp, rtol=1e-5, atol=1e-5)
    # permute's backward sums k copies in float32 too
    xg = x.detach().requires_grad_()
    permute(xg, topk, 8)[0].backward(torch.ones(x_perm.shape, dtype=torch.bfloat16))
    assert torch.equal(xg.grad, torch.full_like(x, 8))


def test_uneven_probs_dtype_and_zero_stride_grad():
    topk = torch.tensor([[0, 1], [1, -1]])
    x = torch.randn(2, 3, requires_grad=True)
    x_perm, _, row_map = permute(x, topk, 2)
    probs = torch.tensor([[0.25, 0.75], [0.5, float("nan")]], dtype=torch.float64)
    out = unpermute(x_perm, row_map, probs)  # NaN weight on a dropped slot is ignored
    assert out.dtype == torch.float32 and not out.isnan().any()
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1.0] * 3, [0.5] * 3]))


def test_deterministic():
    gen = torch.Generator().manual_seed(5)
    topk = random_routing(gen, 64, 4, 8, distinct=False)
    x = torch.randn(64, 16, generator=gen, requires_grad=True)
    probs = torch.rand(64, 4, generator=gen, requires_grad=True)
    results = []
    for _ in range(2):
        x.grad = probs.grad = None
        x_perm, _, row_map = permute(x, topk, 8, 4)
        out = unpermute(x_perm * 1.5, row_map, probs)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
        results.append((out.detach(), x.grad.clone(), probs.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


# --------------------------------------------------------------------------- errors

X = torch.zeros(3, 4)
TOPK = torch.tensor([[0, 1], [1, 2], [2, -1]])


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.zeros(3), TOPK, 3), ValueError, r"x has shape \(3,\)"),
        ((X.numpy(), TOPK, 3), TypeError, "x is ndarray"),
        ((X, TOPK.float(), 3), TypeError, "topk_indices has dtype torch.float32"),
        ((X, TOPK.bool(), 3), ValueError, r"bool routing map of shape \(3, 2\)"),
        ((X, TOPK.tolist(), 3), TypeError, "topk_indices is list"),
        ((X, TOPK[..., None], 3), ValueError, r"topk_indices has shape \(3, 2, 1\)"),
        ((X, TOPK[:2], 3), ValueError, "topk_indices has 2 rows but x has 3"),
        ((X, TOPK, 0), ValueError, "num_experts is 0"),
        ((X, TOPK, 2.0), TypeError, "num_experts is 2.0"),
        ((X, TOPK, 3, 0), ValueError, "multiple is 0"),
        ((X, TOPK, 3, 1.5), TypeError, "multiple is 1.5"),
        ((X, TOPK, 2), ValueError, r"topk_indices\[1, 1\] is 2: expert indices must be in \[-1, 1"),
        ((X, TOPK - 1, 3), ValueError, r"topk_indices\[2, 1\] is -2"),
    ],
)
def test_permute_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        permute(*args)


Y = torch.zeros(5, 4)
ROW_MAP = torch.tensor([[0, 3], [1, -1], [4, 2]])


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.zeros(5), ROW_MAP), ValueError, r"y_perm has shape \(5,\)"),
        ((Y, ROW_MAP.float()), TypeError, "row_map has dtype torch.float32"),
        ((Y, ROW_MAP[0]), ValueError, r"row_map has shape \(2,\)"),
        ((Y, ROW_MAP, torch.rand(3, 3)), ValueError, r"probs has shape \(3, 3\)"),
        ((Y, ROW_MAP, torch.ones(3, 2, dtype=torch.int64)), TypeError, "probs has dtype"),
        ((Y, ROW_MAP, [[1.0, 1.0]] * 3), TypeError, "probs is list"),
        ((Y, ROW_MAP + 1), ValueError, r"row_map\[2, 0\] is 5: entries must be -1"),
        ((Y, ROW_MAP - 1), ValueError, r"row_map\[1, 1\] is -2"),
        ((Y, torch.tensor([[0, 1], [1, 2]])), ValueError,
         r"row_map\[0, 1\] and row_map\[1, 0\] are both 1: each row of y_perm"),
    ],
)
def test_unpermute_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        unpermute(*args)


MAX_ROWS = 2**63 - 1


def test_multiple_is_bounded_by_the_rows_a_tensor_holds():
    """The rows of 4 slots padded over 4 experts may reach 4 + 4*(multiple-1): a multiple
    taking that past int64 is a ValueError naming it, not wrapped sizes and row indices."""
    x, topk = torch.randn(4, 3), torch.arange(4)[:, None]
    first_too_large = (MAX_ROWS - 4) // 4 + 2
    for multiple in (2**62, 2**64, first_too_large):
        with pytest.raises(ValueError, match=f"multiple is {multiple}: padding the groups of 4"):
            permute(x, topk, 4, multiple)
    multiple = 2**12
    x_perm, m_splits, row_map = permute(x, topk, 4, multiple)
    assert m_splits.tolist() == [multiple] * 4 and x_perm.shape == (4 * multiple, 3)
    assert row_map[:, 0].tolist() == [e * multiple for e in range(4)]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8])
def test_narrow_index_dtypes(dtype):
    """Indices of any integer dtype are compared as int64: in their own dtype num_experts=200
    wraps (int8) and -1 is 255 (uint8), so valid indices were reported as out of range."""
    gen = torch.Generator().manual_seed(0)
    high = min(200, torch.iinfo(dtype).max + 1)
    topk = torch.randint(0, high, (16, 2), generator=gen)
    if dtype != torch.uint8:
        topk[::3, 1] = -1
    x = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    want = permute(x, topk, 200, 4)
    got = permute(x, topk.to(dtype), 200, 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    y = torch.randn(200, 3, generator=gen, dtype=torch.float64)
    rows = torch.randperm(high, generator=gen)[:32].view(16, 2)  # distinct rows of y
    assert torch.equal(unpermute(y, rows.to(dtype)), unpermute(y, rows))
    bad = torch.full((16, 2), torch.iinfo(dtype).max, dtype=dtype)
    with pytest.raises(ValueError, match=rf"is {torch.iinfo(dtype).max}: expert indices must be "
                                         r"in \[-1, 99\]"):
        permute(x, bad, 100)
    with pytest.raises(ValueError, match=rf"row_map\[0, 0\] is {torch.iinfo(dtype).max}: entries"):
        unpermute(torch.zeros(100, 3), bad)


def test_compiled_matches_eager():
    """permute and unpermute trace with fullgraph on CPU (their host-reading checks skipped,
    out-of-range slots dropped): x_perm has the upper-bound row count, zero past the data.
    Before torch 2.13 they are not traced (a graph break there), and give eager's values."""
    torch._dynamo.reset()

    def step(x, topk, probs):
        x_perm, m_splits, row_map = permute(x, topk, 4, 2)
        return x_perm, m_splits, row_map, unpermute(x_perm * 3, row_map, probs)

    compiled = torch.compile(step, fullgraph=TRACEABLE, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    topk = random_routing(gen, 6, 2, 4)
    results = []
    for fn in (compiled, step):
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                        requires_grad=True)
        probs = torch.rand(6, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64,
                           requires_grad=True)
        x_perm, m_splits, row_map, out = fn(x, topk, probs)
        out.square().sum().backward()
        results.append((x_perm.detach(), m_splits, row_map, out.detach(), x.grad, probs.grad))
    (c_perm, *c_rest), (e_perm, *e_rest) = results
    rows = e_perm.shape[0]
    if TRACEABLE:
        assert c_perm.shape[0] == topk.numel() + 4 * (2 - 1)
    assert torch.equal(c_perm[:rows], e_perm) and not c_perm[rows:].any()
    for a, b in zip(c_rest, e_rest):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("k, multiple", [(1, 1), (2, 16), (8, 128), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sync_free(k, multiple, dtype):
    gen = torch.Generator().manual_seed(k)
    tokens, experts = 37, 8
    topk = random_routing(gen, tokens, k, experts, drop=0.2, distinct=False)
    topk_cuda = topk.clone()
    topk_cuda[0, 0] = experts + 3  # out of range: dropped on CUDA, like -1 on CPU
    topk_cuda[1, k - 1] = -7
    topk[0, 0] = topk[1, k - 1] = -1
    x_cpu = torch.randn(tokens, 32, generator=gen).to(dtype).requires_grad_()
    probs_cpu = torch.rand(tokens, k, generator=gen).requires_grad_()
    x_perm_cpu, m_cpu, map_cpu = permute(x_cpu, topk, experts, multiple)
    rows = x_perm_cpu.shape[0]
    bound = tokens * k + experts * (multiple - 1)
    g_perm = torch.randn(bound, 32, generator=gen).to(dtype)
    x_perm_cpu.backward(g_perm[:rows])
    y_cpu = torch.randn(rows, 32, generator=gen).to(dtype).requires_grad_()
    out_cpu = unpermute(y_cpu, map_cpu, probs_cpu)
    g_out = torch.randn(tokens, 32, generator=gen).to(dtype)
    out_cpu.backward(g_out)

    x = x_cpu.detach().cuda().requires_grad_()
    probs = probs_cpu.detach().cuda().requires_grad_()
    y_full = torch.cat([y_cpu.detach(), torch.randn(bound - rows, 32).to(dtype)]).cuda()
    y = y_full.requires_grad_()
    topk_dev, g_perm_dev, g_out_dev = topk_cuda.cuda(), g_perm.cuda(), g_out.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x_perm, m_splits, row_map = permute(x, topk_dev, experts, multiple)
        x_perm.backward(g_perm_dev)
        out = unpermute(y, row_map, probs)
        out.backward(g_out_dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    # summation order may differ between devices: allow one rounding of the dtype
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}
    assert x_perm.shape == (bound, 32) and m_splits.device.type == "cuda"
    assert torch.equal(m_splits.cpu(), m_cpu) and torch.equal(row_map.cpu(), map_cpu)
    assert torch.equal(x_perm[:rows].cpu(), x_perm_cpu.detach()) and not x_perm[rows:].any()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad, **tol)
    torch.testing.assert_close(out.cpu(), out_cpu.detach(), **tol)
    torch.testing.assert_close(y.grad[:rows].cpu(), y_cpu.grad, rtol=0, atol=0)
    assert not y.grad[rows:].any()
    torch.testing.assert_close(probs.grad.cpu(), probs_cpu.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@cuda
def test_cuda_bad_row_map_is_safe():
    y = torch.randn(6, 4, device="cuda", requires_grad=True)
    row_map = torch.tensor([[0, 9], [-5, 2]], device="cuda")  # 9, -5: out of range → dropped
    out = unpermute(y, row_map, torch.ones(2, 2, device="cuda"))
    out.sum().backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.stack([y[0], y[2]]).detach())
    assert y.grad[[0, 2]].eq(1).all() and not y.grad[[1, 3, 4, 5]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_or_no_slots(dtype):
    """``T = 0`` or ``k = 0``: unpermute returns zero-row or all-zero outputs and permute's
    backward an empty gradient (no reshape of an empty tensor to an inferred size)."""
    y = torch.randn(3, 4, dtype=dtype, requires_grad=True)
    out = unpermute(y, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.equal(y.grad, torch.zeros_like(y))
    out = unpermute(y, torch.zeros(4, 0, dtype=torch.long))
    assert torch.equal(out, torch.zeros(4, 4, dtype=dtype))
    x = torch.randn(0, 4, dtype=dtype, requires_grad=True)
    routed, splits, row_map = permute(x, torch.zeros(0, 2, dtype=torch.long), 3)
    assert routed.shape == (0, 4) and splits.tolist() == [0, 0, 0]
    (routed.sum() + unpermute(routed, row_map).sum()).backward()
    assert x.grad.shape == (0, 4)
    # k = 0 with tokens: nothing routed, each token's output zero, x's gradient zero
    x = torch.randn(3, 4, dtype=dtype, requires_grad=True)
    for multiple in (1, 2):
        routed, splits, row_map = permute(x, torch.zeros(3, 0, dtype=torch.long), 2,
                                          multiple=multiple)
        assert routed.shape == (0, 4) and splits.tolist() == [0, 0]
        assert row_map.shape == (3, 0)
        out = unpermute(routed, row_map)
        assert torch.equal(out, torch.zeros(3, 4, dtype=dtype))
        x.grad = None
        (routed.sum() + out.sum()).backward()
        assert torch.equal(x.grad, torch.zeros_like(x))
