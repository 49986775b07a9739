"""The fused bias + activation kernels (CUDA, or the Triton interpreter) and their PyTorch
reference against float64 formulas written out here."""

import math

import pytest
import torch

from grouped_linear.kernels import activation as act
from grouped_linear.kernels._triton import HAS_TRITON, use_triton
from tests.reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GATED = ["swiglu", "geglu", "geglu_erf", "gpt_oss_swiglu", "clamped_swiglu"]
PLAIN = ["gelu", "gelu_erf", "relu", "silu", "relu2"]
CLAMPED = ["gpt_oss_swiglu", "clamped_swiglu"]
# (kind, interleaved): every gated kind in both layouts, the others in theirs
CASES = [(k, False) for k in GATED + PLAIN] + [(k, True) for k in GATED]
SIZES = (5, 0, 40, 3)


def f64(kind: str, value: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
        interleaved: bool = False) -> torch.Tensor:
    """The activation of ``value`` (``(rows, W)``, bias added), float64 formulas."""
    def silu(v):
        return v / (1 + torch.exp(-v))

    def gelu_tanh(v):
        return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))

    def gelu_erf(v):
        return 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))

    base = {"swiglu": silu, "silu": silu, "geglu": gelu_tanh, "gelu": gelu_tanh,
            "geglu_erf": gelu_erf, "gelu_erf": gelu_erf,
            "relu": lambda v: v * (v > 0),  # gradient 0 at 0, as F.relu
            "relu2": lambda v: (v * (v > 0)) ** 2}
    if kind not in GATED:
        return base[kind](value)
    width = value.shape[1] // 2
    if interleaved:
        gate, up = value[:, 0::2], value[:, 1::2]
    else:
        gate, up = value[:, :width], value[:, width:]
    if kind == "gpt_oss_swiglu":
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * g / (1 + torch.exp(-alpha * g))
    if kind == "clamped_swiglu":
        return silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return base[kind](gate) * up


def grouped_f64(kind, h, bias, sizes, interleaved=False, alpha=1.702, limit=7.0):
    """Per group ``f64(h_g + bias_g)``; rows past the groups zero."""
    outs, start = [], 0
    for g, size in enumerate(sizes):
        value = h[start:start + size] + (bias[g] if bias is not None else 0)
        outs.append(f64(kind, value, alpha, limit, interleaved))
        start += size
    width = h.shape[1] // 2 if kind in GATED else h.shape[1]
    return torch.cat(outs + [h.new_zeros(h.shape[0] - start, width)])


def _case(kind, dtype, with_bias, sizes=SIZES, tail=6, F=24):
    G, M = len(sizes), sum(sizes) + tail
    width = 2 * F if kind in GATED else F
    h = (torch.randn(M, width, device=DEVICE) * 3).to(dtype)
    bias = torch.randn(G, width, device=DEVICE).to(dtype) if with_bias else None
    ends = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    return h, bias, ends, sum(sizes)


def _want(kind, h, bias, interleaved, grad_a, sizes=SIZES, **params):
    """Float64 output and gradients (of h and bias) of :func:`grouped_f64`."""
    h64 = h.detach().double().cpu().requires_grad_()
    b64 = bias.detach().double().cpu().requires_grad_() if bias is not None else None
    out = grouped_f64(kind, h64, b64, sizes, interleaved, **params)
    grads = torch.autograd.grad(out, [h64] + ([b64] if b64 is not None else []),
                                grad_a.double().cpu())
    return out.detach(), grads[0]


def test_kinds_cover_every_name():
    assert set(act.ACTIVATION_KINDS) == set(GATED + PLAIN)
    assert set(act.GATED_KINDS) == set(GATED)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_matches_float64(kind, interleaved, dtype, with_bias):
    h, bias, ends, head = _case(kind, dtype, with_bias)
    assert use_triton(h)
    out = act.bias_act_forward(h, bias, ends, kind, True, interleaved)
    grad_a = torch.randn(out.shape, device=DEVICE).to(dtype)
    want, want_grad = _want(kind, h, bias, interleaved, grad_a)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and out.shape == want.shape and rel_err(out, want) < tol
    assert torch.all(out[head:] == 0)
    grad_h, _ = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved)
    assert grad_h.dtype == dtype and rel_err(grad_h, want_grad) < tol
    assert torch.all(grad_h[head:] == 0)


