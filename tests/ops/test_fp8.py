"""FP8 recipes (emulated): numerics against float64, scaling, edge values, weight cache."""

import contextlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Rowwise, Float8Tensorwise
from tests.reference import codes_close, reference_grads, rel_err

RECIPES = [Float8Rowwise(), Float8Tensorwise(), Float8Rowwise(fp8_format="hybrid"),
           Float8Tensorwise(power_of_two_scales=True)]
SIZES = [40, 0, 75, 13, 64]
K, N = 64, 48


def _step(recipe, x_scale=1.0, grad_scale=1.0, dtype=torch.float32, sizes=SIZES):
    G, M = len(sizes), sum(sizes)
    x = (torch.randn(M, K) * x_scale).to(dtype).requires_grad_()
    w = (torch.randn(G, N, K) / K ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(G, N).to(dtype).requires_grad_()
    grad_out = (torch.randn(M, N) * grad_scale).to(dtype)
    y = gl.grouped_linear(x, w, b, sizes, recipe=recipe)
    y.backward(grad_out)
    ref = reference_grads(x, w, b, sizes, grad_out)
    return (y, x.grad, w.grad, b.grad), ref


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("x_scale, grad_scale", [(1.0, 1.0), (1e3, 1e-4)])
def test_error_against_float64(recipe, x_scale, grad_scale):
    got, ref = _step(recipe, x_scale, grad_scale)
    errors = [rel_err(g, r) for g, r in zip(got, ref)]
    assert all(e < 6e-2 for e in errors), errors
    assert errors[0] > 1e-4  # it did quantize
    assert rel_err(got[3], ref[3]) < 1e-6  # the bias gradient stays in high precision


def test_bf16_inputs_and_empty_groups():
    got, ref = _step(Float8Rowwise(), dtype=torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert all(rel_err(g, r) < 6e-2 for g, r in zip(got, ref))
    assert torch.all(got[2][1] == 0) and torch.all(got[3][1] == 0)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=repr)
def test_zeros_huge_values_and_all_zero_groups_stay_finite(recipe):
    sizes = [6, 5, 0, 4]
    x = torch.randn(15, K)
    x[:6] = 0  # an all-zero group
    x[7, 3] = 3e4  # one huge value
    w = torch.randn(4, N, K, requires_grad=True)
    y = gl.grouped_linear(x.requires_grad_(), w, None, sizes, recipe=recipe)
    y.backward(torch.randn_like(y))
    for t in (y, x.grad, w.grad):
        assert torch.isfinite(t).all()
    assert torch.all(y[:6] == 0) and torch.all(w.grad[0] == 0)


def test_rowwise_beats_tensorwise_on_rows_of_different_range():
    torch.manual_seed(0)
    sizes = [64, 64]
    x = torch.randn(128, K) * torch.logspace(-4, 0, 128).unsqueeze(1)
    w = torch.randn(2, N, K)
    ref = reference_grads(x, w, None, sizes, torch.zeros(128, N))[0]
    err = {type(r).__name__: rel_err(gl.grouped_linear(x, w, None, sizes, recipe=r)[:64], ref[:64])
           for r in (Float8Rowwise(), Float8Tensorwise())}
    assert err["Float8Rowwise"] < err["Float8Tensorwise"]


@pytest.mark.parametrize("single", [True, False], ids=["grouped_weight", "per_expert"])
def test_weight_cache_across_microbatches(monkeypatch, single):
    """``False`` reuses the cached copy while the weight is unchanged (no quantization, in
    either layout: the per-expert one stacks a new tensor each call) and quantizes again
    where it changed: an in-place update (an optimizer step passed ``False``), a replaced
    parameter; ``True`` always refreshes; an empty cache fills."""
    from grouped_linear.ops.fp8 import weight as fp8_weight

    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, K, N, recipe=Float8Rowwise(), single_grouped_weight=single)
    x = torch.randn(10, K)
    quantized = []
    for name in ("__init__", "refresh_"):
        original = getattr(fp8_weight.Fp8Weight, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            quantized.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(fp8_weight.Fp8Weight, name, spy)

    first = layer(x, [4, 6], is_first_microbatch=True)
    assert quantized == ["__init__"]
    assert torch.equal(layer(x, [4, 6], is_first_microbatch=False), first)
    assert torch.equal(layer(x, [4, 6], is_first_microbatch=False), first)
    assert quantized == ["__init__"]  # reused twice
    assert torch.equal(layer(x, [4, 6], is_first_microbatch=True), first)
    assert quantized[1] == "refresh_"
    with torch.no_grad():
        (layer.weight if single else layer.weight1).mul_(2.0)  # a step the flag did not say
    followed = layer(x, [4, 6], is_first_microbatch=False)
    uncached = layer(x, [4, 6])
    assert torch.equal(followed, uncached) and not torch.equal(followed, first)
    replaced = torch.nn.Parameter((layer.weight if single else layer.weight0).detach() * 3)
    setattr(layer, "weight" if single else "weight0", replaced)
    assert torch.equal(layer(x, [4, 6], is_first_microbatch=False), layer(x, [4, 6]))
    empty = gl.GroupedLinear(2, K, N, recipe=Float8Rowwise(), single_grouped_weight=single)
    empty.load_state_dict(layer.state_dict())
    assert torch.equal(empty(x, [4, 6], is_first_microbatch=False), layer(x, [4, 6]))


@pytest.mark.parametrize("change", ["fused_adamw", "fused_sgd", "data_assigned", "autocast"])
@pytest.mark.parametrize("single", [True, False], ids=["grouped_weight", "per_expert"])
def test_the_cache_follows_changes_no_version_counter_shows(change, single):
    """Weight changes that bump no version counter of the parameter itself: a fused
    optimizer's step, new data assigned to ``.data``, an in-place write between calls under
    ``torch.autocast`` (whose cast copy of the weight is new each call); each call with
    ``False`` after one computes with the new weight, as a call quantizing afresh does."""
    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, K, N, recipe=Float8Rowwise(), single_grouped_weight=single)
    params = [layer.weight] if single else layer.weight_list()
    x = torch.randn(10, K)
    cast = (torch.autocast("cpu", dtype=torch.bfloat16) if change == "autocast"
            else contextlib.nullcontext())
    with cast:
        before = layer(x, [4, 6], is_first_microbatch=True)
    for _ in range(3):
        if change.startswith("fused"):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer = (torch.optim.AdamW(params, lr=0.1, fused=True) if change == "fused_adamw"
                         else torch.optim.SGD(params, lr=0.5, fused=True))
            versions = [p._version for p in params]
            optimizer.step()
            assert [p._version for p in params] == versions  # nothing the counters see
        elif change == "data_assigned":
            params[-1].data = params[-1].detach() * -2
        else:
            with torch.no_grad():
                params[-1].mul_(-2)
        with cast:
            followed = layer(x, [4, 6], is_first_microbatch=False)
            fresh = layer(x, [4, 6])
        assert torch.equal(followed, fresh) and not torch.equal(followed, before)
        before = followed


