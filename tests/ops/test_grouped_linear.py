"""The functional grouped linear op against a float64 per-group reference (CPU)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import grouped_linear as gl
from tests.reference import gathered_reference, reference_grads, rel_err

# The triton backend runs where Triton does: CUDA, else the CPU interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}

SPLIT_CASES = {
    "random_with_zeros": [5, 0, 17, 3, 0, 9],
    "single_nonempty": [0, 0, 23, 0, 0, 0],
    "unaligned": [7, 13, 1, 29, 11, 3],
    "first_and_last_empty": [0, 12, 9, 4, 8, 0],
}


def _run(x, weight, bias, m_splits, backend, sizes):
    if backend == "triton":
        x, weight = x.to(TRITON_DEVICE), weight.to(TRITON_DEVICE)
        bias = bias.to(TRITON_DEVICE) if bias is not None else None
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    bias = bias.detach().requires_grad_() if bias is not None else None
    y = gl.grouped_linear(x, weight, bias, m_splits, backend=backend)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = reference_grads(x, weight, bias, sizes, grad_out)
    got = (y, x.grad, weight.grad, bias.grad if bias is not None else None)
    return got, ref


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize(
    "dtype, backend",
    [(dtype, backend) for dtype in (torch.float64, torch.float32, torch.bfloat16)
     for backend in ("loop", "grouped", "triton", "auto")
     if not (backend in ("grouped", "triton") and dtype == torch.float64)],  # no float64 there
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_float64_reference(case, dtype, backend, with_bias):
    sizes = SPLIT_CASES[case]
    G, K, N = len(sizes), 24, 40
    x = torch.randn(sum(sizes), K, dtype=dtype)
    weight = torch.randn(G, N, K, dtype=dtype)
    bias = torch.randn(G, N, dtype=dtype) if with_bias else None
    got, ref = _run(x, weight, bias, sizes, backend, sizes)
    for name, g, r in zip(("y", "dx", "dW", "db"), got, ref):
        if r is None:
            assert g is None
            continue
        assert g.dtype == dtype and g.shape == r.shape, name
        assert rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))
    empty = [g for g, s in enumerate(sizes) if s == 0]
    assert torch.all(got[2][empty] == 0)
    if with_bias:
        assert torch.all(got[3][empty] == 0)


@pytest.mark.parametrize("kind", ["list", "tuple", "cpu_tensor_int64", "cpu_tensor_int32"])
def test_split_kinds(kind):
    sizes = [4, 0, 9, 2]
    splits = {
        "list": sizes,
        "tuple": tuple(sizes),
        "cpu_tensor_int64": torch.tensor(sizes),
        "cpu_tensor_int32": torch.tensor(sizes, dtype=torch.int32),
    }[kind]
    x, w, b = torch.randn(15, 8), torch.randn(4, 6, 8), torch.randn(4, 6)
    got, ref = _run(x, w, b, splits, "auto", sizes)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-5


def test_list_input_matches_tensor_input():
    sizes = [3, 0, 5]
    pieces = [torch.randn(s, 8, dtype=torch.float64, requires_grad=True) for s in sizes]
    w = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    y = gl.grouped_linear(pieces, w, None, None)
    y_given = gl.grouped_linear(pieces, w, None, sizes)
    y.backward(torch.ones_like(y))
    x = torch.cat([p.detach() for p in pieces])
    ref = reference_grads(x, w, None, sizes, torch.ones_like(y))
    assert rel_err(y, ref[0]) < 1e-12 and torch.equal(y, y_given)
    assert rel_err(torch.cat([p.grad for p in pieces]), ref[1]) < 1e-12
    assert rel_err(w.grad, ref[2]) < 1e-12


def test_gradcheck_float64():
    sizes = [2, 0, 3, 1]
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: gl.grouped_linear(x, w, b, sizes), (x, w, b))


@pytest.mark.parametrize("sizes", [[3, 0, 6], [0, 0, 0]], ids=["rows", "no_rows"])
def test_zero_stride_grad_output(sizes):
    """``y.sum().backward()`` sends a gradient with zero strides (of no rows, too: its
    transpose has no columns)."""
    rows = sum(sizes)
    for backend in ("auto", "loop", "grouped", "triton"):
        device = TRITON_DEVICE if backend == "triton" else "cpu"
        x = torch.randn(rows, 8, device=device, requires_grad=True)
        w = torch.randn(3, 4, 8, device=device, requires_grad=True)
        b = torch.randn(3, 4, device=device, requires_grad=True)
        gl.grouped_linear(x, w, b, sizes, backend=backend).sum().backward()
        ref = reference_grads(x, w, b, sizes, torch.ones(rows, 4))
        for g, r in zip((x.grad, w.grad, b.grad), ref[1:]):
            assert g.shape == r.shape, backend
            assert (torch.equal(g, r.to(g.dtype)) if rows == 0 else rel_err(g, r) < 1e-5), backend


def test_deterministic():
    sizes = [31, 0, 17, 50]
    x, w, b = torch.randn(98, 32), torch.randn(4, 16, 32), torch.randn(4, 16)
    grad_out = torch.randn(98, 16)
    results = []
    for _ in range(2):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = gl.grouped_linear(xs, ws, bs, sizes)
        y.backward(grad_out)
        results.append((y, xs.grad, ws.grad, bs.grad))
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_autocast_computes_in_autocast_dtype():
    sizes = [5, 3]
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(2, 8, 16, requires_grad=True)
    b = torch.randn(2, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gl.grouped_linear(x, w, b, sizes)
    assert y.dtype == torch.bfloat16
    y.float().backward(torch.ones(8, 8))
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    ref = reference_grads(x, w, b, sizes, torch.ones(8, 8))
    assert rel_err(y, ref[0]) < 1e-2
    assert rel_err(w.grad, ref[2]) < 1e-2


def test_autocast_leaves_float64_as_torch_autocast_does():
    """``torch.autocast`` casts no float64 operand (``F.linear`` stays float64 inside it):
    a float64 call inside the region is the float64 call, bit for bit, list input too."""
    sizes = [5, 3]
    x = torch.randn(8, 16, dtype=torch.float64)
    w = torch.randn(2, 8, 16, dtype=torch.float64)
    b = torch.randn(2, 8, dtype=torch.float64)
    want = gl.grouped_linear(x, w, b, sizes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(x, w[0], b[0]).dtype == torch.float64  # what torch does
        got = gl.grouped_linear(x, w, b, sizes)
        pieces = gl.grouped_linear([x[:5], x[5:]], w, b, sizes)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.equal(pieces, want)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_splits(sizes, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    G, K, N = len(sizes), 6, 5
    x = torch.randn(sum(sizes), K, dtype=torch.float64, generator=gen)
    w = torch.randn(G, N, K, dtype=torch.float64, generator=gen)
    b = torch.randn(G, N, dtype=torch.float64, generator=gen) if with_bias else None
    got, ref = _run(x, w, b, sizes, "auto", sizes)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
        else:
            assert rel_err(g, r) < 1e-12


def test_inference_builds_no_graph_and_matches_training_path():
    sizes = [4, 0, 7]
    x, w, b = torch.randn(11, 8), torch.randn(3, 5, 8), torch.randn(3, 5)
    with torch.no_grad():
        y_nograd = gl.grouped_linear(x, w.requires_grad_(), b, sizes)
    y_plain = gl.grouped_linear(x, w.detach(), b, sizes)  # nothing requires grad
    y_train = gl.grouped_linear(x, w, b, sizes)
    assert y_nograd.grad_fn is None and y_plain.grad_fn is None and y_train.grad_fn is not None
    assert torch.equal(y_nograd, y_train) and torch.equal(y_plain, y_train)


def _spy_on_autograd_functions(monkeypatch) -> list[str]:
    """The names of the autograd functions whose forward is entered, in order."""
    from grouped_linear.ops.fast_path import TritonGroupedLinearFunction
    from grouped_linear.ops.linear_function import GroupedLinearFunction

    entered = []
    for function in (GroupedLinearFunction, TritonGroupedLinearFunction):
        def forward(ctx, *args, _real=function.forward, _name=function.__name__):
            entered.append(_name)
            return _real(ctx, *args)

        monkeypatch.setattr(function, "forward", staticmethod(forward))
    return entered


@pytest.mark.parametrize("backend", ["auto", "loop", "grouped", "triton"])
def test_inference_enters_no_autograd_function(backend, monkeypatch):
    """Under ``torch.no_grad()``, and with no input requiring a gradient, the call runs its
    forward alone: neither autograd function is entered (``grad_fn is None`` alone would
    also hold if one ran under no_grad); with a gradient asked for, one is, once."""
    from grouped_linear.kernels._triton import HAS_TRITON, interpreting
    from grouped_linear.ops.fast_path import apply_triton_linear

    if backend == "triton" and not (HAS_TRITON and (TRITON_DEVICE == "cuda" or interpreting())):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    entered = _spy_on_autograd_functions(monkeypatch)
    sizes = [4, 0, 7]
    x = torch.randn(11, 8, device=device)
    w = torch.randn(3, 8, 8, device=device)
    b = torch.randn(3, 8, device=device)
    splits = torch.tensor(sizes, device=device)
    with torch.no_grad():
        y_nograd = gl.grouped_linear(x, w.requires_grad_(), b, splits, backend=backend)
    y_plain = gl.grouped_linear(x, w.detach(), b, splits, backend=backend)
    assert entered == []
    y_train = gl.grouped_linear(x, w, b, splits, backend=backend)
    assert len(entered) == 1 and y_train.grad_fn is not None
    if device == "cpu":  # CPU calls take the checked path, never the fast one
        assert entered == ["GroupedLinearFunction"]
    assert torch.equal(y_nograd, y_train) and torch.equal(y_plain, y_train)
    if backend == "triton":  # the fast path's own entry, as the CUDA calls reach it
        entered.clear()
        with torch.no_grad():
            fast = apply_triton_linear(x, w, b, splits)
        assert entered == [] and fast.grad_fn is None
        assert torch.equal(apply_triton_linear(x, w.detach(), b, splits), fast)
        assert entered == []
        assert torch.equal(apply_triton_linear(x, w, b, splits), fast)
        assert entered == ["TritonGroupedLinearFunction"]


def test_triton_backend_limits():
    from grouped_linear.kernels.gemm import triton_gemm
    from grouped_linear.ops.dispatch import resolve_backend

    cuda = torch.device("cuda")  # resolution only: no tensor is placed there
    assert resolve_backend("auto", cuda, torch.bfloat16, 1024, 1024, 1024, 8) == "triton"
    # one expert of 2**32 weights: int32 offsets inside it would overflow
    assert resolve_backend("auto", cuda, torch.bfloat16, 2**16, 2**16, 1024, 8) == "grouped"
    # past the Triton kernels' groups and torch's grouped GEMM's (1023 on CUDA): the loop
    assert resolve_backend("auto", cuda, torch.bfloat16, 64, 64, 1024,
                           triton_gemm.MAX_GROUPS + 1) == "loop"
    with pytest.raises(ValueError, match="2\\*\\*31"):
        resolve_backend("triton", cuda, torch.bfloat16, 2**16, 2**16, 16, 8)
    with pytest.raises(ValueError, match="groups"):
        resolve_backend("triton", cuda, torch.bfloat16, 64, 64, 16, triton_gemm.MAX_GROUPS + 1)


def test_fast_path_leaves_cpu_calls_to_the_full_path():
    """The fast path covers CUDA tensors with CUDA splits only: on CPU every split is a host
    split and gets its values checked, so the full path must run."""
    from grouped_linear.ops.dispatch import cached_verdict

    x, w, b = torch.randn(11, 8), torch.randn(3, 5, 8), torch.randn(3, 5)
    assert cached_verdict(x, w, b, torch.tensor([4, 0, 7]), "auto") is None
    with pytest.raises(ValueError, match="sums to 12"):
        gl.grouped_linear(x, w, b, torch.tensor([4, 1, 7]))


@pytest.mark.parametrize("backend", ["loop", "grouped", "triton"])
def test_no_groups(backend):
    """``G = 0`` with no rows: an empty output, empty weight and bias gradients."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    x = torch.randn(0, 8, device=device, requires_grad=True)
    w = torch.randn(0, 4, 8, device=device, requires_grad=True)
    b = torch.randn(0, 4, device=device, requires_grad=True)
    y = gl.grouped_linear(x, w, b, [], backend=backend)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert x.grad.shape == (0, 8) and w.grad.shape == (0, 4, 8) and b.grad.shape == (0, 4)


