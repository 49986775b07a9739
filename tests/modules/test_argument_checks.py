"""Arguments checked by type before anything reads them, errors naming the argument (and not
another), rejected calls changing nothing; ``init_method`` that returns its weight."""

import numpy as np
import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise

G, K, N = 3, 8, 4
SIZES = [2, 0, 4]
RECIPES = [None, Float8Rowwise(), Float8Tensorwise(), Float8Blockwise()]


# --------------------------------------------------------------------------- init_method
def _ones(weight: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(weight)


@pytest.mark.parametrize("single", [True, False])
def test_init_method_returning_a_tensor_sets_the_weight(single):
    layer = gl.GroupedLinear(G, K, N, init_method=_ones, single_grouped_weight=single)
    assert all(torch.equal(w, torch.ones(N, K)) for w in layer.weight_list())


def test_init_method_result_is_cast_to_the_parameter_dtype():
    layer = gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16,
                             init_method=lambda w: torch.full(w.shape, 0.25, dtype=torch.float64))
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight, torch.full((G, N, K), 0.25, dtype=torch.bfloat16))


def test_reset_parameters_uses_the_returned_tensor_again():
    counter = iter(range(1, 100))

    def numbered(weight: torch.Tensor) -> torch.Tensor:
        return torch.full(weight.shape, float(next(counter)))

    layer = gl.GroupedLinear(G, K, N, init_method=numbered)
    with torch.no_grad():
        layer.weight.zero_()
    layer.reset_parameters()
    for i, w in enumerate(layer.weight_list()):
        assert torch.equal(w, torch.full((N, K), float(G + 1 + i)))


def test_in_place_init_method_still_works():
    layer = gl.GroupedLinear(G, K, N, init_method=lambda w: torch.nn.init.constant_(w, 2.0))
    assert torch.equal(layer.weight, torch.full((G, N, K), 2.0))

    def fill(weight: torch.Tensor) -> None:
        weight.fill_(3.0)

    layer = gl.GroupedLinear(G, K, N, init_method=fill)
    assert torch.equal(layer.weight, torch.full((G, N, K), 3.0))


def test_init_method_returning_a_view_of_the_weight():
    """A result that shares the weight's memory (its transpose) is copied in whole."""
    def transposed_counts(weight: torch.Tensor) -> torch.Tensor:
        weight.copy_(torch.arange(float(weight.numel())).view(weight.shape))
        return weight.t()

    layer = gl.GroupedLinear(G, K, K, init_method=transposed_counts)
    want = torch.arange(float(K * K)).view(K, K).t()
    assert all(torch.equal(w, want) for w in layer.weight_list())


def test_grouped_mlp_passes_the_returned_tensor_to_both_layers():
    mlp = gl.GroupedMLP(G, K, 6, init_method=_ones)
    assert torch.equal(mlp.fc1.weight, torch.ones(G, 12, K))
    assert torch.equal(mlp.fc2.weight, torch.ones(G, K, 6))


@pytest.mark.parametrize(
    "init_method, error, pattern",
    [
        (lambda w: torch.ones(w.shape[0] + 1, w.shape[1]), ValueError,
         r"init_method returned a tensor of shape \(5, 8\): expected the weight's shape \(4, 8\)"),
        (lambda w: torch.ones(w.shape, dtype=torch.int64), TypeError,
         r"init_method returned a tensor of dtype torch.int64"),
        (lambda w: 1.0, TypeError, r"init_method returned float: expected None"),
    ],
)
def test_init_method_with_an_unusable_result_raises(init_method, error, pattern):
    with pytest.raises(error, match=pattern):
        gl.GroupedLinear(G, K, N, init_method=init_method)


# --------------------------------------------------------------------------- bad inputs x
BAD_X = {
    "empty list": ([], ValueError, r"x is an empty list"),
    "None": (None, TypeError, r"x must be a torch.Tensor or a list of tensors, got None"),
    "str": ("abc", TypeError, r"x must be a torch.Tensor or a list of tensors, got 'abc'"),
    "dict": ({}, TypeError, r"x must be a torch.Tensor or a list of tensors, got \{\} \(dict\)"),
    "int": (3, TypeError, r"x must be a torch.Tensor or a list of tensors, got 3 \(int\)"),
    "meta": (torch.empty(6, K, device="meta"), ValueError, r"x is on meta"),
    "list of None": ([None, None, None], TypeError, r"x\[0\] must be a torch.Tensor, got None"),
    "meta list": ([torch.empty(2, K, device="meta"), torch.empty(0, K, device="meta"),
                   torch.empty(4, K, device="meta")], ValueError, r"x is on meta"),
}