@pytest.mark.parametrize("kind, interleaved", CASES)
def test_reference_matches_float64(kind, interleaved):
    h, bias, ends, head = _case(kind, torch.float64, True)
    grad_a = torch.randn(h.shape[0], h.shape[1] // (2 if kind in GATED else 1),
                         dtype=torch.float64, device=DEVICE)
    want, want_grad = _want(kind, h, bias, interleaved, grad_a)
    out = act.bias_act_forward(h, bias, ends, kind, True, interleaved)  # float64: reference
    assert rel_err(out, want) < 1e-12
    got, _ = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved)
    assert rel_err(got, want_grad) < 1e-12 and torch.all(got[head:] == 0)


def _boundary_input(limit: float, interleaved: bool, dtype: torch.dtype) -> torch.Tensor:
    """Gate and up values at, just inside, just past and far past ``±limit`` (each gate
    value against each up value)."""
    step = 2 ** -6
    values = torch.tensor([limit, -limit, limit - step, limit + step, -limit - step,
                           -limit + step, 4 * limit, -4 * limit, 0.0, 1.0], dtype=torch.float64)
    gate = values.repeat_interleave(len(values))
    up = values.repeat(len(values))
    h = torch.stack((gate, up), dim=-1) if interleaved else torch.stack((gate, up))
    return h.reshape(1, -1).to(dtype).to(DEVICE)  # one row, F = 100


