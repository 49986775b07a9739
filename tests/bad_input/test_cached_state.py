"""State a module keeps between calls: the FP8 weight cache (``is_first_microbatch``), loaded
state dicts and initialisation, each given something malformed."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import grouped_linear as gl
from tests.bad_input.checks import Names, expect_rejected, rejected_or
from tests.bad_input.layers import SIZES, G, K, M, N, make_layer, rows

RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]

# Calls refused while a cached FP8 weight is held; each asks to refresh the cache.
FP8_BAD_CALLS: dict[str, tuple[str, Callable[[], tuple], Names]] = {
    "m_splits sum": ("range", lambda: (rows(), [2, 1, 4], {}), "m_splits"),
    "m_splits numpy bool": ("type", lambda: (rows(), [2, np.bool_(False), 4], {}), "m_splits"),
    "x wrong features": ("shape", lambda: (rows(k=K + 1), SIZES, {}), "x"),
    "x=[]": ("shape", lambda: ([], SIZES, {}), "x"),
    "x on meta": ("device", lambda: (torch.empty(M, K, device="meta"), SIZES, {}), "x"),
    "x float64": ("dtype", lambda: (rows(dtype=torch.float64), SIZES, {}), "x"),
    "is_first_microbatch=str": ("type", lambda: (rows(), SIZES, {"is_first_microbatch": "yes"}),
                                "is_first_microbatch"),
}


def _cached_layer(recipe: object, own: bool) -> tuple[gl.GroupedLinear, torch.Tensor,
                                                     torch.Tensor]:
    """A layer whose cached FP8 weight was quantized before its weight changed, an input,
    and the output the cached weight gives for it."""
    layer = gl.GroupedLinear(G, K, N, recipe=recipe if own else None)
    x = rows()
    with torch.no_grad(), nullcontext() if own else gl.autocast(recipe):
        layer(x, SIZES, is_first_microbatch=True)
        layer.weight.mul_(2)
        reused = layer(x, SIZES, is_first_microbatch=False)
    return layer, x, reused


def _refuse(layer: gl.GroupedLinear, case: str) -> None:
    kind, make, names = FP8_BAD_CALLS[case]
    bad_x, m_splits, kwargs = make()
    kwargs = {"is_first_microbatch": True} | kwargs
    expect_rejected(kind, lambda: layer(bad_x, m_splits, **kwargs), names, state=layer)


@pytest.mark.parametrize("case", FP8_BAD_CALLS)
def test_a_refused_call_keeps_the_fp8_weight_cache(case: str) -> None:
    """The cache holds a weight quantized before the parameters changed; a refused call
    asking for a refresh leaves it, and the next reusing call gives what it gave before."""
    layer, x, reused = _cached_layer(RECIPES[0], own=True)
    _refuse(layer, case)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, SIZES, is_first_microbatch=False), reused,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("own", [True, False], ids=["recipe=", "gl.autocast"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_every_recipe_keeps_its_fp8_weight_cache(recipe: object, own: bool) -> None:
    """As above for each recipe, given to the layer or by ``gl.autocast``: every refused call
    is checked (one layer, to keep the emulated FP8 cheap), the failures reported together."""
    layer, x, reused = _cached_layer(recipe, own)
    failures = []
    with nullcontext() if own else gl.autocast(recipe):
        for case in FP8_BAD_CALLS:
            try:
                _refuse(layer, case)
            except (AssertionError, pytest.fail.Exception) as failure:
                failures.append(f"{case}: {failure}")
        with torch.no_grad():
            torch.testing.assert_close(layer(x, SIZES, is_first_microbatch=False), reused,
                                       rtol=0, atol=0)
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- load_state_dict
def _single(changes: dict[str, object]) -> Callable[[dict], dict]:
    return lambda state: state | changes


def _to_per_expert(changes: dict[str, object]) -> Callable[[dict], dict]:
    """The single layout's dict rewritten with per-expert keys, then ``changes``."""
    def rewrite(state: dict) -> dict:
        out = {f"weight{i}": w for i, w in enumerate(state["weight"].unbind(0))}
        out |= {f"bias{i}": b for i, b in enumerate(state["bias"].unbind(0))}
        return out | changes
    return rewrite