def _filled_layer(recipe):
    """A layer whose FP8 cache (for a recipe) holds the weight as it was before ``mul_``
    (so that any call reaching the cache would quantize it again)."""
    layer = gl.GroupedLinear(G, K, N, recipe=recipe)
    x = torch.randn(sum(SIZES), K)
    first = layer(x, SIZES, is_first_microbatch=True)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    return layer, x, first


def cache_state(layer):
    """The FP8 cache's copy (the object, its buffers' values) and what it was made from."""
    cache = layer._fp8_weights
    held = [b.clone() for b in cache.entry.buffers()] if cache.entry is not None else None
    return cache.entry, held, cache.stamp


def same_cache(layer, state) -> bool:
    entry, held, stamp = state
    cache = layer._fp8_weights
    return (cache.entry is entry and cache.stamp == stamp
            and (held is None or all(torch.equal(a, b)
                                     for a, b in zip(cache.entry.buffers(), held))))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("first_microbatch", [None, True, False])
@pytest.mark.parametrize("case", sorted(BAD_X))
def test_bad_x_named_before_it_is_read_and_nothing_changes(recipe, first_microbatch, case):
    x_bad, error, pattern = BAD_X[case]
    layer, x, first = _filled_layer(recipe)
    weight, state = layer.weight.detach().clone(), cache_state(layer)
    with pytest.raises(error, match=pattern):
        layer(x_bad, SIZES, is_first_microbatch=first_microbatch)
    assert torch.equal(layer.weight, weight)
    assert same_cache(layer, state)  # still the weight of the first call


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("case", sorted(BAD_X))
def test_bad_x_in_the_mlp_the_function_and_autocast(recipe, case):
    x_bad, error, pattern = BAD_X[case]
    with pytest.raises(error, match=pattern):
        gl.GroupedMLP(G, K, 6, recipe=recipe)(x_bad, SIZES, is_first_microbatch=True)
    with pytest.raises(error, match=pattern):
        gl.grouped_linear(x_bad, torch.randn(G, N, K), None, SIZES, recipe=recipe)
    with pytest.raises(error, match=pattern), gl.autocast(recipe):
        gl.GroupedLinear(G, K, N)(x_bad, SIZES, is_first_microbatch=True)


def test_meta_input_with_a_meta_layer_is_refused_by_its_device():
    layer = gl.GroupedLinear(G, K, N, device="meta")
    with pytest.raises(ValueError, match=r"x is on meta: expected a tensor on one of"):
        layer(torch.empty(6, K, device="meta"), SIZES)


