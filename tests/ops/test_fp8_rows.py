"""Rows in ``Float8Rowwise`` codes: permuted so (``permute(..., recipe=...)``, each token's
codes in its rows) or written so by the MLP's activation for fc2, read as they are by the
rowwise GEMM route, the dequantized values for anything else. On CPU the route's Triton
kernels run under the interpreter and torch's FP8 grouped GEMM (sm90 only) as its
dequantized reference."""

import importlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear import _tuning
from grouped_linear.kernels.gemm import fp8_torch_gemm
from grouped_linear.kernels.quantize.rows import quantize_rows_reference
from grouped_linear.ops.fp8 import Float8Rows, plain_rows, scaled_mm
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import rel_err

ops_linear = importlib.import_module("grouped_linear.ops.grouped_linear")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, F, TOKENS, K = 4, 128, 64, 48, 2
ROWWISE = Float8Rowwise()


def _tokens(seed: int = 0):
    """bf16 tokens (one all zero), their routing (expert 2 never chosen, dropped slots)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, H, generator=gen) * torch.rand(TOKENS, 1, generator=gen) * 4
    x[3] = 0
    choices = torch.tensor([0, 1, 3])
    index = choices[torch.stack([torch.randperm(3, generator=gen)[:K] for _ in range(TOKENS)])]
    index[::5, 1] = -1
    probs = torch.rand(TOKENS, K, generator=gen).softmax(-1)
    return (x.to(DEVICE, torch.bfloat16).requires_grad_(), index.to(DEVICE),
            probs.to(DEVICE).requires_grad_())


def test_writes_into_fp8_rows_are_refused_and_change_nothing():
    """In-place ops and ``out=`` into FP8 rows raise (their codes are not values to write);
    the codes and factors stay as they were; reads, views included, give dequantized copies."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, H, generator=gen)
    codes = values.to(torch.float8_e4m3fn)
    rows = Float8Rows(codes.clone(), torch.rand(6, generator=gen), ROWWISE, torch.bfloat16)
    inv = rows.inv.clone()
    for write in (lambda: rows.mul_(2), lambda: rows.zero_(),
                  lambda: torch.add(values.bfloat16(), 1, out=rows)):
        with pytest.raises(TypeError, match="writes into Float8Rows"):
            write()
    assert torch.equal(rows.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(rows.inv, inv)
    top = rows[:2]
    assert type(top) is torch.Tensor and torch.equal(top, rows.dequantize()[:2])


@pytest.fixture
def rowwise_route(monkeypatch):
    """Every rowwise call on the ``fp8_scaled_mm`` route (so ``permute`` writes FP8 rows on
    any device); on CPU torch's FP8 grouped GEMM as its float32 reference of the dequantized
    operands. Counts the route's token quantizations."""
    choose = ops_linear.choose_route

    def route(backend, recipe, *args):
        return ("fp8_scaled_mm" if isinstance(recipe, Float8Rowwise)
                else choose(backend, recipe, *args))

    monkeypatch.setattr(ops_linear, "choose_route", route)
    if DEVICE == "cpu":
        def gemm(a, a_inv, b, b_inv, ends, out_dtype):
            return fp8_torch_gemm.dequantized_reference(a, a_inv, b, b_inv, ends).to(out_dtype)

        monkeypatch.setattr(fp8_torch_gemm, "forward", gemm)
        monkeypatch.setattr(fp8_torch_gemm, "dgrad", gemm)
    calls = []
    quantize = scaled_mm._quantize_tokens

    def counting(t, *args):
        calls.append(t.shape)
        return quantize(t, *args)

    monkeypatch.setattr(scaled_mm, "_quantize_tokens", counting)
    return calls


@pytest.mark.parametrize("multiple", [1, 4])
@pytest.mark.parametrize("recipe", [ROWWISE, Float8Rowwise(power_of_two_scales=True)], ids=repr)
def test_permute_writes_each_tokens_codes_into_its_rows(multiple, recipe, rowwise_route):
    """The codes and factors of every row are those of quantizing the plain permuted row
    (torch's reference), padding and unheld rows included (zero codes, unit factor); the
    gradient of ``x`` is the plain permutation's."""
    x, index, _ = _tokens()
    rows, m_splits, row_map = gl.permute(x, index, E, multiple, recipe=recipe)
    plain, plain_splits, plain_map = gl.permute(x, index, E, multiple)
    assert isinstance(rows, Float8Rows)
    assert rows.shape == plain.shape and rows.dtype == torch.bfloat16 and rows.requires_grad
    assert torch.equal(m_splits, plain_splits) and torch.equal(row_map, plain_map)
    codes, inv = quantize_rows_reference(plain.detach(), recipe.forward_dtype,
                                         recipe.power_of_two_scales)
    assert torch.equal(rows.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(rows.inv, inv)
    # within half an E4M3 step (2**-4 relative) of the row's values
    err = (rows.dequantize().float() - plain.detach().float()).abs()
    assert torch.all(err <= plain.detach().float().abs() * 2 ** -4 + 1e-30)
    grad = torch.randn(plain.shape, device=DEVICE).bfloat16()
    got, = torch.autograd.grad(plain_rows(rows), x, grad)
    want, = torch.autograd.grad(plain, x, grad)
    assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", [None, Float8Tensorwise(), Float8Blockwise()], ids=repr)
def test_other_recipes_permute_plain_rows(recipe):
    """Recipes that scale by groups of rows leave the rows plain (scales known only after
    permuting), equal to the permutation without a recipe."""
    x, index, _ = _tokens()
    rows, _, _ = gl.permute(x, index, E, recipe=recipe)
    plain, _, _ = gl.permute(x, index, E)
    assert type(rows) is torch.Tensor and torch.equal(rows, plain)


def test_rows_stay_plain_where_the_layer_takes_another_route():
    """Where the experts' calls would not take the FP8 GEMM route (CPU: the emulation; CUDA:
    calls within the fused route's size), permuting in FP8 would only add passes: the rows
    stay plain."""
    x, index, _ = _tokens()
    with _tuning.override(fp8_fused_max_work=2 ** 62):
        rows, _, _ = gl.permute(x, index, E, recipe=ROWWISE)
    plain, _, _ = gl.permute(x, index, E)
    assert type(rows) is torch.Tensor and torch.equal(rows, plain)


def test_a_recipe_that_is_not_one_is_refused():
    x, index, _ = _tokens()
    with pytest.raises(TypeError, match="recipe='rowwise' is not a known recipe"):
        gl.permute(x, index, E, recipe="rowwise")


def test_any_other_use_sees_the_dequantized_values(rowwise_route):
    """Arithmetic, and a layer without the recipe (or of another), read the values the codes
    stand for; gradients reach ``x`` through them."""
    x, index, _ = _tokens()
    rows, m_splits, _ = gl.permute(x, index, E, recipe=ROWWISE)
    values = rows.dequantize()
    assert torch.equal(rows * 2, values * 2)
    torch.manual_seed(0)
    weight = (torch.randn(E, F, H, device=DEVICE) * H ** -0.5).bfloat16()
    for recipe in (None, Float8Tensorwise()):
        got = gl.grouped_linear(rows, weight, None, m_splits, recipe=recipe)
        want = gl.grouped_linear(values, weight, None, m_splits, recipe=recipe)
        assert torch.equal(got, want)
    # the bf16 layer's input gradient does not depend on the values: equal to the plain
    # rows' one
    x.grad = None
    gl.grouped_linear(rows, weight, None, m_splits).float().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    plain, _, _ = gl.permute(x2, index, E)
    gl.grouped_linear(plain, weight, None, m_splits).float().sum().backward()
    assert torch.equal(x.grad, x2.grad) and x.grad.abs().sum() > 0


def _block(mlp, x, index, probs, grad, fp8_rows: bool):
    with gl.autocast(ROWWISE):
        rows, m_splits, row_map = gl.permute(x, index, E, recipe=ROWWISE if fp8_rows else None)
        out = gl.unpermute(mlp(rows, m_splits), row_map, probs)
    out.backward(grad)
    return [out, x.grad, probs.grad, *(p.grad for p in mlp.parameters())]


@pytest.mark.parametrize("permuted, activated", [(True, True), (True, False), (False, True)],
                         ids=["both", "permute", "activation"])
def test_the_rowwise_route_reads_the_codes_as_they_are(rowwise_route, monkeypatch, permuted,
                                                       activated):
    """The block whose fc1 input (rows permuted as codes) or fc2 input (the activation's
    output quantized by its kernel) arrive in FP8 equals, bit for bit, the block whose layers
    quantize bf16 inputs themselves (output, gradients of x, probs and weights), and the
    layer given codes quantizes nothing; both within FP8's error of float64."""
    torch.manual_seed(0)
    mlp = gl.GroupedMLP(E, H, F, bias=True, params_dtype=torch.bfloat16, device=DEVICE)
    grad = torch.randn(TOKENS, H, device=DEVICE).bfloat16()
    fused = gl.GroupedLinear.reads_fp8_rows
    results, quantized = [], []
    for fp8_rows, fp8_act in ((permuted, activated), (False, False)):
        monkeypatch.setattr(gl.GroupedLinear, "reads_fp8_rows",
                            fused if fp8_act else lambda *args: None)
        x, index, probs = _tokens()
        mlp.zero_grad(set_to_none=True)
        rowwise_route.clear()
        results.append(_block(mlp, x, index, probs, grad, fp8_rows))
        quantized.append(sorted(shape[1] for shape in rowwise_route))
    assert quantized == [sorted([H] * (not permuted) + [F] * (not activated)), [F, H]]
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    x, index, probs = _tokens()
    out64 = torch.zeros(TOKENS, H, dtype=torch.float64)
    w1, b1, w2, b2 = (p.detach().double().cpu() for p in mlp.parameters())
    x64 = x.detach().double().cpu()
    for e in range(E):
        token, slot = (index.cpu() == e).nonzero(as_tuple=True)
        gate, up = (x64[token] @ w1[e].T + b1[e]).chunk(2, dim=1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T + b2[e]
        out64 = out64.index_add(0, token, probs.detach().double().cpu()[token, slot, None] * y)
    assert rel_err(results[0][0], out64) < 7e-2


def test_no_tokens_and_probabilities_on_the_input(rowwise_route):
    """No tokens: empty FP8 rows, an empty block. ``probs_on="input"`` keeps the codes and
    scales each row's factor: the block within FP8's error of float64 (output, gradients of
    x and probs; two FP8 GEMMs in series, 6e-2 each), as the plain rows' block is."""
    torch.manual_seed(0)
    mlp = gl.GroupedMLP(E, H, F, bias=False, params_dtype=torch.bfloat16, device=DEVICE,
                        probs_on="input", recipe=ROWWISE)
    empty = torch.zeros(0, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    rows, m_splits, row_map, row_probs = gl.permute(
        empty, torch.zeros(0, K, dtype=torch.int64, device=DEVICE), E,
        probs=torch.zeros(0, K, device=DEVICE), recipe=ROWWISE)
    out = gl.unpermute(mlp(rows, m_splits, row_probs), row_map)
    assert out.shape == (0, H)
    mlp64 = gl.GroupedMLP(E, H, F, bias=False, params_dtype=torch.float64, device=DEVICE,
                          probs_on="input")
    mlp64.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
    results = []
    for recipe, module, dtype in ((ROWWISE, mlp, torch.bfloat16), (None, mlp, torch.bfloat16),
                                  (None, mlp64, torch.float64)):
        x, index, probs = _tokens()
        x = x.detach().to(dtype).requires_grad_()
        probs = probs.detach().to(dtype).requires_grad_()
        rows, m_splits, row_map, row_probs = gl.permute(x, index, E, probs=probs,
                                                        recipe=recipe)
        out = gl.unpermute(module(rows, m_splits, row_probs), row_map)
        out.backward(torch.ones_like(out))
        results.append((out, x.grad, probs.grad))
    fused, plain, exact = results
    for got, near, want in zip(fused, plain, exact, strict=True):
        assert rel_err(got, want) < 2 * 6e-2 and rel_err(near, want) < 2 * 6e-2
