"""``gl.to_fp8_weights``: a model's expert weights stored in FP8, checked before anything
changes, loading and saving state dicts, moving between devices and dtypes."""

import copy
import io

import pytest
import torch

import grouped_linear as gl
from grouped_linear.ops.fp8.primary import Float8WeightTensor
from tests.reference import rel_err

ROW, BLOCK = gl.recipes.Float8Rowwise(), gl.recipes.Float8Blockwise()
SIZES = [10, 20, 0, 20]


def _mlp(recipe=ROW, **kwargs):
    torch.manual_seed(0)
    return gl.GroupedMLP(4, 128, 96, bias=True, params_dtype=torch.bfloat16, recipe=recipe,
                         **kwargs)


def test_every_expert_weight_is_stored_and_read_in_fp8():
    """fc1's and fc2's weights become FP8 parameters (biases stay); the block equals the
    same block holding the stored values in bf16 under the recipe."""
    mlp = gl.to_fp8_weights(_mlp())
    for layer in (mlp.fc1, mlp.fc2):
        assert isinstance(layer.weight, Float8WeightTensor) and layer.weight.requires_grad
        assert isinstance(layer.weight, torch.nn.Parameter)
        assert type(layer.bias.data) is torch.Tensor
    plain = _mlp()
    with torch.no_grad():
        for mine, theirs in ((mlp.fc1, plain.fc1), (mlp.fc2, plain.fc2)):
            theirs.weight.copy_(mine.weight.dequantize())
            theirs.bias.copy_(mine.bias)
    x = torch.randn(50, 128).bfloat16().requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    mlp(x, SIZES).float().square().sum().backward()
    plain(x_plain, SIZES).float().square().sum().backward()
    assert rel_err(x.grad, x_plain.grad) < 1e-2
    assert rel_err(mlp.fc1.weight.grad, plain.fc1.weight.grad) < 1e-2
    assert type(mlp.fc1.weight.grad) is torch.Tensor


def test_a_layer_that_cannot_be_stored_leaves_every_layer_unchanged():
    model = torch.nn.ModuleDict({"a": gl.GroupedLinear(2, 64, 32, recipe=ROW),
                                 "b": gl.GroupedLinear(2, 64, 32)})
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="b has no recipe"):
        gl.to_fp8_weights(model)
    assert {name: p for name, p in model.named_parameters()} == before
    with pytest.raises(ValueError, match="differs from a's own recipe"):
        gl.to_fp8_weights(model, BLOCK)
    with pytest.raises(ValueError, match="single_grouped_weight=False"):
        gl.to_fp8_weights(gl.GroupedLinear(2, 64, 32, recipe=ROW, single_grouped_weight=False))
    with pytest.raises(TypeError, match="is not a known recipe"):
        gl.to_fp8_weights(model, "fp8")
    assert all(type(p.data) is torch.Tensor for p in model.parameters())
    gl.to_fp8_weights(model, ROW)  # one recipe for both
    assert model["b"].recipe == ROW and isinstance(model["b"].weight, Float8WeightTensor)


@pytest.mark.parametrize("weights_only", [False, True])
def test_pickled_weights_keep_their_parameter_flag_and_shape(weights_only):
    """``torch.save`` / ``torch.load`` of a module with a frozen FP8 weight, and of a reshaped
    view: the frozen weight comes back a parameter (MasterWeights takes it), the view of its
    shape, each with the same codes and factors."""
    mlp = gl.to_fp8_weights(_mlp())
    mlp.fc1.weight.requires_grad_(False)
    view = mlp.fc2.weight.detach().view(-1, mlp.fc2.weight.shape[-1])

    def round_trip(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=weights_only)

    state, loaded_view = round_trip({"weight": mlp.fc1.weight}), round_trip(view)
    weight = state["weight"]
    assert isinstance(weight, torch.nn.Parameter) and isinstance(weight, Float8WeightTensor)
    assert not weight.requires_grad and weight.shape == mlp.fc1.weight.shape
    assert torch.equal(weight.codes.view(torch.uint8), mlp.fc1.weight.codes.view(torch.uint8))
    assert isinstance(loaded_view, Float8WeightTensor)
    assert not isinstance(loaded_view, torch.nn.Parameter)
    assert loaded_view.shape == view.shape
    assert torch.equal(loaded_view.dequantize(), view.dequantize())
    if not weights_only:
        copy_ = round_trip(mlp)
        assert isinstance(copy_.fc1.weight, torch.nn.Parameter)
        assert not copy_.fc1.weight.requires_grad
        gl.MasterWeights(copy_.parameters())