def test_fp8_with_delayed_wgrad_and_mlp():
    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, K, N, recipe=Float8Tensorwise(), delay_wgrad_compute=True)
    eager = gl.GroupedLinear(2, K, N, recipe=Float8Tensorwise())
    eager.load_state_dict(layer.state_dict())
    x = torch.randn(10, K)
    layer(x, [4, 6]).sum().backward()
    eager(x, [4, 6]).sum().backward()
    assert layer.weight.grad is None
    layer.backward_dw()
    assert torch.equal(layer.weight.grad, eager.weight.grad)
    mlp = gl.GroupedMLP(2, K, 32, recipe=Float8Rowwise())
    plain = gl.GroupedMLP(2, K, 32)
    plain.load_state_dict(mlp.state_dict())
    y, y_ref = mlp(x, [4, 6]), plain(x, [4, 6])
    assert 0 < rel_err(y, y_ref) < 6e-2


def test_blockwise_on_random_data():
    got, ref = _step(gl.recipes.Float8Blockwise())
    errors = [rel_err(g, r) for g, r in zip(got, ref)]
    assert all(e < 4e-2 for e in errors[:3]), errors


def _outlier_errors(factor):
    gen = torch.Generator().manual_seed(0)
    sizes, K = [96, 0, 160], 512
    x = torch.randn(sum(sizes), K, generator=gen)
    w = torch.randn(3, 64, K, generator=gen) / K ** 0.5
    x[:, :128] *= factor  # one 128-channel block of outliers ...
    w[:, :, :128] /= factor  # ... that the weights balance out
    ref = reference_grads(x, w, None, sizes, torch.zeros(sum(sizes), 64))[0]
    return {type(r).__name__: rel_err(gl.grouped_linear(x, w, None, sizes, recipe=r), ref)
            for r in (Float8Rowwise(), gl.recipes.Float8Blockwise())}


def test_blockwise_beats_rowwise_on_outlier_channels():
    err = _outlier_errors(1e4)
    assert err["Float8Blockwise"] < 4e-2
    assert err["Float8Blockwise"] < 0.85 * err["Float8Rowwise"], err
    mild = _outlier_errors(1e2)
    assert abs(mild["Float8Blockwise"] - mild["Float8Rowwise"]) < 0.25 * mild["Float8Rowwise"]


