"""``gl.grouped_mlp`` against a float64 per-group reference (CPU; the activation runs the
Triton kernel under the interpreter)."""

import weakref

import pytest
import torch

import grouped_linear as gl
from grouped_linear.ops.activation import bias_activation, check_activation
from tests.kernels.test_activation import CASES, GATED, f64
from tests.reference import HOLDS_ARGUMENTS, rel_err

G, H, F = 4, 8, 6
SIZES = [3, 0, 5, 0]


def _weights(kind, bias, dtype=torch.float32, transposed=False):
    """``w1 (G, 2F or F, H)``, ``b1``, ``w2 (G, H, F)``, ``b2`` as leaves; with ``transposed``,
    the weights are ``.transpose(1, 2)`` views of ``(G, H, 2F)`` / ``(G, F, H)`` leaves (the
    leaves returned last)."""
    width = 2 * F if kind in GATED else F
    store1 = (torch.randn(G, H, width) / H ** 0.5).to(dtype).requires_grad_()
    store2 = (torch.randn(G, F, H) / F ** 0.5).to(dtype).requires_grad_()
    b1 = torch.randn(G, width).to(dtype).requires_grad_() if bias else None
    b2 = torch.randn(G, H).to(dtype).requires_grad_() if bias else None
    if transposed:
        return store1.transpose(1, 2), b1, store2.transpose(1, 2), b2, (store1, store2)
    w1 = store1.detach().transpose(1, 2).contiguous().requires_grad_()
    w2 = store2.detach().transpose(1, 2).contiguous().requires_grad_()
    return w1, b1, w2, b2, (w1, w2)


def reference(x, w1, b1, w2, b2, sizes, kind, interleaved=False, probs=None,
              probs_on="activation", **params):
    """Float64, one group at a time, the activation from the formulas of the kernel tests;
    ``probs`` (``(M,)``) scale the rows of the activation's output or of the input."""
    outs, start = [], 0
    for g, size in enumerate(sizes):
        rows = x[start:start + size]
        p = probs[start:start + size].unsqueeze(1) if probs is not None else None
        if p is not None and probs_on == "input":
            rows = p * rows
        h = rows @ w1[g].t()
        if b1 is not None:
            h = h + b1[g]
        a = f64(kind, h, interleaved=interleaved, **params)
        if p is not None and probs_on == "activation":
            a = p * a
        y = a @ w2[g].t()
        outs.append(y + b2[g] if b2 is not None else y)
        start += size
    return torch.cat(outs)


def _f64_leaves(*tensors):
    return [t.detach().double().requires_grad_() if t is not None else None for t in tensors]


def _check(x, w1, b1, w2, b2, leaves, kind, interleaved, tol, sizes=SIZES, **params):
    order = "interleaved" if interleaved else "concatenated"
    y = gl.grouped_mlp(x, w1, b1, w2, b2, sizes, activation=kind, gate_up_order=order,
                       **params)
    refs = _f64_leaves(x, w1, b1, w2, b2)
    want = reference(*refs, sizes, kind, interleaved, **params)
    assert y.dtype == x.dtype and y.shape == want.shape and rel_err(y, want) < tol
    grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(grad.to(y.dtype))
    want.backward(grad)
    got_grads = [x.grad] + [p.grad for p in leaves] + [b.grad for b in (b1, b2) if b is not None]
    w1_ref, w2_ref = refs[1].grad, refs[3].grad
    if leaves[0] is not w1:  # transposed views: the gradient lands on their storage
        w1_ref, w2_ref = w1_ref.transpose(1, 2), w2_ref.transpose(1, 2)
    want_grads = [refs[0].grad, w1_ref, w2_ref] + [b.grad for b in (refs[2], refs[4])
                                                   if b is not None]
    for got, expect in zip(got_grads, want_grads, strict=True):
        assert got.shape == expect.shape and rel_err(got, expect) < tol