def test_integer_input_is_refused_before_autocast_casts_it():
    layer = gl.GroupedLinear(G, K, N)
    with pytest.raises(TypeError, match=r"x has dtype torch.int64: expected a floating-point"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.ones(6, K, dtype=torch.long), SIZES)
    with pytest.raises(TypeError, match=r"weight has dtype torch.int32: expected a floating"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gl.grouped_linear(torch.ones(6, K), torch.ones(G, N, K, dtype=torch.int32), None,
                              SIZES)


@pytest.mark.parametrize("m_splits, error, pattern", [
    (6, TypeError, r"m_splits must be None, a list of ints or an integer tensor giving the rows "
                   r"of each tensor of the list x \(\[2, 0, 4\]\), got 6 \(int\)"),
    ("2,0,4", TypeError, r"m_splits must be None, .* got '2,0,4' \(str\)"),
    ([2, 1, 3], ValueError, r"m_splits=\[2, 1, 3\] disagrees with the sizes of the list x"),
    (torch.tensor([2.0, 0.0, 4.0]), TypeError, r"m_splits has dtype torch.float32"),
    (torch.tensor([[2, 0, 4]]), ValueError, r"m_splits has shape \(1, 3\)"),
])
def test_m_splits_with_a_list_input(m_splits, error, pattern):
    pieces = [torch.randn(size, K) for size in SIZES]
    with pytest.raises(error, match=pattern):
        gl.GroupedLinear(G, K, N)(pieces, m_splits)
    with pytest.raises(error, match=pattern):
        gl.GroupedMLP(G, K, 6)(pieces, m_splits)


# --------------------------------------------------------------------------- constructors
@pytest.mark.parametrize(
    "build, error, pattern",
    [
        (lambda: gl.GroupedMLP(G, K, 6, return_bias="yes"), TypeError,
         r"return_bias must be a bool, got 'yes'"),
        (lambda: gl.GroupedMLP(G, K, 6, reduce_output=0), TypeError,
         r"reduce_output must be a bool, got 0"),
        (lambda: gl.GroupedMLP(G, K, 6, tp_group="g"), TypeError,
         r"tp_group must be None or a torch.distributed ProcessGroup, got 'g' of type str"),
        (lambda: gl.GroupedMLP(G, K, 6, parallel_mode="column"), ValueError,
         r"parallel_mode='column': GroupedMLP sets it itself"),
        (lambda: gl.GroupedMLP(G, K, 6, tp_column_blocks=2), ValueError,
         r"tp_column_blocks=2: GroupedMLP sets it itself"),
        (lambda: gl.GroupedMLP(G, K, 5, tp_size=2), ValueError,
         r"ffn_hidden_size=5 is not divisible by tp_size=2"),
        (lambda: gl.GroupedMLP(G, K, 6, tp_size=2), ValueError,
         r"tp_size=2 with tp_group=None needs an initialised torch.distributed"),
        (lambda: gl.GroupedLinear(G, K, N, tp_group="g"), TypeError, r"tp_group must be None or"),
        (lambda: gl.GroupedLinear(G, K, N, parallel_mode="column", tp_group="g"), TypeError,
         r"tp_group must be None or a torch.distributed ProcessGroup, got 'g'"),
        (lambda: gl.GroupedLinear(G, K, N, parallel_mode=["row"]), ValueError,
         r"parallel_mode=\['row'\] is not one of"),
        (lambda: gl.GroupedLinear(G, K, N, parallel_mode="row", reduce_output="no"), TypeError,
         r"reduce_output must be a bool, got 'no'"),
        (lambda: gl.GroupedLinear(G, K, N, tp_column_blocks=True), TypeError,
         r"tp_column_blocks is True of type bool"),
        (lambda: gl.GroupedLinear(G, K, N, device=2.5), TypeError,
         r"device must be a torch.device, a str or an int, got 2.5"),
        (lambda: gl.GroupedLinear(G, K, N, device="nowhere"), ValueError,
         r"device='nowhere' is not a device torch knows"),
        (lambda: gl.GroupedLinear(G, K, N, bias=1), TypeError, r"bias must be a bool, got 1"),
    ],
)
def test_constructor_arguments_are_named(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


# --------------------------------------------------------------------------- state dicts
def test_state_dict_entry_of_another_type_names_the_key_and_the_type():
    layer = gl.GroupedLinear(G, K, N)
    state = layer.state_dict()
    state["weight"] = np.ones((G, N, K))
    with pytest.raises(TypeError) as raised:
        layer.load_state_dict(state)
    message = str(raised.value)
    assert message == ("state dict entry 'weight' is ndarray: expected a tensor of shape "
                       f"({G}, {N}, {K})")


@pytest.mark.parametrize("single", [True, False])
def test_state_dict_entries_checked_in_either_layout(single):
    source = gl.GroupedLinear(G, K, N, single_grouped_weight=not single).state_dict()
    key = "weight" if not single else "weight1"
    source[key] = source[key][..., :-1]
    want = (G, N, K) if key == "weight" else (N, K)
    with pytest.raises(ValueError, match=rf"state dict entry '{key}' has shape .* expected "
                                         rf"{tuple(want)}".replace("(", r"\(").replace(")", r"\)")):
        gl.GroupedLinear(G, K, N, single_grouped_weight=single).load_state_dict(source)


def test_rejected_mlp_state_dict_loads_neither_layer():
    mlp = gl.GroupedMLP(G, K, 6)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in before.items()}
    state["fc2.bias"] = torch.zeros(G + 1, K)
    with pytest.raises(ValueError, match=r"state dict entry 'fc2.bias' has shape \(4, 8\)"):
        mlp.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in mlp.state_dict().items())