@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise(), gl.recipes.Float8Blockwise()],
                         ids=repr)
def test_no_rows(recipe):
    """Zero rows: an empty output and zero weight and bias gradients, for every recipe."""
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(3, 5, 8, requires_grad=True)
    b = torch.randn(3, 5, requires_grad=True)
    y = gl.grouped_linear(x, w, b, [0, 0, 0], recipe=recipe)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise(), gl.recipes.Float8Blockwise()],
                         ids=repr)
def test_a_changed_weight_is_quantized_again_for_forward_and_dgrad(recipe):
    """``is_first_microbatch=False`` after a weight update computes with the updated weight,
    forward and input gradient both (the GPU paths keep a cached dgrad copy too), as a layer
    quantizing per call does."""
    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, 32, 16, bias=False, recipe=recipe)
    x, grad = torch.randn(12, 32), torch.randn(12, 16)
    layer(x, [5, 7], is_first_microbatch=True)  # fills the cache
    with torch.no_grad():
        layer.weight.mul_(2)
    after = gl.GroupedLinear(2, 32, 16, bias=False, recipe=recipe)
    after.load_state_dict(layer.state_dict())
    results = []
    for module, microbatch in ((layer, False), (after, None)):
        xx = x.clone().requires_grad_()
        out = module(xx, [5, 7], is_first_microbatch=microbatch)
        out.backward(grad)
        results.append((out, xx.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert rel_err(results[0][1], results[1][1]) < 1e-6


def test_a_layer_built_under_inference_mode_uses_its_cache():
    """Parameters made under ``torch.inference_mode`` keep no version counter: the cache
    still serves them (``False`` reuses what ``True`` quantized)."""
    torch.manual_seed(0)
    with torch.inference_mode():
        layer = gl.GroupedLinear(2, 32, 16, recipe=Float8Rowwise())
        x = torch.randn(12, 32)
        first = layer(x, [5, 7], is_first_microbatch=True)
        assert torch.equal(layer(x, [5, 7], is_first_microbatch=False), first)


def test_loading_a_state_dict_refreshes_the_cache():
    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, 32, 16, recipe=Float8Rowwise())
    other = gl.GroupedLinear(2, 32, 16, recipe=Float8Rowwise())
    x = torch.randn(12, 32)
    layer(x, [5, 7], is_first_microbatch=True)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x, [5, 7], is_first_microbatch=False), other(x, [5, 7]))


@pytest.mark.parametrize("recipe", [Float8Rowwise(), gl.recipes.Float8Blockwise()],
                         ids=lambda r: type(r).__name__)
def test_a_cache_filled_under_inference_mode_serves_training_and_loads(recipe):
    """An evaluation pass under ``torch.inference_mode`` fills the cache with inference
    tensors; training afterwards (reusing it or refreshing it) and a state-dict load work
    and give what a layer that never saw inference mode gives."""
    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, 32, 16, recipe=recipe)
    fresh = gl.GroupedLinear(2, 32, 16, recipe=recipe)
    fresh.load_state_dict(layer.state_dict())
    other = gl.GroupedLinear(2, 32, 16, recipe=recipe)
    x, splits = torch.randn(12, 32), [5, 7]
    with torch.inference_mode():
        layer(x, splits, is_first_microbatch=True)
    for microbatch in (False, True):
        for module in (layer, fresh):
            module.zero_grad(set_to_none=True)
        leaves = [x.clone().requires_grad_() for _ in range(2)]
        outs = [m(leaf, splits, is_first_microbatch=microbatch)
                for m, leaf in zip((layer, fresh), leaves)]
        for out in outs:
            out.sum().backward()
        assert torch.equal(outs[0], outs[1]) and torch.equal(leaves[0].grad, leaves[1].grad)
        assert torch.equal(layer.weight.grad, fresh.weight.grad)
    with torch.inference_mode():
        layer(x, splits, is_first_microbatch=True)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x, splits, is_first_microbatch=False), other(x, splits))


@pytest.mark.parametrize("route, recipe", [
    ("fp8_scaled_mm", Float8Rowwise()), ("fp8_scaled_mm", Float8Tensorwise()),
    ("fp8_scaled_mm", Float8Rowwise(power_of_two_scales=True)),
    ("fp8_blockwise", gl.recipes.Float8Blockwise())])
