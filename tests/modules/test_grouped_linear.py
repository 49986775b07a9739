"""GroupedLinear: layouts, initialisation, state dicts, gradient routing (CPU)."""

import pytest
import torch

import grouped_linear as gl
from tests.reference import reference_grads, rel_err

SIZES = [6, 0, 11, 3]
G, K, N = 4, 12, 10


def _layer(**kwargs):
    torch.manual_seed(1234)
    return gl.GroupedLinear(G, K, N, params_dtype=torch.float64, **kwargs)


def _weight_grad(layer):
    if layer.single_grouped_weight:
        return layer.weight.grad
    return torch.stack([getattr(layer, f"weight{i}").grad for i in range(layer.num_gemms)])


def _bias_grad(layer):
    if layer.single_grouped_bias:
        return layer.bias.grad
    return torch.stack([getattr(layer, f"bias{i}").grad for i in range(layer.num_gemms)])


def _grouped(layer):
    return layer.grouped_weight().detach(), layer.grouped_bias().detach()


@pytest.mark.parametrize("single_weight", [True, False])
@pytest.mark.parametrize("single_bias", [True, False])
def test_layouts_match_reference(single_weight, single_bias):
    layer = _layer(single_grouped_weight=single_weight, single_grouped_bias=single_bias)
    x = torch.randn(sum(SIZES), K, dtype=torch.float64, requires_grad=True)
    y = layer(x, SIZES)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    w, b = _grouped(layer)
    ref = reference_grads(x, w, b, SIZES, grad_out)
    assert rel_err(y, ref[0]) < 1e-12 and rel_err(x.grad, ref[1]) < 1e-12
    weights = [layer.weight] if single_weight else [getattr(layer, f"weight{i}") for i in range(G)]
    grad_w = weights[0].grad if single_weight else torch.stack([p.grad for p in weights])
    assert rel_err(grad_w, ref[2]) < 1e-12
    grad_b = layer.bias.grad if single_bias else torch.stack([getattr(layer, f"bias{i}").grad
                                                              for i in range(G)])
    assert rel_err(grad_b, ref[3]) < 1e-12


def test_parameter_names_and_shapes():
    single = _layer()
    assert {n: tuple(p.shape) for n, p in single.named_parameters()} == {
        "weight": (G, N, K), "bias": (G, N)}
    split = _layer(single_grouped_weight=False, single_grouped_bias=False)
    names = dict(split.named_parameters())
    assert set(names) == {f"weight{i}" for i in range(G)} | {f"bias{i}" for i in range(G)}
    assert all(tuple(names[f"weight{i}"].shape) == (N, K) for i in range(G))
    assert _layer(bias=False).bias is None


def test_same_weights_from_same_seed_in_both_layouts():
    a, b = _layer(), _layer(single_grouped_weight=False, single_grouped_bias=False)
    assert torch.equal(_grouped(a)[0], _grouped(b)[0])
    assert torch.equal(_grouped(a)[1], _grouped(b)[1])


def test_default_init_follows_nn_linear_per_expert():
    torch.manual_seed(0)
    layer = gl.GroupedLinear(3, 64, 32)
    bound = 1 / 64 ** 0.5
    assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
    assert layer.weight.std() > 0.5 * bound / 3 ** 0.5
    for i in range(1, 3):  # every expert drawn independently
        assert not torch.equal(layer.weight[0], layer.weight[i])


def test_init_method_called_per_expert():
    shapes = []

    def init(w):
        shapes.append(tuple(w.shape))
        with torch.no_grad():
            w.fill_(len(shapes))

    for single in (True, False):
        shapes.clear()
        layer = gl.GroupedLinear(3, 5, 7, single_grouped_weight=single, init_method=init)
        assert shapes == [(7, 5)] * 3
        w = layer.grouped_weight()
        assert [float(w[i, 0, 0].detach()) for i in range(3)] == [1.0, 2.0, 3.0]


def test_meta_device_deferred_init():
    torch.manual_seed(7)
    eager = gl.GroupedLinear(G, K, N)
    meta = gl.GroupedLinear(G, K, N, device="meta")
    assert meta.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.reset_parameters()
    assert torch.equal(meta.weight, eager.weight) and torch.equal(meta.bias, eager.bias)