WEIGHT = (G, N, K)
STATE_DICT_CASES: dict[str, tuple[str, Callable[[dict], dict], Names, str | None]] = {
    "weight wrong shape": ("shape", _single({"weight": torch.zeros(G, K, N)}), "weight", None),
    "weight one group short": (
        "shape", _single({"weight": torch.zeros(G - 1, N, K)}), "weight", None),
    "bias wrong shape": ("shape", _single({"bias": torch.zeros(N)}), "bias", None),
    "weight ndarray": ("type", _single({"weight": np.zeros(WEIGHT, np.float32)}), "weight",
                       "ndarray"),
    "weight str": ("type", _single({"weight": "w"}), "weight", None),
    "weight None": ("type", _single({"weight": None}), "weight", None),
    "weight on meta": ("device", _single({"weight": torch.empty(WEIGHT, device="meta")}),
                       "weight", None),
    "per-expert weight1 wrong shape": (
        "shape", _to_per_expert({"weight1": torch.zeros(K, N)}), ("weight1", "weight0"), None),
    "per-expert weight2 ndarray": (
        "type", _to_per_expert({"weight2": np.zeros((N, K), np.float32)}), "weight2",
        "ndarray"),
    "per-expert bias0 str": ("type", _to_per_expert({"bias0": "b"}), "bias0", None),
}


@pytest.mark.parametrize("case", STATE_DICT_CASES)
def test_load_state_dict_refuses_and_keeps_the_layer(case: str) -> None:
    """Into an FP8 layer holding a cached weight (a load refreshes it) and gradients."""
    kind, rewrite, names, value = STATE_DICT_CASES[case]
    layer = make_layer("fp8")
    state = rewrite({k: v.clone() + 1 for k, v in layer.state_dict().items()})
    expect_rejected(kind, lambda: layer.load_state_dict(state), names, state=layer, value=value)


def test_load_state_dict_into_per_expert_layout_with_the_wrong_group_count() -> None:
    layer = make_layer("delayed")
    state = {"weight": torch.zeros(G + 1, N, K), "bias": torch.zeros(G + 1, N)}
    expect_rejected("shape", lambda: layer.load_state_dict(state), "weight", state=layer)


def test_grouped_mlp_load_state_dict_refused_by_fc2_keeps_fc1() -> None:
    """One bad entry refuses the whole load: fc1, loaded first, keeps its parameters."""
    mlp = gl.GroupedMLP(G, K, 3)
    state = {k: v.clone() + 1 for k, v in mlp.state_dict().items()}
    state["fc2.weight"] = torch.zeros(G, 3, K)
    expect_rejected("shape", lambda: mlp.load_state_dict(state), "fc2.weight", state=mlp)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("layer_kind", ["fp8", "delayed"])
def test_load_state_dict_of_more_experts_per_expert_keys(layer_kind: str, strict: bool) -> None:
    """``weight{G}`` / ``bias{G}`` of a larger checkpoint: refused before experts 0..G-1 load
    (not dropped by ``strict=False``, nor an "unexpected key" after the load), in either
    layout, naming the key and the layer's expert count."""
    layer = make_layer(layer_kind)
    source = gl.GroupedLinear(G + 1, K, N, single_grouped_weight=False, single_grouped_bias=False)
    state = {k: v.detach() + 1 for k, v in source.state_dict().items()}
    expect_rejected("range", lambda: layer.load_state_dict(state, strict=strict), f"weight{G}",
                    "num_gemms", state=layer, value=str(G))


@pytest.mark.parametrize("key, value", [
    ("experts.fc2.weight", torch.zeros(4, 3 + 1, 6)),  # fc2 is (E, H, F) = (4, 3, 6)
    ("experts.fc1.bias", np.zeros((4, 12), np.float32)),
    ("router.weight", torch.zeros(5, 3)),
], ids=["fc2.weight shape", "fc1.bias ndarray", "router.weight shape"])
def test_moe_load_state_dict_refused_keeps_router_and_experts(key: str, value: object) -> None:
    """The router loads first and the experts after it: one bad entry of either refuses the
    whole load, leaving every parameter as it was."""
    moe = gl.ExpertParallelMoE(3, 6, 4, 2)
    for param in moe.parameters():
        param.grad = torch.randn_like(param)
    state = {k: v.clone() + 1 for k, v in moe.state_dict().items()} | {key: value}
    expect_rejected("type" if isinstance(value, np.ndarray) else "shape",
                    lambda: moe.load_state_dict(state), key, state=moe)


# --------------------------------------------------------------------------- init_method
def test_init_method_returning_a_tensor() -> None:
    """An ``init_method`` that returns its values instead of writing them: they are used, or
    the method is refused by name; never is a weight left as uninitialised memory."""
    def check(layer: object) -> None:
        assert isinstance(layer, gl.GroupedLinear)
        assert bool((layer.weight == 0.5).all())

    rejected_or("type", lambda: gl.GroupedLinear(G, K, N, init_method=lambda w: torch.full_like(
        w, 0.5)), "init_method", check)


def test_init_method_returning_the_wrong_shape() -> None:
    expect_rejected("shape", lambda: gl.GroupedLinear(G, K, N, init_method=lambda w: torch.zeros(
        2)), "init_method")