def test_a_weight_stored_input_major_quantizes_as_its_contiguous_copy(route, recipe):
    """The FP8 weight of the transposed view of a ``(G, K, N)`` tensor (written in that
    layout, without a copy of the weight): every buffer that of the contiguous ``(G, N, K)``
    copy (factors to float32 rounding, codes up to a rounding tie: the per-channel scales
    are divided in torch here, in the rows kernel there)."""
    from grouped_linear.ops.fp8 import Fp8Weight

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stored = (torch.randn(3, 136, 200) * torch.logspace(-2, 2, 200)).to(torch.bfloat16)
    stored = stored.to(device)
    stored[1, :, 7] = 0  # a channel of zeros
    view = stored.transpose(1, 2)
    got = Fp8Weight(view, recipe, route).buffers()
    want = Fp8Weight(view.contiguous(), recipe, route).buffers()
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == torch.float32:
            assert torch.allclose(a, b, rtol=1e-6, atol=0)
        else:
            assert codes_close(a.contiguous(), b.contiguous())


@pytest.mark.parametrize("route, recipe", [
    ("fp8_scaled_mm", Float8Rowwise()), ("fp8_scaled_mm", Float8Tensorwise()),
    ("fp8_blockwise", gl.recipes.Float8Blockwise()), ("fp8_fused", Float8Rowwise()),
    ("fp8_fused", Float8Tensorwise()), ("fp8_emulated", Float8Rowwise())])
@pytest.mark.parametrize("input_major", [False, True])
def test_refresh_rewrites_every_buffer_in_place(route, recipe, input_major, monkeypatch):
    """A cached FP8 weight re-quantized from new values holds what a fresh one of them holds,
    bit for bit, in the buffers it had (captured CUDA graphs keep reading them); the kernels
    write there directly, no second copy is built (but for the emulation and an input-major
    weight on the ``fp8_scaled_mm`` route)."""
    from grouped_linear.ops.fp8 import Fp8Weight

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def weight(seed):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(3, 136, 200, generator=g) * torch.logspace(-2, 2, 200))
        w = w.to(device, torch.bfloat16)
        return w.transpose(1, 2).contiguous().transpose(1, 2) if input_major else w

    cached = Fp8Weight(weight(0), recipe, route)
    addresses = [t.data_ptr() for t in cached.buffers()]
    built = []
    init = Fp8Weight.__init__
    monkeypatch.setattr(Fp8Weight, "__init__", lambda self, *a: built.append(init(self, *a)))
    cached.refresh_(weight(1))
    copies = route == "fp8_emulated" or (input_major and route == "fp8_scaled_mm")
    assert len(built) == (1 if copies else 0)
    monkeypatch.undo()
    fresh = Fp8Weight(weight(1), recipe, route)
    assert [t.data_ptr() for t in cached.buffers()] == addresses
    for got, want in zip(cached.buffers(), fresh.buffers(), strict=True):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)
    if cached.dgrad_fold is not None:  # rowwise: the dgrad's fold is the forward's factors
        assert cached.dgrad_fold.data_ptr() == cached.forward_inv.data_ptr()
    # the refreshed values are the new weight's, within FP8's rounding (float64)
    from grouped_linear.kernels.quantize.emulate import dequantize_codes

    values = (cached.emulated if route == "fp8_emulated"
              else dequantize_codes(cached.forward_data, cached.forward_inv, torch.float64))
    assert 1e-4 < rel_err(values, weight(1).double()) < 6e-2
    if cached.dgrad_data is not None:  # the dgrad's codes are the forward's, transposed
        assert torch.equal(cached.dgrad_data.view(torch.uint8),
                           cached.forward_data.view(torch.uint8).transpose(1, 2))


def test_a_cached_copy_is_refreshed_only_from_a_weight_of_its_shape():
    """Another shape is refused by the copy (its buffers untouched) and gets a new copy from
    the cache."""
    from grouped_linear.ops.fp8 import Fp8Weight, Fp8WeightCache

    recipe = gl.recipes.Float8Blockwise()
    w = torch.randn(2, 256, 128)
    cached = Fp8Weight(w, recipe, "fp8_blockwise")
    before = [t.clone() for t in cached.buffers()]
    with pytest.raises(ValueError, match=r"weight has shape \(2, 128, 128\): this FP8 copy holds"):
        cached.refresh_(torch.randn(2, 128, 128))
    assert all(torch.equal(a, b) for a, b in zip(cached.buffers(), before))
    cache = Fp8WeightCache()
    first = cache.get(w, recipe, "fp8_blockwise", refresh=True)
    assert cache.get(w, recipe, "fp8_blockwise", refresh=False) is first
    other = cache.get(torch.randn(2, 128, 128), recipe, "fp8_blockwise", refresh=False)
    assert other is not first and other.shape == (2, 128, 128)