@pytest.mark.parametrize("src_single", [True, False])
def test_state_dict_cross_load(src_single):
    src = _layer(single_grouped_weight=src_single, single_grouped_bias=src_single)
    dst = gl.GroupedLinear(G, K, N, params_dtype=torch.float64,
                           single_grouped_weight=not src_single,
                           single_grouped_bias=not src_single)
    result = dst.load_state_dict(src.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(sum(SIZES), K, dtype=torch.float64)
    assert torch.equal(src(x, SIZES), dst(x, SIZES))


def _expected_order(single_weight, single_bias, bias):
    """Weights before biases; per-expert ones interleaved expert by expert."""
    weights = ["weight"] if single_weight else [f"weight{i}" for i in range(G)]
    biases = (["bias"] if single_bias else [f"bias{i}" for i in range(G)]) if bias else []
    if single_weight or single_bias or not bias:
        return weights + biases
    return [name for pair in zip(weights, biases) for name in pair]


LAYOUTS = [(w, b) for w in (True, False) for b in (True, False)]


@pytest.mark.parametrize("single_weight, single_bias", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
def test_registration_order(single_weight, single_bias, bias):
    layer = _layer(single_grouped_weight=single_weight, single_grouped_bias=single_bias,
                   bias=bias)
    want = _expected_order(single_weight, single_bias, bias)
    assert [name for name, _ in layer.named_parameters()] == want
    assert list(layer.state_dict()) == want
    if not (single_weight or single_bias or not bias):
        assert want[:4] == ["weight0", "bias0", "weight1", "bias1"]


@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
def test_state_dict_loads_across_every_layout(src_layout, dst_layout):
    torch.manual_seed(5)
    src = gl.GroupedLinear(G, K, N, params_dtype=torch.float64,
                           single_grouped_weight=src_layout[0], single_grouped_bias=src_layout[1])
    dst = _layer(single_grouped_weight=dst_layout[0], single_grouped_bias=dst_layout[1])
    state = src.state_dict()
    # Any key order loads: the weights-then-biases order of earlier versions as well.
    state = {key: state[key] for key in sorted(state, key=lambda k: not k.startswith("weight"))}
    result = dst.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(dst.grouped_weight(), src.grouped_weight())
    assert torch.equal(dst.grouped_bias(), src.grouped_bias())
    x = torch.randn(sum(SIZES), K, dtype=torch.float64)
    assert torch.equal(src(x, SIZES), dst(x, SIZES))


def test_state_dict_cross_load_nested_prefix():
    src = torch.nn.Sequential(_layer(single_grouped_weight=False, single_grouped_bias=False))
    dst = torch.nn.Sequential(gl.GroupedLinear(G, K, N, params_dtype=torch.float64))
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst[0].weight, src[0].grouped_weight())


def test_state_dict_wrong_shape_names_key():
    layer = _layer()
    state = layer.state_dict()
    state["weight"] = torch.zeros(G, N + 1, K, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'weight'.*\(4, 11, 12\)"):
        layer.load_state_dict(state)
    split = _layer(single_grouped_weight=False)
    bad = split.state_dict()
    bad["weight2"] = torch.zeros(N, K + 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="'weight2'"):
        split.load_state_dict(bad)
    with pytest.raises(ValueError, match="'weight'"):
        split.load_state_dict({"weight": torch.zeros(G + 1, N, K), "bias": torch.zeros(G, N)})


def test_return_bias():
    single = _layer(return_bias=True)
    x = torch.randn(sum(SIZES), K, dtype=torch.float64)
    y, bias = single(x, SIZES)
    # a copy of the parameter (FSDP2 frees a sharded layer's gathered one after its forward)
    assert torch.equal(bias, single.bias) and bias.data_ptr() != single.bias.data_ptr()
    bias.sum().backward(retain_graph=True)
    assert torch.equal(single.bias.grad, torch.ones_like(single.bias))
    w, b = _grouped(single)
    ref = reference_grads(x, w, None, SIZES, torch.zeros(sum(SIZES), N))[0]
    assert rel_err(y, ref) < 1e-12
    split = _layer(return_bias=True, single_grouped_bias=False)
    _, biases = split(x, SIZES)
    assert isinstance(biases, list) and len(biases) == G and torch.equal(biases[2], split.bias2)
    biases[2].sum().backward()
    assert torch.equal(split.bias2.grad, torch.ones_like(split.bias2))
    _, none = _layer(return_bias=True, bias=False)(x, SIZES)
    assert none is None


@pytest.mark.parametrize("single", [True, False])
def test_delayed_wgrad_accumulates_in_order(single):
    layer = _layer(delay_wgrad_compute=True, single_grouped_weight=single,
                   single_grouped_bias=single)
    w, b = _grouped(layer)
    xs = [torch.randn(sum(SIZES), K, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    grads = [torch.randn(sum(SIZES), N, dtype=torch.float64) for _ in range(2)]
    for x, g in zip(xs, grads):
        layer(x, SIZES).backward(g)
    params = list(layer.parameters())
    assert all(p.grad is None for p in params)
    refs = [reference_grads(x, w, b, SIZES, g) for x, g in zip(xs, grads)]
    for x, ref in zip(xs, refs):
        assert rel_err(x.grad, ref[1]) < 1e-12
    layer.backward_dw()
    assert rel_err(_weight_grad(layer), refs[0][2] + refs[1][2]) < 1e-12
    assert rel_err(_bias_grad(layer), refs[0][3] + refs[1][3]) < 1e-12
    layer.backward_dw()  # nothing pending: no change
    assert rel_err(_weight_grad(layer), refs[0][2] + refs[1][2]) < 1e-12


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("delay", [False, True])
def test_fused_main_grad_accumulation(single, delay):
    layer = _layer(fuse_wgrad_accumulation=True, delay_wgrad_compute=delay,
                   single_grouped_weight=single)
    weights = [layer.weight] if single else [getattr(layer, f"weight{i}") for i in range(G)]
    for p in weights:
        p.main_grad = torch.full_like(p, 0.5)
    w, b = _grouped(layer)
    x = torch.randn(sum(SIZES), K, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(SIZES), N, dtype=torch.float64)
    layer(x, SIZES).backward(g)
    layer.backward_dw()
    ref = reference_grads(x, w, b, SIZES, g)
    main = weights[0].main_grad if single else torch.stack([p.main_grad for p in weights])
    assert rel_err(main - 0.5, ref[2]) < 1e-12
    # Plain parameters: .grad untouched, no attribute added (Megatron-style ones carry it).
    assert all(p.grad is None and not hasattr(p, "grad_added_to_main_grad") for p in weights)
    assert rel_err(layer.bias.grad, ref[3]) < 1e-12


def test_fused_main_grad_missing_is_an_error():
    layer = _layer(fuse_wgrad_accumulation=True)
    x = torch.randn(sum(SIZES), K, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight\.main_grad"):
        layer(x, SIZES)
    split = _layer(fuse_wgrad_accumulation=True, single_grouped_weight=False)
    for i in range(G - 1):
        getattr(split, f"weight{i}").main_grad = torch.zeros(N, K, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight3\.main_grad"):
        split(x, SIZES)
    with torch.no_grad():  # inference needs no main_grad
        assert split(x, SIZES).shape == (sum(SIZES), N)
    layer.weight.main_grad = torch.zeros(G, N, K, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"weight\.main_grad is torch\.int32 on cpu"):
        layer(x, SIZES)  # at the forward, not deep in the backward


def test_is_first_microbatch_accepted_and_ignored():
    layer = _layer()
    x = torch.randn(sum(SIZES), K, dtype=torch.float64)
    outs = [layer(x, SIZES, is_first_microbatch=flag) for flag in (None, True, False)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_extra_repr():
    text = repr(gl.GroupedLinear(3, 16, 8, bias=False, backend="loop"))
    assert "num_gemms=3" in text and "in_features=16" in text and "out_features=8" in text
    assert "bias=False" in text and "backend='loop'" in text


@pytest.mark.parametrize("bias", [True, False])
def test_triton_backward_in_one_launch_or_deferred_gives_the_same_gradients(bias):
    """The Triton backend's backward runs dgrad and wgrad in one launch unless the weight
    gradient is deferred; both ways give the same values, bit for bit, and the reference's."""
    from grouped_linear.kernels._triton import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    torch.manual_seed(0)
    layers = [gl.GroupedLinear(G, K, N, bias=bias, backend="triton", device=device,
                               delay_wgrad_compute=delay) for delay in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(sum(SIZES), K, device=device)
    grad_out = torch.randn(sum(SIZES), N, device=device)
    grads = []
    for layer in layers:
        leaf = x.clone().requires_grad_()
        layer(leaf, SIZES).backward(grad_out)
        layer.backward_dw()
        grads.append([leaf.grad] + [p.grad for p in layer.parameters()])
    for now, deferred in zip(*grads, strict=True):
        assert torch.equal(now, deferred)
    ref = reference_grads(x, layers[0].weight, layers[0].bias, SIZES, grad_out)
    for got, want in zip(grads[0], ref[1:], strict=False):
        assert rel_err(got, want) < 1e-5


def test_save_original_input_reaches_the_layers_and_keeps_the_emulated_numerics():
    """``save_original_input`` is a bool kept on the layer (and on GroupedMLP's fc1 and fc2);
    on CPU (the FP8 emulation keeps ``x`` anyway) the step is the default's bit for bit; a
    non-bool is refused naming it."""
    torch.manual_seed(3)
    recipe = gl.recipes.Float8Rowwise()
    grads = []
    for keep in (False, True):
        torch.manual_seed(4)
        layer = gl.GroupedLinear(3, 16, 24, recipe=recipe, save_original_input=keep)
        assert layer.save_original_input is keep
        x = torch.randn(20, 16, requires_grad=True, generator=torch.Generator().manual_seed(5))
        y = layer(x, [7, 0, 13])
        y.backward(torch.ones_like(y))
        grads.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    mlp = gl.GroupedMLP(2, 16, 8, save_original_input=True)
    assert mlp.fc1.save_original_input and mlp.fc2.save_original_input
    with pytest.raises(TypeError, match="save_original_input must be a bool, got 1"):
        gl.GroupedLinear(2, 4, 4, save_original_input=1)
    weight = torch.randn(2, 4, 4)
    with pytest.raises(TypeError, match="save_original_input must be a bool, got 'yes'"):
        gl.grouped_linear(torch.randn(3, 4), weight, None, [1, 2], save_original_input="yes")