@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64_reference(kind, interleaved, bias):
    torch.manual_seed(0)
    w1, b1, w2, b2, leaves = _weights(kind, bias)
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    _check(x, w1, b1, w2, b2, leaves, kind, interleaved, 1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gpt_oss_parameters_and_transposed_weights(interleaved):
    """GPT-OSS's layout: weights as transposed views, interleaved gate/up, a limit that
    clamps many values; the gradients land on the views' storage."""
    torch.manual_seed(1)
    w1, b1, w2, b2, leaves = _weights("gpt_oss_swiglu", True, transposed=True)
    assert not w1.is_contiguous() and not w2.is_contiguous()
    x = (torch.randn(sum(SIZES), H) * 3).requires_grad_()
    _check(x, w1, b1, w2, b2, leaves, "gpt_oss_swiglu", interleaved, 1e-5, alpha=1.2,
           limit=0.5)


@pytest.mark.parametrize("sizes", [[0, 0, 0, 0], [8, 0, 0, 0], [0, 0, 0, 8]])
def test_empty_groups(sizes):
    torch.manual_seed(2)
    w1, b1, w2, b2, leaves = _weights("swiglu", True, dtype=torch.float64)
    x = torch.randn(sum(sizes), H, dtype=torch.float64, requires_grad=True)
    _check(x, w1, b1, w2, b2, leaves, "swiglu", False, 1e-12, sizes=sizes)


def test_list_input_and_bf16():
    torch.manual_seed(3)
    w1, b1, w2, b2, _ = _weights("geglu_erf", True, dtype=torch.bfloat16)
    pieces = [torch.randn(s, H, dtype=torch.bfloat16) for s in SIZES]
    y = gl.grouped_mlp(pieces, w1, b1, w2, b2, None, activation="geglu_erf")
    want = reference(*_f64_leaves(torch.cat(pieces), w1, b1, w2, b2), SIZES, "geglu_erf")
    assert y.dtype == torch.bfloat16 and rel_err(y, want) < 2e-2


def test_recipe_reaches_both_gemms():
    """With an FP8 recipe: the two FP8 GEMMs and the fused activation, composed by hand."""
    torch.manual_seed(4)
    w1, b1, w2, b2, _ = _weights("swiglu", True, dtype=torch.bfloat16)
    x = torch.randn(sum(SIZES), H, dtype=torch.bfloat16)
    recipe = gl.recipes.Float8Rowwise()
    y = gl.grouped_mlp(x, w1, b1, w2, b2, SIZES, recipe=recipe)
    ends = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    h = gl.grouped_linear(x, w1, None, SIZES, recipe=recipe)
    a = bias_activation(h, b1, ends, check_activation("swiglu"), False)
    torch.testing.assert_close(y, gl.grouped_linear(a, w2, b2, SIZES, recipe=recipe),
                               rtol=0, atol=0)
    assert not torch.equal(y, gl.grouped_mlp(x, w1, b1, w2, b2, SIZES))


def test_matches_transformers_gpt_oss_gate():
    """The interleaved gpt_oss_swiglu is transformers' GPT-OSS gate (its ``_apply_gate``)."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    experts = type("Experts", (), {"alpha": 1.702, "limit": 7.0})()
    gate_up = torch.randn(16, 2 * F, dtype=torch.float64) * 6
    want = modeling.GptOssExperts._apply_gate(experts, gate_up)
    ends = torch.tensor([16], dtype=torch.int32)
    act = check_activation("gpt_oss_swiglu", "interleaved")
    torch.testing.assert_close(bias_activation(gate_up, None, ends, act, False), want,
                               rtol=1e-12, atol=1e-12)


def test_compiles_fullgraph():
    torch._dynamo.reset()
    w1, b1, w2, b2, _ = _weights("gpt_oss_swiglu", True, dtype=torch.float64, transposed=True)
    x = torch.randn(sum(SIZES), H, dtype=torch.float64)

    def mlp(x, splits):
        return gl.grouped_mlp(x, w1, b1, w2, b2, splits, activation="gpt_oss_swiglu",
                              gate_up_order="interleaved", limit=1.0)

    got = torch.compile(mlp, fullgraph=True)(x, torch.tensor(SIZES))
    torch.testing.assert_close(got, mlp(x, SIZES), rtol=1e-12, atol=1e-12)


def _bad(**changes):
    w1, b1, w2, b2, _ = _weights("swiglu", True)
    args = {"x": torch.randn(sum(SIZES), H), "w1": w1, "b1": b1, "w2": w2, "b2": b2,
            "m_splits": SIZES} | changes
    return lambda **kw: gl.grouped_mlp(*args.values(), **kw)


@pytest.mark.parametrize("call, kwargs, error, match", [
    (_bad(w1=None), {}, TypeError, r"w1 must be"),
    (_bad(w1=torch.randn(G, 2 * F, H)[0]), {}, ValueError, r"w1 has shape \(12, 8\)"),
    (_bad(w1=torch.randn(G, F, H)), {}, ValueError, r"w1 has shape \(4, 6, 8\)"),
    (_bad(w2=torch.randn(G, H, F + 1)), {}, ValueError, r"w1 has shape .* F=7"),
    (_bad(w2=torch.randn(G + 1, H, F)), {}, ValueError, r"w2 has shape \(5, 8, 6\)"),
    (_bad(b1=torch.randn(G, F)), {}, ValueError, r"b1 has shape \(4, 6\)"),
    (_bad(b2=torch.randn(G, H, 1)), {}, ValueError, r"b2 has shape"),
    (_bad(b2=[0.0] * H), {}, TypeError, r"b2 must be"),
    (_bad(w2=torch.randn(G, H, F, dtype=torch.float64)), {}, TypeError,
     r"w2 has dtype torch.float64"),
    (_bad(b1=torch.zeros(G, 2 * F, dtype=torch.int32)), {}, TypeError, r"b1 has dtype"),
    (_bad(w1=torch.randn(G, 2 * F, H, device="meta")), {}, ValueError, r"w1 is on meta"),
    (_bad(x=torch.randn(sum(SIZES), H + 1)), {}, ValueError, r"x has 9 features"),
    (_bad(x=torch.ones(sum(SIZES), H, dtype=torch.int64)), {}, TypeError, r"x has dtype"),
    (_bad(m_splits=[1, 2]), {}, ValueError, r"m_splits"),
    (_bad(), {"activation": "tanh"}, ValueError, r"activation='tanh'"),
    (_bad(), {"gate_up_order": "paired"}, ValueError, r"gate_up_order='paired'"),
    (_bad(), {"alpha": 1.0}, ValueError, r"alpha=1.0 applies only"),
    (_bad(), {"backend": "loop"}, TypeError, r"'backend'"),
    (_bad(), {"recipe": "fp8"}, TypeError, r"recipe='fp8'"),
    (_bad(), {"probs": [0.5] * sum(SIZES)}, TypeError, r"probs must be a torch.Tensor"),
    (_bad(), {"probs": torch.ones(sum(SIZES), dtype=torch.int64)}, TypeError,
     r"probs has dtype torch.int64"),
    (_bad(), {"probs": torch.ones(sum(SIZES), dtype=torch.float8_e4m3fn)}, TypeError,
     r"probs has dtype torch.float8_e4m3fn"),
    (_bad(), {"probs": torch.ones(sum(SIZES), device="meta")}, ValueError,
     r"probs is on meta"),
    (_bad(), {"probs": torch.ones(sum(SIZES) + 1)}, ValueError, r"probs has shape \(9,\)"),
    (_bad(), {"probs": torch.ones(sum(SIZES), 1)}, ValueError, r"probs has shape \(8, 1\)"),
    (_bad(x=torch.randn(2, 4, H)), {"probs": torch.ones(4, 2)}, ValueError,
     r"probs has shape \(4, 2\).*\(8,\) or \(2, 4\)"),
    (_bad(), {"probs_on": "output"}, ValueError, r"probs_on='output'"),
    (_bad(), {"probs_on": None, "probs": torch.ones(sum(SIZES))}, ValueError, r"probs_on=None"),
    (_bad(x=torch.randn(2, 4, H + 1)), {}, ValueError, r"x has 9 features \(shape \(2, 4, 9\)\)"),
])
def test_rejects_bad_input(call, kwargs, error, match):
    with pytest.raises(error, match=match):
        call(**kwargs)


# --------------------------------------------------------------------------- routing probs
@pytest.mark.parametrize("probs_on", ["activation", "input"])
@pytest.mark.parametrize("kind, interleaved", CASES)
def test_probs_match_float64_reference(kind, interleaved, probs_on):
    """Both conventions against the unfused float64 computation (``x * p -> fc1 -> act ->
    fc2`` and ``act * p``), gradients of ``x``, ``probs``, weights and biases included."""
    torch.manual_seed(6)
    w1, b1, w2, b2, leaves = _weights(kind, True)
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    probs = torch.rand(sum(SIZES), requires_grad=True)
    order = "interleaved" if interleaved else "concatenated"
    y = gl.grouped_mlp(x, w1, b1, w2, b2, SIZES, activation=kind, gate_up_order=order,
                       probs=probs, probs_on=probs_on)
    refs = _f64_leaves(x, w1, b1, w2, b2, probs)
    want = reference(*refs[:5], SIZES, kind, interleaved, probs=refs[5], probs_on=probs_on)
    assert y.dtype == x.dtype and rel_err(y, want) < 1e-5
    grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(grad.float())
    want.backward(grad)
    got = [x.grad, *[p.grad for p in leaves], b1.grad, b2.grad, probs.grad]
    for name, g, w in zip(["x", "w1", "w2", "b1", "b2", "probs"], got,
                          [refs[i].grad for i in (0, 1, 3, 2, 4, 5)], strict=True):
        assert g.shape == w.shape and rel_err(g, w) < 1e-5, name
    # Scaling the activation or the input are different computations (fc1's bias unscaled).
    other = "input" if probs_on == "activation" else "activation"
    assert rel_err(want, reference(*refs[:5], SIZES, kind, interleaved, probs=refs[5],
                                   probs_on=other)) > 1e-3


@pytest.mark.parametrize("probs_on", ["activation", "input"])
def test_probs_gradcheck_float64(probs_on):
    torch.manual_seed(7)
    w1, b1, w2, b2, _ = _weights("swiglu", True, dtype=torch.float64)
    x = torch.randn(sum(SIZES), H, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(sum(SIZES), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, p, w1, b1: gl.grouped_mlp(x, w1, b1, w2, b2, SIZES, probs=p,
                                            probs_on=probs_on), (x, probs, w1, b1))


@pytest.mark.parametrize("probs_on", ["activation", "input"])
@pytest.mark.parametrize("probs_shape", ["flat", "leading"])
def test_nd_input_is_the_flattened_call(probs_on, probs_shape):
    """``(2, 4, H)`` rows equal the ``(8, H)`` call, probs given flat or in the leading
    shape; the gradients come back in the callers' shapes."""
    torch.manual_seed(8)
    w1, b1, w2, b2, _ = _weights("geglu", True)
    x = torch.randn(2, 4, H, requires_grad=True)
    probs = torch.rand(2, 4, requires_grad=True)
    x_flat = x.detach().reshape(8, H).requires_grad_()
    probs_flat = probs.detach().reshape(8).requires_grad_()
    given = probs if probs_shape == "leading" else probs.reshape(8)
    y = gl.grouped_mlp(x, w1, b1, w2, b2, SIZES, activation="geglu", probs=given,
                       probs_on=probs_on)
    want = gl.grouped_mlp(x_flat, w1, b1, w2, b2, SIZES, activation="geglu", probs=probs_flat,
                          probs_on=probs_on)
    assert y.shape == (2, 4, H)
    torch.testing.assert_close(y.reshape(8, H), want, rtol=0, atol=0)
    grad = torch.randn(8, H)
    y.backward(grad.reshape(2, 4, H))
    want.backward(grad)
    assert x.grad.shape == x.shape and probs.grad.shape == probs.shape
    torch.testing.assert_close(x.grad.reshape(8, H), x_flat.grad, rtol=0, atol=0)
    torch.testing.assert_close(probs.grad.reshape(8), probs_flat.grad, rtol=0, atol=0)
    plain = gl.grouped_mlp(x.detach().reshape(8, 1, H), w1, b1, w2, b2, SIZES,
                           activation="geglu")
    assert plain.shape == (8, 1, H)
    torch.testing.assert_close(plain.reshape(8, H), gl.grouped_mlp(
        x_flat.detach(), w1, b1, w2, b2, SIZES, activation="geglu"), rtol=0, atol=0)


def test_probs_list_input_bf16_and_compile():
    """A list input takes probs over its concatenated rows; bf16 rows with float32 probs;
    ``torch.compile`` (fullgraph) gives eager's output and probability gradient."""
    torch.manual_seed(9)
    w1, b1, w2, b2, _ = _weights("swiglu", True, dtype=torch.bfloat16)
    pieces = [torch.randn(s, H, dtype=torch.bfloat16) for s in SIZES]
    probs = torch.rand(sum(SIZES))
    y = gl.grouped_mlp(pieces, w1, b1, w2, b2, None, probs=probs)
    refs = _f64_leaves(torch.cat(pieces), w1, b1, w2, b2, probs)
    want = reference(*refs[:5], SIZES, "swiglu", probs=refs[5])
    assert y.dtype == torch.bfloat16 and rel_err(y, want) < 2e-2
    torch._dynamo.reset()
    x = torch.cat(pieces).float()
    w1, b1, w2, b2 = (t.detach().float() for t in (w1, b1, w2, b2))

    def mlp(x, p, splits):
        return gl.grouped_mlp(x, w1, b1, w2, b2, splits, probs=p)

    eager_p = probs.clone().requires_grad_()
    compiled_p = probs.clone().requires_grad_()
    eager = mlp(x, eager_p, SIZES)
    compiled = torch.compile(mlp, fullgraph=True)(x, compiled_p, torch.tensor(SIZES))
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    eager.sum().backward()
    compiled.sum().backward()
    torch.testing.assert_close(compiled_p.grad, eager_p.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True])
def test_the_input_is_freed_once_fc1_has_read_it(monkeypatch, grad):
    """Handed over with no other reference, ``x`` is gone before fc2 runs when nothing keeps
    it for backward (inference); fc1's weight gradient keeps it in training."""
    import grouped_linear.ops.mlp as mlp_ops

    w1, b1, w2, b2, _ = _weights("swiglu", True)
    x = torch.randn(sum(SIZES), H)
    alive = weakref.ref(x)
    seen = []
    real = mlp_ops.apply_grouped_linear

    def spy(rows, *args, **kwargs):
        seen.append(alive() is not None)
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(mlp_ops, "apply_grouped_linear", spy)
    want = reference(x.double(), *_f64_leaves(w1, b1, w2, b2), SIZES, "swiglu")
    held = [x]
    del x
    with torch.set_grad_enabled(grad):
        y = gl.grouped_mlp(held.pop(), w1, b1, w2, b2, SIZES)
    assert seen == [True, grad or HOLDS_ARGUMENTS]
    assert rel_err(y, want) < 1e-5
