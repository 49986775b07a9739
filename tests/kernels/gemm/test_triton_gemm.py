"""The Triton grouped GEMMs against the per-group loop (CUDA, or the Triton interpreter)."""

import pytest
import torch

from grouped_linear.kernels._triton import HAS_TRITON, use_triton
from grouped_linear.kernels.gemm import torch_gemm as grouped_gemm
from grouped_linear.kernels.gemm import triton_gemm
from tests.reference import reference_grads, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

CASES = [  # (sizes as given, rows of the input, K, N)
    ([5, 0, 70, 1, 33], 118, 40, 72),       # unaligned, an empty group, a 9-row tail
    ([0, 0, 0], 7, 16, 8),                   # every row in the tail
    ([130, 2], 132, 130, 24),                # K and N not multiples of the tiles
    ([-3, 50, 400], 60, 16, 16),             # bad sizes: clamped, never out of bounds
]


def _clamped_bounds(sizes, M):
    bounds, run = [0], 0
    for s in sizes:
        run = min(M, run + max(s, 0))
        bounds.append(run)
    return bounds


@pytest.mark.parametrize("sizes, M, K, N", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_dgrad_wgrad(sizes, M, K, N, dtype):
    G = len(sizes)
    x = torch.randn(M, K, device=DEVICE, dtype=dtype)
    w = torch.randn(G, N, K, device=DEVICE, dtype=dtype)
    b = torch.randn(G, N, device=DEVICE, dtype=dtype)
    dy = torch.randn(M, N, device=DEVICE, dtype=dtype)
    assert use_triton(x)
    st = torch.tensor(sizes, device=DEVICE)
    bounds = _clamped_bounds(sizes, M)
    offs = torch.tensor(bounds[1:], dtype=torch.int32, device=DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out = triton_gemm.forward(x, w, b, st)
    ref = grouped_gemm.forward(x.double(), w.double(), offs, None, "loop")
    for g in range(G):
        ref[bounds[g]:bounds[g + 1]] += b[g].double()
    assert rel_err(out, ref) < tol and torch.all(out[bounds[-1]:] == 0)
    dx = triton_gemm.dgrad(dy, w, st)
    ref_dx = grouped_gemm.dgrad(dy.double(), w.double(), offs, None, "loop")
    assert rel_err(dx, ref_dx) < tol and torch.all(dx[bounds[-1]:] == 0)
    dw, db = triton_gemm.wgrad(dy, x, st, True)
    ref_dw = grouped_gemm.wgrad(dy.double(), x.double(), offs, None, "loop")
    ref_db = torch.stack([dy[bounds[g]:bounds[g + 1]].double().sum(0) for g in range(G)])
    assert rel_err(dw, ref_dw) < tol and rel_err(db, ref_db) < tol
    assert db.dtype == dtype  # summed in float32, stored as the bias is
    for g in range(G):
        if bounds[g + 1] == bounds[g]:
            assert torch.all(dw[g] == 0) and torch.all(db[g] == 0)
    dw_only, none = triton_gemm.wgrad(dy, x, st, False)
    assert none is None and torch.equal(dw_only, dw)
    # The one-launch backward: the same values as the two launches, bit for bit.
    for with_bias in (True, False):
        fused_dx, fused_dw, fused_db = triton_gemm.backward(dy, x, w, st, with_bias)
        assert torch.equal(fused_dx, dx) and torch.equal(fused_dw, dw)
        assert torch.equal(fused_db, db) if with_bias else fused_db is None


@pytest.mark.parametrize("tile", [triton_gemm.WgradTile(16, 16, 16, 4, 2, k_run=2),
                                  triton_gemm.WgradTile(32, 16, 32, 4, 1, k_run=3)])
def test_weight_gradient_tiles_and_runs_of_k_tiles(tile):
    """Other weight-gradient launch shapes, a program writing runs of K tiles (the last run
    short): the same gradients, from ``wgrad`` and from ``backward`` in one launch and in
    two."""
    sizes, M, K, N = [5, 0, 70, 1, 33], 118, 80, 40  # 5 K tiles of 16: runs of 2, 2, 1
    G = len(sizes)
    x, dy = torch.randn(M, K, device=DEVICE), torch.randn(M, N, device=DEVICE)
    w = torch.randn(G, N, K, device=DEVICE)
    st = torch.tensor(sizes, device=DEVICE)
    bounds = _clamped_bounds(sizes, M)
    offs = torch.tensor(bounds[1:], dtype=torch.int32, device=DEVICE)
    ref_dw = grouped_gemm.wgrad(dy.double(), x.double(), offs, None, "loop")
    ref_db = torch.stack([dy[bounds[g]:bounds[g + 1]].double().sum(0) for g in range(G)])
    ref_dx = grouped_gemm.dgrad(dy.double(), w.double(), offs, None, "loop")
    dw, db = triton_gemm.wgrad(dy, x, st, True, tile=tile)
    assert rel_err(dw, ref_dw) < 1e-5 and rel_err(db, ref_db) < 1e-5
    assert torch.all(dw[1] == 0) and torch.all(db[1] == 0)  # the empty group
    for one_launch in (True, False):
        got_dx, got_dw, got_db = triton_gemm.backward(dy, x, w, st, True, one_launch=one_launch,
                                                      tile=tile)
        assert torch.equal(got_dw, dw) and torch.equal(got_db, db)
        assert rel_err(got_dx, ref_dx) < 1e-5


def test_the_backward_takes_one_launch_for_small_weight_gradients_only(monkeypatch):
    """One launch up to ONE_LAUNCH_MAX_WEIGHTS weights, the dgrad and wgrad kernels past it,
    each weight gradient at the launch shape its rows per group call for."""
    calls = []
    monkeypatch.setattr(triton_gemm, "dgrad",
                        lambda *a, f=triton_gemm.dgrad: calls.append("dgrad") or f(*a))
    monkeypatch.setattr(triton_gemm, "wgrad",
                        lambda *a, f=triton_gemm.wgrad, **k: calls.append(
                            ("wgrad", k.get("tile"))) or f(*a, **k))
    x, dy = torch.randn(40, 16, device=DEVICE), torch.randn(40, 8, device=DEVICE)
    w = torch.randn(4, 8, 16, device=DEVICE)
    st = torch.tensor([10, 10, 10, 10], device=DEVICE)
    triton_gemm.backward(dy, x, w, st, False)
    assert calls == []  # 512 weights: one launch
    monkeypatch.setattr(triton_gemm, "ONE_LAUNCH_MAX_WEIGHTS", 511)
    triton_gemm.backward(dy, x, w, st, False)
    assert calls == ["dgrad", ("wgrad", None)]
    assert triton_gemm.wgrad_tile(40, 4) == triton_gemm.SMALL_GROUPS_TILE  # 10 rows a group
    assert triton_gemm.wgrad_tile(68, 4) == triton_gemm.WGRAD_TILE  # 17


def test_strided_inputs_and_int32_sizes():
    x = torch.randn(40, 24, device=DEVICE)[:, :16]  # rows not contiguous
    w = torch.randn(2, 8, 16, device=DEVICE)
    st = torch.tensor([10, 30], device=DEVICE, dtype=torch.int32)
    out = triton_gemm.forward(x, w, None, st)
    ref = torch.cat([x[:10].double() @ w[0].double().t(), x[10:].double() @ w[1].double().t()])
    assert rel_err(out, ref) < 1e-5


def test_strided_split_sizes_read_as_their_values():
    """A (G,) view with a stride (a column of a per-expert table) gives the same results as
    the same sizes laid out densely."""
    torch.manual_seed(0)
    sizes = [5, 0, 9, 3]
    table = torch.tensor([[s, 1000 + s] for s in sizes], device=DEVICE)
    strided, dense = table[:, 0], table[:, 0].contiguous()
    assert not strided.is_contiguous()
    x = torch.randn(19, 16, device=DEVICE)
    w = torch.randn(4, 8, 16, device=DEVICE)
    b = torch.randn(4, 8, device=DEVICE)
    dy = torch.randn(19, 8, device=DEVICE)
    assert torch.equal(triton_gemm.forward(x, w, b, strided), triton_gemm.forward(x, w, b, dense))
    assert torch.equal(triton_gemm.dgrad(dy, w, strided), triton_gemm.dgrad(dy, w, dense))
    for got, want in zip(triton_gemm.wgrad(dy, x, strided, True),
                         triton_gemm.wgrad(dy, x, dense, True)):
        assert torch.equal(got, want)
    for got, want in zip(triton_gemm.backward(dy, x, w, strided, True),
                         triton_gemm.backward(dy, x, w, dense, True)):
        assert torch.equal(got, want)
    ref = torch.cat([x[:5].double() @ w[0].double().t() + b[0].double(),
                     x[5:14].double() @ w[2].double().t() + b[2].double(),
                     x[14:17].double() @ w[3].double().t() + b[3].double(),
                     torch.zeros(2, 8, dtype=torch.float64, device=DEVICE)])
    assert rel_err(triton_gemm.forward(x, w, b, strided), ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_launches_match_the_keyed_functions(monkeypatch, dtype):
    """``LinearLaunches`` gives the keyed functions' values bit for bit. On CUDA its second
    call of each direction launches from the plan without calling them (bf16), except for a
    gradient of other strides; float32 always takes them (``allow_tf32`` may change)."""
    torch.manual_seed(0)
    sizes = torch.tensor([7, 0, 20, 1], device=DEVICE)
    x = torch.randn(30, 24, device=DEVICE, dtype=dtype)
    w = torch.randn(4, 40, 24, device=DEVICE, dtype=dtype)
    b = torch.randn(4, 40, device=DEVICE, dtype=dtype)
    dy = torch.randn(30, 40, device=DEVICE, dtype=dtype)
    want_y = triton_gemm.forward(x, w, b, sizes)
    want_grads = triton_gemm.backward(dy, x, w, sizes, True)
    # A gradient with another row stride (another Triton specialization: in float32 not
    # always bit-equal to the dense one's).
    wide = torch.zeros(30, 48, device=DEVICE, dtype=dtype)
    wide[:, :40] = dy
    want_wide = triton_gemm.backward(wide[:, :40], x, w, sizes, True)
    calls = []
    for name in ("forward", "backward"):
        keyed = getattr(triton_gemm, name)
        monkeypatch.setattr(triton_gemm, name,
                            lambda *args, _name=name, _keyed=keyed: calls.append(_name)
                            or _keyed(*args))
    launches = triton_gemm.LinearLaunches()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    reference = reference_grads(x, w, b, sizes.tolist(), dy)  # float64: y, dx, dW, db
    for _ in range(3):
        y = launches.forward(x, w, b, sizes)
        grads = launches.backward(dy, x, w, sizes, True)
        assert torch.equal(y, want_y)
        for got, want, ref in zip((y, *grads), (want_y, *want_grads), reference):
            assert torch.equal(got, want) and rel_err(got, ref) < tol
    planned = DEVICE == "cuda" and dtype == torch.bfloat16
    assert calls == (["forward", "backward"] if planned else ["forward", "backward"] * 3)
    # The wide gradient's strides are not the plan's: the keyed function.
    for got, want in zip(launches.backward(wide[:, :40], x, w, sizes, True), want_wide):
        assert torch.equal(got, want)
    assert calls[-1] == "backward"
    # The other bias flag has a plan of its own.
    grad_x, grad_w, grad_b = launches.backward(dy, x, w, sizes, False)
    assert grad_b is None and torch.equal(grad_x, want_grads[0])
    assert torch.equal(grad_w, want_grads[1])