@pytest.mark.parametrize("recipe", [ROW, BLOCK], ids=["rowwise", "blockwise"])
def test_reset_parameters_stores_the_plain_layers_draw(recipe):
    """``reset_parameters()`` of an FP8 weight: the plain layer's draw for the same seed,
    quantized (the bias drawn as the plain layer's)."""
    layer = gl.to_fp8_weights(gl.GroupedLinear(3, 128, 64, bias=True, recipe=recipe))
    plain = gl.GroupedLinear(3, 128, 64, bias=True, recipe=recipe)
    torch.manual_seed(5)
    layer.reset_parameters()
    torch.manual_seed(5)
    plain.reset_parameters()
    want = Float8WeightTensor.quantize(plain.weight.detach(), recipe)
    assert isinstance(layer.weight, Float8WeightTensor)
    assert torch.equal(layer.weight.dequantize(), want.dequantize())
    assert torch.equal(layer.bias, plain.bias)


def test_state_dicts_round_trip_and_load_into_plain_modules():
    mlp = gl.to_fp8_weights(_mlp(BLOCK))
    buffer = io.BytesIO()
    torch.save(mlp.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    assert isinstance(state["fc1.weight"], Float8WeightTensor)
    fresh = gl.to_fp8_weights(_mlp(BLOCK))
    with torch.no_grad():
        fresh.fc1.weight.mul_(0.5)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.fc1.weight.codes.float(), mlp.fc1.weight.codes.float())
    assert torch.equal(fresh.fc1.weight.inv, mlp.fc1.weight.inv)
    plain = _mlp(BLOCK)
    plain.load_state_dict(state)
    assert torch.equal(plain.fc2.weight, mlp.fc2.weight.dequantize())
    per_expert = gl.GroupedLinear(mlp.fc2.num_gemms, mlp.fc2.in_features, mlp.fc2.out_features,
                                  single_grouped_weight=False)
    per_expert.load_state_dict({k[len("fc2."):]: v for k, v in state.items()
                                if k.startswith("fc2.")})
    assert torch.equal(per_expert.grouped_weight(), mlp.fc2.weight.dequantize().float())


def test_dtype_and_device_moves_keep_the_fp8_storage():
    mlp = gl.to_fp8_weights(_mlp())
    codes = mlp.fc1.weight.codes
    moved = copy.deepcopy(mlp).to("cpu").float()
    assert isinstance(moved.fc1.weight, Float8WeightTensor)
    assert moved.fc1.weight.dtype == torch.float32
    assert torch.equal(moved.fc1.weight.codes.float(), codes.float())


@pytest.mark.parametrize("module, match", [
    ([gl.GroupedLinear(2, 64, 32, recipe=ROW)], r"module is list: expected a torch.nn.Module"),
    (None, r"module is None \(NoneType\): expected a torch.nn.Module"),
    (gl.GroupedLinear(2, 64, 32, recipe=ROW).weight, r"module is Parameter"),
])
def test_to_fp8_weights_refuses_what_is_no_module(module, match):
    with pytest.raises(TypeError, match=match):
        gl.to_fp8_weights(module)


def test_another_recipe_for_stored_layers_is_refused_before_any_change():
    """Layers already stored for one recipe: converting again with that recipe (or None)
    leaves them as they are; another recipe is refused naming it and the stored one, and
    the plain layers beside them stay plain."""
    model = torch.nn.ModuleDict({"a": gl.to_fp8_weights(gl.GroupedLinear(2, 64, 32, recipe=ROW)),
                                 "b": gl.GroupedLinear(2, 64, 32, recipe=BLOCK)})
    stored = model["a"].weight
    codes = stored.codes.clone()
    with pytest.raises(ValueError, match=r"recipe=Float8Blockwise\(.*\) but a's weight is "
                                         r"already stored in FP8 for Float8Rowwise\("):
        gl.to_fp8_weights(model, BLOCK)
    assert model["a"].weight is stored and torch.equal(stored.codes, codes)
    assert model["a"].recipe == ROW and type(model["b"].weight.data) is torch.Tensor
    gl.to_fp8_weights(model["a"], ROW)
    gl.to_fp8_weights(model)  # each its own: b converted, a kept
    assert model["a"].weight is stored and isinstance(model["b"].weight, Float8WeightTensor)
    assert model["b"].weight.recipe == BLOCK
