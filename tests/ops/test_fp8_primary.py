"""FP8 primary weights: the stored values, the GEMMs reading them, writes that quantize
again, and float32 master weights training in step with a plain weight under the recipe."""

import importlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear.ops.fp8.primary import Float8WeightTensor, MasterWeights
from grouped_linear.ops.fp8.weight import quantize_weight_emulated
from tests.reference import rel_err

RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]
IDS = [type(r).__name__ for r in RECIPES]
SIZES = [10, 0, 30]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the routes' kernels
G, N, K = 3, 256, 160


def _weight(seed=0):
    return torch.randn(G, N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_stored_values_are_the_recipes_forward_weight(recipe):
    """One byte per weight plus the recipe's factors, holding exactly the values the
    recipe's forward GEMM would read."""
    w = _weight()
    stored = Float8WeightTensor.quantize(w, recipe)
    assert stored.codes.dtype == torch.float8_e4m3fn and stored.codes.shape == w.shape
    assert stored.dtype == w.dtype and stored.shape == w.shape
    torch.testing.assert_close(stored.dequantize(), quantize_weight_emulated(w, recipe),
                               rtol=1e-6, atol=0)
    nbytes = stored.codes.nbytes + stored.inv.nbytes
    assert nbytes <= 0.55 * w.to(torch.bfloat16).nbytes


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_grouped_linear_reads_the_stored_weight(recipe):
    """Output and gradients equal the recipe's call on a plain weight holding the stored
    values; the weight gradient arrives as a plain tensor of the weight's shape."""
    stored = torch.nn.Parameter(Float8WeightTensor.quantize(_weight(), recipe))
    plain = stored.dequantize().detach().requires_grad_()
    x = torch.randn(40, K, requires_grad=True)
    grad = torch.randn(40, N)
    y = gl.grouped_linear(x, stored, None, SIZES)  # the stored recipe by default
    y.backward(grad)
    dx = x.grad
    x.grad = None
    want = gl.grouped_linear(x, plain, None, SIZES, recipe=recipe)
    want.backward(grad)
    assert rel_err(y, want) < 1e-6 and rel_err(dx, x.grad) < 1e-6
    assert type(stored.grad) is torch.Tensor and torch.equal(stored.grad, plain.grad)


def test_another_recipe_is_refused_and_autocast_does_not_apply():
    """The stored recipe is the weight's own: another one given to the call is refused (the
    weight untouched); ``gl.autocast``'s does not apply to it, as to a module's own."""
    stored = Float8WeightTensor.quantize(_weight(), gl.recipes.Float8Rowwise())
    codes = stored.codes.clone()
    x = torch.randn(40, K)
    with pytest.raises(ValueError, match="stored in FP8 for Float8Rowwise"):
        gl.grouped_linear(x, stored, None, SIZES, recipe=gl.recipes.Float8Blockwise())
    assert torch.equal(stored.codes.float(), codes.float())
    with gl.autocast(gl.recipes.Float8Tensorwise()):
        inside = gl.grouped_linear(x, stored, None, SIZES)
    assert torch.equal(inside, gl.grouped_linear(x, stored, None, SIZES))


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_writes_quantize_in_place(recipe):
    """``copy_`` and in-place arithmetic keep the tensor and its buffers (their addresses)
    and store the quantized result; reads see the dequantized values."""
    stored = Float8WeightTensor.quantize(_weight(), recipe)
    addresses = (stored.codes.data_ptr(), stored.inv.data_ptr())
    new = _weight(seed=1)
    stored.copy_(new)
    assert (stored.codes.data_ptr(), stored.inv.data_ptr()) == addresses
    torch.testing.assert_close(stored.dequantize(), quantize_weight_emulated(new, recipe),
                               rtol=1e-6, atol=0)
    before = stored.dequantize()
    stored.mul_(2.0)
    assert isinstance(stored, Float8WeightTensor)
    torch.testing.assert_close(stored.dequantize(), quantize_weight_emulated(2 * before, recipe),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(stored.sum(), stored.dequantize().sum())


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_master_weights_train_in_step_with_a_plain_weight(recipe):
    """Five SGD steps: an FP8 weight with a float32 master against a float32 weight run
    under the same recipe (each forward quantizing it). Both forwards read the same FP8
    values at every step, so the master tracks the plain weight to float32 rounding."""
    w0 = Float8WeightTensor.quantize(_weight(), recipe).dequantize()  # on the FP8 grid
    plain = w0.clone().requires_grad_()
    stored = torch.nn.Parameter(Float8WeightTensor.quantize(w0, recipe))
    masters = MasterWeights([stored])
    plain_opt = torch.optim.SGD([plain], lr=0.5)
    master_opt = torch.optim.SGD(masters.params, lr=0.5)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, grad = torch.randn(40, K, generator=gen), torch.randn(40, N, generator=gen)
        gl.grouped_linear(x, plain, None, SIZES, recipe=recipe).backward(grad)
        gl.grouped_linear(x, stored, None, SIZES).backward(grad)
        plain_opt.step()
        plain_opt.zero_grad()
        masters.step(master_opt)
        master_opt.zero_grad()
        assert stored.grad is None
    assert rel_err(masters.params[0], plain) < 1e-5
    assert rel_err(plain, w0) > 1e-2  # it did train
    torch.testing.assert_close(stored.dequantize(),
                               quantize_weight_emulated(masters.params[0], recipe),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_whole_experts_share_the_buffers(recipe):
    """Pieces along the experts (slices, chunks) and zero weights of a few experts are FP8
    weights on the same buffers: a write into a piece reaches the weight, in the piece's
    experts only. A reshape of the whole reads the same values."""
    stored = Float8WeightTensor.quantize(_weight(), recipe)
    before = stored.dequantize()
    first, rest = torch.chunk(stored, 2)
    assert isinstance(first, Float8WeightTensor) and first.shape == (2, N, K)
    assert rest.codes.data_ptr() == stored.codes[2:].data_ptr()
    torch.testing.assert_close(stored[1:].dequantize(), before[1:], rtol=0, atol=0)
    new = _weight(seed=4)[2:]
    rest.copy_(new)
    after = stored.dequantize()
    torch.testing.assert_close(after[:2], before[:2], rtol=0, atol=0)
    torch.testing.assert_close(after[2:], quantize_weight_emulated(new, recipe), rtol=1e-6,
                               atol=0)
    zeros = stored.new_zeros((1, N, K))
    assert isinstance(zeros, Float8WeightTensor) and not zeros.dequantize().any()
    flat = stored.view(-1)
    assert flat.shape == (G * N * K,) and torch.equal(flat.dequantize(), after.reshape(-1))
    assert torch.equal(torch.as_strided(flat, (G, N, K), (N * K, K, 1)).dequantize(), after)


def test_other_views_and_pieces_are_refused():
    """No piece inside an expert, transpose or per-expert select: a dequantized copy would
    not see writes, and tensor parallelism would shard it silently in high precision."""
    stored = Float8WeightTensor.quantize(_weight(), gl.recipes.Float8Rowwise())
    for take in (lambda t: t[0], lambda t: torch.chunk(t, 2, dim=1), lambda t: t[:, :8],
                 lambda t: t.transpose(1, 2), lambda t: t.new_zeros((G, N, 8)),
                 lambda t: t.view(G, -1)[:, :4], lambda t: t[::2]):
        with pytest.raises(NotImplementedError, match="whole experts"):
            take(stored)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_scaled_mm_route_reads_the_stored_codes(recipe, monkeypatch):
    """The sm90 route (its quantization and wgrad kernels interpreted, torch's FP8 GEMM
    replaced by its dequantized reference) on a stored weight: the plain weight's results
    under that route, and a second backward of a retained graph (the dgrad's transposed
    codes written again from the stored ones)."""
    from grouped_linear.kernels.gemm import fp8_torch_gemm
    ops_linear = importlib.import_module("grouped_linear.ops.grouped_linear")

    def gemm(a, a_inv, b, b_inv, ends, out_dtype):
        return fp8_torch_gemm.dequantized_reference(a, a_inv, b, b_inv, ends).to(out_dtype)

    monkeypatch.setattr(fp8_torch_gemm, "forward", gemm)
    monkeypatch.setattr(fp8_torch_gemm, "dgrad", gemm)
    monkeypatch.setattr(ops_linear, "choose_route", lambda *args: "fp8_scaled_mm")
    stored = torch.nn.Parameter(Float8WeightTensor.quantize(
        _weight().to(DEVICE, torch.bfloat16), recipe))
    plain = stored.dequantize().detach().requires_grad_()
    x = torch.randn(40, K).to(DEVICE, torch.bfloat16).requires_grad_()
    grad = torch.randn(40, N).to(DEVICE, torch.bfloat16)
    y = gl.grouped_linear(x, stored, None, SIZES)
    y.backward(grad, retain_graph=True)
    first = (x.grad.clone(), stored.grad.clone())
    y.backward(grad)
    assert torch.equal(x.grad, 2 * first[0]) and torch.equal(stored.grad, 2 * first[1])
    x.grad = None
    want = gl.grouped_linear(x, plain, None, SIZES, recipe=recipe)
    want.backward(grad)
    assert rel_err(y, want) < 1e-2 and rel_err(first[0], x.grad) < 1e-2
    assert rel_err(first[1], plain.grad) < 1e-2


@pytest.mark.parametrize("route, recipe", [("fp8_scaled_mm", RECIPES[0]),
                                           ("fp8_blockwise", RECIPES[2])], ids=["row", "block"])
def test_the_dgrad_codes_are_made_in_backward_not_kept_from_the_forward(route, recipe,
                                                                       monkeypatch):
    """A stored weight's forward transposes none of its codes; backward transposes them once
    for the dgrad (nothing of them held between the passes); the results are unchanged."""
    from grouped_linear.kernels.gemm import fp8_torch_gemm
    from grouped_linear.ops.fp8 import weight as fp8_weight
    ops_linear = importlib.import_module("grouped_linear.ops.grouped_linear")

    def gemm(a, a_inv, b, b_inv, ends, out_dtype):
        return fp8_torch_gemm.dequantized_reference(a, a_inv, b, b_inv, ends).to(out_dtype)

    monkeypatch.setattr(fp8_torch_gemm, "forward", gemm)
    monkeypatch.setattr(fp8_torch_gemm, "dgrad", gemm)
    monkeypatch.setattr(ops_linear, "choose_route", lambda *args: route)
    transposed = []
    transpose = fp8_weight.transpose_groups
    monkeypatch.setattr(fp8_weight, "transpose_groups",
                        lambda data, out=None: transposed.append(data) or transpose(data, out))
    w = torch.randn(len(SIZES), 256, 128).to(DEVICE, torch.bfloat16)
    stored = torch.nn.Parameter(Float8WeightTensor.quantize(w, recipe))
    x = torch.randn(40, 128).to(DEVICE, torch.bfloat16).requires_grad_()
    grad = torch.randn(40, 256).to(DEVICE, torch.bfloat16)
    y = gl.grouped_linear(x, stored, None, SIZES)
    assert transposed == []
    y.backward(grad)
    assert len(transposed) == 1 and transposed[0] is stored.codes
    plain = stored.dequantize().detach().requires_grad_()
    xx = x.detach().clone().requires_grad_()
    want = gl.grouped_linear(xx, plain, None, SIZES, recipe=recipe)
    want.backward(grad)
    assert rel_err(y, want) < 1e-2 and rel_err(x.grad, xx.grad) < 1e-2


_PARAMETER = torch.nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize("parameters, exc, match", [
    ("abc", TypeError, r"parameters is 'abc' \(str\): expected an iterable of "
                       r"torch.nn.Parameter"),
    (torch.zeros(3), TypeError, r"parameters is tensor\(\[0., 0., 0.\]\) \(Tensor\)"),
    (_PARAMETER, TypeError, r"parameters is Parameter: expected an iterable"),
    (3, TypeError, r"parameters is 3 \(int\)"),
    ([torch.zeros(3)], TypeError, r"parameters\[0\] is tensor\(.*\) \(Tensor\): expected a "
                                  r"torch.nn.Parameter"),
    ([_PARAMETER, "w"], TypeError, r"parameters\[1\] is 'w' \(str\)"),
    ([_PARAMETER, _PARAMETER], ValueError, r"parameters\[1\] is parameters\[0\] again"),
])
def test_master_weights_refuse_what_is_not_parameters(parameters, exc, match):
    with pytest.raises(exc, match=match):
        MasterWeights(parameters)


@pytest.mark.parametrize("optimizer, match", [
    (None, r"optimizer is None \(NoneType\)"),
    ("sgd", r"optimizer is 'sgd' \(str\)"),
    (torch.optim.lr_scheduler.StepLR(torch.optim.SGD([_PARAMETER], lr=1.0), 1),
     r"optimizer is StepLR"),
])
def test_master_step_refuses_what_is_no_optimizer_before_any_change(optimizer, match):
    """``step`` checks its optimizer before it moves a gradient: the FP8 parameter keeps its
    gradient and values, the master gets none."""
    stored = torch.nn.Parameter(Float8WeightTensor.quantize(_weight(), RECIPES[0]))
    masters = MasterWeights([stored])
    gl.grouped_linear(torch.randn(40, K), stored, None, SIZES).sum().backward()
    grad, codes = stored.grad, stored.codes.clone()
    with pytest.raises(TypeError, match=match + r": expected a torch.optim.Optimizer"):
        masters.step(optimizer)
    assert stored.grad is grad and masters.params[0].grad is None
    assert torch.equal(stored.codes, codes)
    masters.step(torch.optim.SGD(masters.params, lr=0.0))  # an optimizer: the step runs
    assert stored.grad is None and torch.equal(masters.params[0].grad, grad.float())


def _fp8_layer(recipe, seed, bias=False):
    """A GroupedLinear of ``_weight(seed)`` with its weight stored in ``recipe``'s FP8."""
    layer = gl.GroupedLinear(G, K, N, bias=bias, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(_weight(seed))
    return gl.to_fp8_weights(layer)


def _swap_load(model, state):
    """``load_state_dict(assign=True)`` as torch does it when swapping tensors."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(state, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _quantized(values, recipe):
    return Float8WeightTensor.quantize(values, recipe).dequantize()


# Each writes ``_weight(7)`` (or part of it) into the model's FP8 weight after the masters
# were built, as ``source`` (an FP8 layer of ``_weight(7)``) holds it or as ``plain`` is
# quantized; returns the values the weight then holds, computed without the model.
WRITES = {
    "nothing": lambda model, source, plain: model.weight.dequantize().clone(),
    "load_fp8_state_dict": lambda model, source, plain: (
        model.load_state_dict(source.state_dict()), source.weight.dequantize())[1],
    "load_plain_state_dict": lambda model, source, plain: (
        model.load_state_dict({"weight": plain}), _quantized(plain, source.recipe))[1],
    "into_a_state_dict_entry": lambda model, source, plain: (
        model.state_dict()["weight"].copy_(plain), _quantized(plain, source.recipe))[1],
    "store_": lambda model, source, plain: (
        model.weight.store_(plain), _quantized(plain, source.recipe))[1],
    "one_expert": lambda model, source, plain: torch.cat([
        model.weight.dequantize()[:1].clone(),
        (model.weight[1:].copy_(plain[1:]), _quantized(plain, source.recipe)[1:])[1]]),
    "swap_assign_load": lambda model, source, plain: (
        _swap_load(model, source.state_dict()), source.weight.dequantize().clone())[1],
}


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_master_follows_its_weight_written_elsewhere(write, recipe):
    """A weight written after the masters were built (a checkpoint loaded, ...) is read into
    its master before the step: a step at ``lr=0`` leaves the written values bit for bit,
    in the weight and in the master."""
    model, source = _fp8_layer(recipe, 0), _fp8_layer(recipe, 7)
    masters = MasterWeights(model.parameters())
    opt = torch.optim.SGD(masters.params, lr=0.0)
    with torch.no_grad():
        written = WRITES[write](model, source, _weight(7))
    model(torch.randn(40, K), SIZES).sum().backward()
    masters.step(opt)
    assert torch.equal(model.weight.dequantize(), written)
    assert torch.equal(masters.params[0], written)
    assert write == "nothing" or not torch.equal(written, _fp8_layer(recipe, 0).weight.dequantize())


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_a_step_after_a_load_updates_the_loaded_weight(recipe):
    """Trained, loaded from a checkpoint, trained again: the second step starts from the
    checkpoint's values, ``quantize(loaded - lr * grad)``."""
    model, source = _fp8_layer(recipe, 0), _fp8_layer(recipe, 7)
    masters = MasterWeights(model.parameters())
    opt = torch.optim.SGD(masters.params, lr=0.1)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(5))
    model(x, SIZES).sum().backward()
    masters.step(opt)
    opt.zero_grad()
    model.load_state_dict(source.state_dict())
    model(x, SIZES).sum().backward()
    grad = model.weight.grad.float()
    masters.step(opt)
    expected = source.weight.dequantize().add(grad, alpha=-0.1)  # SGD's update
    torch.testing.assert_close(masters.params[0], expected, rtol=1e-6, atol=0)
    assert torch.equal(model.weight.dequantize(), _quantized(expected, recipe))


def test_rewriting_the_stored_values_keeps_the_masters_finer_bits():
    """A weight rewritten with the values its master stored (a checkpoint of these same
    weights) keeps the master, and with it the updates below the FP8 step."""
    model = _fp8_layer(RECIPES[0], 0)
    masters = MasterWeights(model.parameters())
    opt = torch.optim.SGD(masters.params, lr=1e-4)
    model(torch.randn(40, K), SIZES).sum().backward()
    masters.step(opt)
    master = masters.params[0].clone()
    assert not torch.equal(master, model.weight.dequantize())  # it holds finer bits
    model.load_state_dict(model.state_dict())
    masters.step(opt)  # no gradient: nothing to update
    assert torch.equal(masters.params[0], master)


WRONG_OPTIMIZERS = {
    "over_the_fp8_parameters": (lambda model, masters: model.parameters(),
                                r"it holds the FP8 parameters of masters.pairs \[0\]"),
    "over_the_others_only": (lambda model, masters: masters.others,
                             r"it lacks masters.params \[0\]"),
    "over_other_masters": (lambda model, masters: MasterWeights(model.parameters()).params,
                           r"it lacks masters.params \[0\]"),
}


@pytest.mark.parametrize("wrong", list(WRONG_OPTIMIZERS))
def test_master_step_refuses_an_optimizer_not_over_the_masters(wrong):
    """An optimizer whose parameters are not the masters would lose the step: ``ValueError``
    naming it, before a gradient moves, a weight is stored or the optimizer steps."""
    model = _fp8_layer(RECIPES[0], 0, bias=True)
    masters = MasterWeights(model.parameters())
    params, match = WRONG_OPTIMIZERS[wrong]
    opt = torch.optim.SGD(params(model, masters), lr=1.0, momentum=0.9)
    model(torch.randn(40, K), SIZES).sum().backward()
    weight, bias = model.weight, model.bias
    grads, codes, inv = (weight.grad, bias.grad), weight.codes.clone(), weight.inv.clone()
    values = (masters.params[0].clone(), bias.detach().clone())
    with pytest.raises(ValueError, match=r"optimizer is SGD: its parameters are not the "
                                         r"masters \(" + match):
        masters.step(opt)
    assert weight.grad is grads[0] and bias.grad is grads[1] and masters.params[0].grad is None
    assert torch.equal(weight.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(weight.inv, inv)
    assert torch.equal(masters.params[0], values[0]) and torch.equal(bias, values[1])
    assert not opt.state  # momentum buffers are made by a step
    masters.step(torch.optim.SGD(masters.params + masters.others, lr=1.0))
    assert weight.grad is None and not torch.equal(masters.params[0], values[0])