@pytest.mark.parametrize("backend", ["loop", "grouped", "triton"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("trainable", ["x", "w", "b", "xb", "wb"])
def test_gradients_only_for_what_requires_them(backend, with_bias, trainable):
    """Frozen weights, frozen inputs, a bias alone: each leaf that requires a gradient gets
    the float64 reference's, the others none."""
    if "b" in trainable and not with_bias:
        trainable = trainable.replace("b", "") or "x"
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    sizes = [5, 0, 11]
    x = torch.randn(16, 16, dtype=torch.float64).to(device)
    w = torch.randn(3, 8, 16, dtype=torch.float64).to(device)
    b = torch.randn(3, 8, dtype=torch.float64).to(device) if with_bias else None
    if backend != "loop":  # torch's grouped GEMM on CPU and the Triton kernels: float32
        x, w, b = x.float(), w.float(), (b.float() if b is not None else None)
    leaves = {"x": x, "w": w, "b": b}
    for name in trainable:
        leaves[name].requires_grad_()
    y = gl.grouped_linear(x, w, b, sizes, backend=backend)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    _, *want = reference_grads(x, w, b, sizes, grad_out)
    for (name, leaf), ref in zip(leaves.items(), want):
        if leaf is None:
            continue
        if name in trainable:
            assert rel_err(leaf.grad, ref) < 1e-5, name
        else:
            assert leaf.grad is None, name


@pytest.mark.parametrize("backend", ["loop", "triton"])
def test_no_input_features_still_sums_the_bias_gradient(backend):
    """``in_features = 0``: the output is the bias alone and its gradient each group's row
    count of ones (the weight gradient is empty)."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    x = torch.randn(5, 0, device=device, requires_grad=True)
    w = torch.randn(2, 3, 0, device=device, requires_grad=True)
    b = torch.randn(2, 3, device=device, requires_grad=True)
    y = gl.grouped_linear(x, w, b, [2, 3], backend=backend)
    assert torch.equal(y, b.detach().repeat_interleave(torch.tensor([2, 3], device=device), 0))
    y.sum().backward()
    assert b.grad.tolist() == [[2.0] * 3, [3.0] * 3]
    assert w.grad.shape == (2, 3, 0) and x.grad.shape == (5, 0)


def test_grouped_backend_rejects_unaligned_features():
    x, w = torch.randn(10, 5), torch.randn(2, 8, 5)
    with pytest.raises(ValueError, match="in_features=5, out_features=8"):
        gl.grouped_linear(x, w, None, [5, 5], backend="grouped")
    # the default picks a backend that takes them
    assert gl.grouped_linear(x, w, None, [5, 5]).shape == (10, 8)


@pytest.mark.parametrize("backend, tensor_splits", [("auto", True), ("loop", False),
                                                    ("grouped", False), ("grouped", True)])
def test_65536_groups_on_cpu(monkeypatch, backend, tensor_splits):
    """The most groups the layer is meant for, on every CPU backend that takes them (the
    Triton kernels take 4095 and say so), against a gathered float64 reference. The Triton
    interpreter is off: the bias kernels run their PyTorch references."""
    G, K, N = 65536, 8, 8
    sizes = [0] * G
    for g in range(3, G, 97):
        sizes[g] = 1 + g % 3
    sizes[-1] = 2
    M = sum(sizes)
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(G, N, K, requires_grad=True)
    b = torch.randn(G, N, requires_grad=True)
    with pytest.raises(ValueError, match=r"backend='triton' takes at most 4095 groups"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        gl.grouped_linear(x, w, b, sizes, backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    y = gl.grouped_linear(x, w, b, torch.tensor(sizes) if tensor_splits else sizes,
                          backend=backend)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    for got, want in zip((y, x.grad, w.grad, b.grad),
                         gathered_reference(x.detach(), w.detach(), b.detach(), sizes, grad_out)):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("backend", ["loop", "grouped", "triton"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_weight_stored_input_major_gets_its_gradient_in_its_own_layout(backend, with_bias):
    """``weight`` the transposed view of a ``(G, K, N)`` parameter (checkpoints that store
    experts input-major): the parameter's gradient is the float64 reference's, transposed,
    and arrives contiguous like the parameter."""
    sizes = SPLIT_CASES["random_with_zeros"]
    G, K, N = len(sizes), 24, 40
    dtype = torch.float32
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    stored = torch.randn(G, K, N, dtype=dtype, device=device, requires_grad=True)
    bias = torch.randn(G, N, dtype=dtype, device=device, requires_grad=True) \
        if with_bias else None
    x = torch.randn(sum(sizes), K, dtype=dtype, device=device, requires_grad=True)
    y = gl.grouped_linear(x, stored.transpose(1, 2), bias, sizes, backend=backend)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = reference_grads(x, stored.transpose(1, 2), bias, sizes, grad_out)
    assert stored.grad.is_contiguous() and stored.grad.shape == (G, K, N)
    assert rel_err(stored.grad.transpose(1, 2), ref[2]) < TOL[dtype]
    assert rel_err(y, ref[0]) < TOL[dtype] and rel_err(x.grad, ref[1]) < TOL[dtype]
    if with_bias:
        assert rel_err(bias.grad, ref[3]) < TOL[dtype]


@pytest.mark.parametrize("backend", ["loop", "grouped", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 7, 13])
def test_an_input_major_weight_with_a_column_major_input_of_any_row_count(backend, dtype, rows):
    """An input-major weight's gradient multiplies ``x^T`` (``(K, M)``): with ``x``
    column-major and ``M`` rows not a multiple of 16 bytes, torch's grouped GEMM takes it
    only as a copy whose rows are padded to 16 bytes; every gradient is the float64
    reference's."""
    sizes = [2, 0, rows - 2]
    G, K, N = len(sizes), 8, 16
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    stored = torch.randn(G, K, N, device=device).to(dtype).requires_grad_()
    x = torch.randn(K, rows, device=device).to(dtype).t().requires_grad_()
    assert x.stride() == (1, rows)
    y = gl.grouped_linear(x, stored.transpose(1, 2), None, sizes, backend=backend)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = reference_grads(x, stored.transpose(1, 2), None, sizes, grad_out)
    assert rel_err(stored.grad.transpose(1, 2), ref[2]) < TOL[dtype]
    assert rel_err(y, ref[0]) < TOL[dtype] and rel_err(x.grad, ref[1]) < TOL[dtype]


def test_a_weight_stored_input_major_compiles_whole():
    """``torch.compile(fullgraph=True)`` of a call on an input-major weight: the weight
    gradient operator's shape function gives the stored layout, and the compiled gradients
    equal eager's."""
    sizes = SPLIT_CASES["random_with_zeros"]
    G, K, N = len(sizes), 24, 40
    stored = torch.randn(G, K, N, requires_grad=True)
    bias = torch.randn(G, N, requires_grad=True)
    x = torch.randn(sum(sizes), K, requires_grad=True)

    def step(x, stored, bias):
        return gl.grouped_linear(x, stored.transpose(1, 2), bias, torch.tensor(sizes),
                                 backend="grouped")

    want = step(x, stored, bias)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (x, stored, bias), grad_out)
    ref = reference_grads(x, stored.transpose(1, 2), bias, sizes, grad_out)
    assert rel_err(want, ref[0]) < TOL[torch.float32]
    assert rel_err(want_grads[1].transpose(1, 2), ref[2]) < TOL[torch.float32]
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, stored, bias)
    got_grads = torch.autograd.grad(got, (x, stored, bias), grad_out)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