@pytest.mark.parametrize("kind", CLAMPED)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (0.5, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_clamp_boundaries(kind, interleaved, alpha, limit, dtype):
    """Values exactly at ``±limit`` pass their gradient (as torch's clamp); past it the
    gradient is zero; far past it the output is the clamped one. float64 runs the reference,
    the others the Triton kernel where it can run."""
    h = _boundary_input(limit, interleaved, dtype)
    ends = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    params = {"alpha": alpha, "limit": limit}
    out = act.bias_act_forward(h, None, ends, kind, True, interleaved, **params)
    grad_a = torch.ones_like(out)
    grad_h, _ = act.bias_act_backward(grad_a, h, None, ends, kind, True, interleaved, **params)
    want, want_grad = _want(kind, h, None, interleaved, grad_a, sizes=(1,), **params)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(out, want) < tol and rel_err(grad_h, want_grad) < tol
    h64 = h.double().cpu().reshape(-1, 2) if interleaved else h.double().cpu().reshape(2, -1).t()
    gate, up = h64[:, 0], h64[:, 1]
    grads = grad_h.double().cpu()
    grads = grads.reshape(-1, 2) if interleaved else grads.reshape(2, -1).t()
    assert torch.all(grads[gate > limit, 0] == 0) and torch.all(grads[up.abs() > limit, 1] == 0)
    at_limit = (gate == limit) & (up.abs() < limit) & (up != 0)  # clamped_swiglu: u * silu'(g)
    assert at_limit.any() and torch.all(grads[at_limit, 0] != 0)
    up_at_limit = (up.abs() == limit) & (gate.abs() < limit) & (gate != 0)
    assert up_at_limit.any() and torch.all(grads[up_at_limit, 1] != 0)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("kind", GATED)
def test_interleaved_is_the_concatenated_layout_permuted(kind):
    """The same gate and up values in the two layouts give the same output, and gradients in
    each layout's own column order."""
    h, bias, ends, _ = _case(kind, torch.float32, True)
    F = h.shape[1] // 2
    order = torch.stack((torch.arange(F), torch.arange(F) + F), dim=-1).flatten().to(DEVICE)
    h_int, bias_int = h[:, order].contiguous(), bias[:, order].contiguous()
    out = act.bias_act_forward(h, bias, ends, kind, True, False)
    out_int = act.bias_act_forward(h_int, bias_int, ends, kind, True, True)
    torch.testing.assert_close(out_int, out, rtol=1e-6, atol=1e-6)
    grad_a = torch.randn_like(out)
    grad_h, _ = act.bias_act_backward(grad_a, h, bias, ends, kind, True, False)
    grad_int, _ = act.bias_act_backward(grad_a, h_int, bias_int, ends, kind, True, True)
    torch.testing.assert_close(grad_int, grad_h[:, order], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- routing probs
def _want_probs(kind, h, bias, probs, interleaved, grad_a, sizes=SIZES):
    """Float64 ``probs[:, None] * grouped_f64(...)`` and its gradients of ``h`` and ``probs``."""
    h64 = h.detach().double().cpu().requires_grad_()
    p64 = probs.detach().double().cpu().requires_grad_()
    b64 = bias.detach().double().cpu() if bias is not None else None
    out = p64.unsqueeze(1) * grouped_f64(kind, h64, b64, sizes, interleaved)
    grad_h, grad_p = torch.autograd.grad(out, [h64, p64], grad_a.double().cpu())
    return out.detach(), grad_h, grad_p


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("dtype, probs_dtype", [(torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
def test_triton_probs_match_float64_and_reference(kind, interleaved, dtype, probs_dtype):
    """The kernel with a probability per row (F = 200: four column programs, one partly
    masked) against the float64 formulas and the PyTorch reference; rows past the groups
    get zero, their probability gradient too."""
    h, bias, ends, head = _case(kind, dtype, True, F=200)
    probs = torch.rand(h.shape[0], device=DEVICE).to(probs_dtype)
    assert use_triton(h)
    out = act.bias_act_forward(h, bias, ends, kind, True, interleaved, probs=probs)
    grad_a = torch.randn(out.shape, device=DEVICE).to(dtype)
    grad_h, grad_p = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved,
                                           probs=probs, probs_grad=True)
    want, want_h, want_p = _want_probs(kind, h, bias, probs, interleaved, grad_a)
    tol = 1e-5 if dtype == torch.float32 and probs_dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and rel_err(out, want) < tol and torch.all(out[head:] == 0)
    assert grad_h.dtype == dtype and rel_err(grad_h, want_h) < tol
    assert grad_p.dtype == probs_dtype and grad_p.shape == probs.shape
    assert rel_err(grad_p, want_p) < tol and torch.all(grad_p[head:] == 0)
    ref = act.bias_act_reference(h, bias, ends, kind, True, interleaved, probs=probs)
    ref_h, ref_p = act.bias_act_backward_reference(grad_a, h, bias, ends, kind, interleaved,
                                                   probs=probs, probs_grad=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol and rel_err(grad_h, ref_h) < tol
    assert rel_err(grad_p, ref_p) < tol
    # Without probs_grad the same gradient of h, and no probability gradient.
    again, none = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved,
                                        probs=probs)
    assert none is None and torch.equal(again, grad_h)


@pytest.mark.parametrize("kind, interleaved", CASES)
def test_reference_probs_match_float64(kind, interleaved):
    h, bias, ends, _ = _case(kind, torch.float64, True)
    probs = torch.rand(h.shape[0], dtype=torch.float64, device=DEVICE)
    grad_a = torch.randn(h.shape[0], h.shape[1] // (2 if kind in GATED else 1),
                         dtype=torch.float64, device=DEVICE)
    want, want_h, want_p = _want_probs(kind, h, bias, probs, interleaved, grad_a)
    out = act.bias_act_forward(h, bias, ends, kind, True, interleaved, probs=probs)
    grad_h, grad_p = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved,
                                           probs=probs, probs_grad=True)
    assert rel_err(out, want) < 1e-12 and rel_err(grad_h, want_h) < 1e-12
    assert rel_err(grad_p, want_p) < 1e-12


@pytest.mark.parametrize("kind, interleaved", CASES)
def test_probs_gradcheck_float64(kind, interleaved):
    """The written-out backward (h, bias and probs), rows past the groups included."""
    from grouped_linear.ops.activation import bias_activation, check_activation

    torch.manual_seed(5)
    params = {"gpt_oss_swiglu": {"alpha": 0.8, "limit": 1.5},
              "clamped_swiglu": {"limit": 1.5}}.get(kind, {})
    activation = check_activation(kind, "interleaved" if interleaved else "concatenated",
                                  params)
    sizes = (2, 0, 3)
    h, bias, ends, _ = _case(kind, torch.float64, True, sizes=sizes, tail=2, F=3)
    with torch.no_grad():  # away from the kinks (finite differences straddle them)
        rows = torch.tensor([0, 0, 2, 2, 2], device=DEVICE)
        for kink in {"relu": (0.0,), "relu2": (0.0,), "gpt_oss_swiglu": (-1.5, 1.5),
                     "clamped_swiglu": (-1.5, 1.5)}.get(kind, ()):
            h[:5] += ((h[:5] + bias[rows] - kink).abs() < 0.1) * 0.3
    probs = torch.rand(h.shape[0], dtype=torch.float64, device=DEVICE)
    inputs = tuple(t.requires_grad_() for t in (h, bias, probs))
    assert torch.autograd.gradcheck(
        lambda h, b, p: bias_activation(h, b, ends, activation, True, probs=p), inputs)


@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reference_backward_without_bias_with_probs(kind, interleaved, dtype):
    """The backward of the plain-PyTorch form where every row is in a group and there is no
    bias (the CPU path that converts only the gate): the gradients of ``h`` and ``probs``
    against the float64 formulas, exact in float64, within bf16 rounding in bf16."""
    h, _, ends, _ = _case(kind, dtype, False, tail=0)
    h, ends = h.cpu(), ends.cpu()
    probs = torch.rand(h.shape[0], dtype=torch.float64).to(dtype)
    grad_a = torch.randn(h.shape[0], h.shape[1] // (2 if kind in GATED else 1),
                         dtype=torch.float64).to(dtype)
    _, want_h, want_p = _want_probs(kind, h, None, probs, interleaved, grad_a)
    got_h, got_p = act.bias_act_backward_reference(grad_a, h, None, ends, kind, interleaved,
                                                   probs=probs, probs_grad=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    assert got_h.dtype == dtype and got_p.dtype == dtype
    assert rel_err(got_h, want_h) < tol and rel_err(got_p, want_p) < tol


@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("tail", [0, 6])
def test_reference_without_bias_with_and_without_tail(kind, interleaved, tail):
    """The plain-PyTorch forms without a bias (the CPU path of every float32 call), whether
    the groups cover every row or rows follow them: the float64 formulas and their autograd
    gradient, zero past the groups."""
    h, _, ends, head = _case(kind, torch.float64, False, tail=tail)
    h = h.cpu().requires_grad_()
    ends = ends.cpu()
    out = act.bias_act_reference(h.detach(), None, ends, kind, True, interleaved)
    want = grouped_f64(kind, h, None, SIZES, interleaved)
    grad_a = torch.randn(want.shape, dtype=torch.float64)
    want_h, = torch.autograd.grad(want, h, grad_a)
    got_h, _ = act.bias_act_backward_reference(grad_a, h.detach(), None, ends, kind,
                                               interleaved)
    assert rel_err(out, want) < 1e-12 and rel_err(got_h, want_h) < 1e-12
    assert torch.all(out[head:] == 0) and torch.all(got_h[head:] == 0)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("kind, interleaved", CASES)
@pytest.mark.parametrize("fp8, pow2, with_probs", [(torch.float8_e4m3fn, False, False),
                                                   (torch.float8_e4m3fn, True, True),
                                                   (torch.float8_e5m2, False, True)])
def test_fp8_output_is_the_output_quantized_per_row(kind, interleaved, fp8, pow2, with_probs):
    """The kernel writing the activation as FP8 rows (F = 300: three column blocks, one
    partly masked; rows past the groups: zero codes, factor 1) gives the codes and factors
    of quantizing the plain kernel's output (torch's reference), bit for bit."""
    from grouped_linear.kernels.quantize.rows import quantize_rows_reference

    h, bias, ends, head = _case(kind, torch.bfloat16, True, F=300)
    probs = torch.rand(h.shape[0], device=DEVICE) if with_probs else None
    assert use_triton(h)
    codes, inv = act.bias_act_forward_fp8(h, bias, ends, kind, fp8, pow2, interleaved,
                                          probs=probs)
    out = act.bias_act_forward(h, bias, ends, kind, True, interleaved, probs=probs)
    want_codes, want_inv = quantize_rows_reference(out, fp8, pow2)
    assert codes.dtype == fp8 and codes.shape == out.shape and inv.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(inv, want_inv)
    assert torch.all(codes[head:].view(torch.uint8) == 0) and torch.all(inv[head:] == 1)
    # no rows: the reference's empty result
    codes, inv = act.bias_act_forward_fp8(h[:0], bias, ends * 0, kind, fp8, pow2, interleaved)
    assert codes.shape == (0, out.shape[1]) and inv.shape == (0,)


@pytest.mark.parametrize("kind, interleaved", CASES)
def test_reference_is_differentiable_as_written(kind, interleaved):
    """The plain-PyTorch form, with a bias, row probabilities and rows past the groups, under
    autograd in float64: gradcheck (its in-place steps must not touch what autograd keeps)."""
    gen = torch.Generator().manual_seed(len(kind) + interleaved)
    width = 24 if kind in GATED else 12
    h = torch.randn(40, width, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, width, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(40, generator=gen, dtype=torch.float64, requires_grad=True)
    params = {"alpha": 0.8, "limit": 1.0} if kind in CLAMPED else {}  # clamps reached
    if kind == "clamped_swiglu":
        params.pop("alpha")
    # rows 30 to 39 in no group, or every row in one (without a bias: the gate-only form)
    for last, with_bias in ((30, False), (30, True), (40, False)):
        ends = torch.tensor([10, 20, last], dtype=torch.int32)

        def f(h, probs, *bias_or_none, ends=ends):
            return act.bias_act_reference(h, bias_or_none[0] if bias_or_none else None, ends,
                                          kind, True, interleaved, probs=probs, **params)
        inputs = (h, probs, bias) if with_bias else (h, probs)
        assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("kind,interleaved", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_row_blocks_give_the_whole_reference(monkeypatch, kind, interleaved, dtype):
    """The CPU route's blocks of rows (here of 64, with groups across their edges, an empty
    group, rows past the groups, bias and probabilities) give the one-pass reference's output
    and gradients (bit for bit with a bias)."""
    sizes = (50, 80, 0, 1, 120)
    h, bias, ends, _ = _case(kind, dtype, True, sizes=sizes, tail=30, F=8)
    h, bias, ends = h.cpu(), bias.cpu(), ends.cpu()
    probs = torch.rand(h.shape[0])
    grad_a = torch.randn(h.shape[0], h.shape[1] // 2 if kind in GATED else h.shape[1]).to(dtype)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU route, not the interpreted kernel
    monkeypatch.setattr(act, "CPU_BLOCK_BYTES", 1)  # the least rows a block takes: 64
    assert len(act._cpu_blocks(h)) == 5
    for zero_tail in (True, False):
        got = act.bias_act_forward(h, bias, ends, kind, zero_tail, interleaved, probs=probs)
        want = act.bias_act_reference(h, bias, ends, kind, zero_tail, interleaved, probs=probs)
        assert torch.equal(got, want)
    got_h, got_p = act.bias_act_backward(grad_a, h, bias, ends, kind, True, interleaved,
                                         probs=probs, probs_grad=True)
    want_h, want_p = act.bias_act_backward_reference(grad_a, h, bias, ends, kind, interleaved,
                                                     probs=probs, probs_grad=True)
    assert torch.equal(got_h, want_h) and torch.equal(got_p, want_p)
    # without a bias, blocks inside the groups convert only the gate (contiguous, where the
    # whole one computes on half views): the same float32 formulas, a rounding apart
    got_h, none = act.bias_act_backward(grad_a, h, None, ends, kind, True, interleaved)
    assert none is None
    want_h = act.bias_act_backward_reference(grad_a, h, None, ends, kind, interleaved)[0]
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got_h, want_h, rtol=eps, atol=eps * want_h.abs().max().item())
