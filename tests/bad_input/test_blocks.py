"""GroupedMLP, ExpertParallelMoE (one process, no torch.distributed) and the FP8 recipes,
called with malformed arguments."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import grouped_linear as gl
from tests.bad_input.checks import Names, expect_rejected
from tests.bad_input.layers import SIZES, G, K, M, make_mlp, rows

MLP_CONSTRUCTOR_CASES: list[tuple[str, dict[str, object], Names, str | None]] = [
    ("range", {"num_experts": 0}, "num_experts", None),
    ("type", {"num_experts": np.bool_(True)}, "num_experts", None),
    ("type", {"hidden_size": "4"}, "hidden_size", None),
    ("range", {"ffn_hidden_size": 0}, "ffn_hidden_size", None),
    ("range", {"activation": "tanh"}, "activation", None),
    ("type", {"activation": None}, "activation", None),
    ("type", {"activation": 3}, "activation", None),
    ("type", {"recompute_activation": "yes"}, "recompute_activation", None),
    ("type", {"return_bias": "yes"}, "return_bias", "'yes'"),
    ("range", {"return_bias": True}, "return_bias", None),
    ("type", {"bias": "yes"}, "bias", None),
    ("range", {"tp_size": 0}, "tp_size", None),
    ("type", {"tp_size": "2"}, "tp_size", None),
    ("type", {"tp_group": "g"}, "tp_group", None),
    ("range", {"backend": "cublas"}, "backend", None),
    ("type", {"recipe": "fp8"}, "recipe", None),
]


@pytest.mark.parametrize("kind, changes, names, value", MLP_CONSTRUCTOR_CASES,
                         ids=[f"{next(iter(c))}={c[next(iter(c))]!r}" for _, c, _, _ in
                              MLP_CONSTRUCTOR_CASES])
def test_grouped_mlp_constructor_rejects(kind: str, changes: dict[str, object], names: Names,
                                         value: str | None) -> None:
    args = {"num_experts": G, "hidden_size": K, "ffn_hidden_size": 3} | changes
    expect_rejected(kind, lambda: gl.GroupedMLP(**args), names, value=value)


MLP_FORWARD_CASES: dict[str, tuple[str, Callable[[], tuple], Names]] = {
    "x=None": ("type", lambda: (None, SIZES, {}), "x"),
    "x int64": ("dtype", lambda: (torch.ones(M, K, dtype=torch.int64), SIZES, {}), "x"),
    "x on meta": ("device", lambda: (torch.empty(M, K, device="meta"), SIZES, {}), "x"),
    "x wrong features": ("shape", lambda: (rows(k=K + 1), SIZES, {}), "x"),
    "x=[]": ("shape", lambda: ([], SIZES, {}), "x"),
    "x list, m_splits=int": ("type", lambda: ([rows(s) for s in SIZES], M, {}), "m_splits"),
    "m_splits numpy bool": ("type", lambda: (rows(), [2, np.bool_(False), 4], {}), "m_splits"),
    "m_splits on meta": (
        "device", lambda: (rows(), torch.tensor(SIZES, device="meta"), {}), "m_splits"),
    "m_splits G-1": ("shape", lambda: (rows(), [2, 4], {}), "m_splits"),
    "m_splits sum": ("range", lambda: (rows(), [2, 1, 4], {}), "m_splits"),
    "is_first_microbatch=str": (
        "type", lambda: (rows(), SIZES, {"is_first_microbatch": "yes"}), "is_first_microbatch"),
}


@pytest.mark.parametrize("case", MLP_FORWARD_CASES)
def test_grouped_mlp_forward_rejects(case: str) -> None:
    kind, make, names = MLP_FORWARD_CASES[case]
    mlp = make_mlp()
    x, m_splits, kwargs = make()
    expect_rejected(kind, lambda: mlp(x, m_splits, **kwargs), names, state=mlp)


# --------------------------------------------------------------------------- ExpertParallelMoE
H, F, E, TOP_K = 4, 3, 4, 2

MOE_CONSTRUCTOR_CASES: list[tuple[str, dict[str, object], Names, str | None]] = [
    ("range", {"hidden_size": 0}, "hidden_size", None),
    ("type", {"hidden_size": "4"}, "hidden_size", None),
    ("type", {"hidden_size": np.bool_(True)}, "hidden_size", None),
    ("type", {"ffn_hidden_size": "3"}, "ffn_hidden_size", None),
    ("range", {"num_experts": 0}, "num_experts", None),
    ("range", {"top_k": 0}, "top_k", None),
    ("type", {"top_k": True}, "top_k", None),
    ("range", {"top_k": E + 1}, "top_k", None),
    ("range", {"activation": "tanh"}, "activation", None),
    ("type", {"return_bias": "yes"}, "return_bias", "'yes'"),
    ("dtype", {"params_dtype": torch.int32}, "params_dtype", None),
    ("dtype", {"params_dtype": torch.float8_e4m3fn}, "params_dtype", "torch.float8_e4m3fn"),
    ("type", {"params_dtype": "float32"}, "params_dtype", None),
]


@pytest.mark.parametrize("kind, changes, names, value", MOE_CONSTRUCTOR_CASES,
                         ids=[f"{next(iter(c))}={c[next(iter(c))]!r}" for _, c, _, _ in
                              MOE_CONSTRUCTOR_CASES])
def test_moe_constructor_rejects(kind: str, changes: dict[str, object], names: Names,
                                 value: str | None) -> None:
    args = {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "top_k": TOP_K} | changes
    expect_rejected(kind, lambda: gl.ExpertParallelMoE(**args), names, value=value)


MOE_FORWARD_CASES: dict[str, tuple[str, Callable[[], object], dict[str, object], Names]] = {
    "x=None": ("type", lambda: None, {}, "x"),
    "x=list": ("type", lambda: [torch.randn(5, H)], {}, "x"),
    "x 1-D": ("shape", lambda: torch.randn(5 * H), {}, "x"),
    "x wrong features": ("shape", lambda: torch.randn(5, H + 1), {}, "x"),
    "x int64": ("dtype", lambda: torch.ones(5, H, dtype=torch.int64), {}, "x"),
    "x float64, parameters float32": ("dtype", lambda: torch.randn(5, H, dtype=torch.float64),
                                      {}, "x"),
    "x float32, parameters bfloat16": ("dtype", lambda: torch.randn(5, H),
                                       {"params_dtype": torch.bfloat16}, "x"),
    "x on meta": ("device", lambda: torch.empty(5, H, device="meta"), {}, "x"),
}


@pytest.mark.parametrize("case", MOE_FORWARD_CASES)
def test_moe_forward_rejects(case: str) -> None:
    kind, make, kwargs, names = MOE_FORWARD_CASES[case]
    moe = gl.ExpertParallelMoE(H, F, E, TOP_K, **kwargs)
    for param in moe.parameters():
        param.grad = torch.randn_like(param)
    x = make()
    expect_rejected(kind, lambda: moe(x), names, state=moe)


# --------------------------------------------------------------------------- recipes
RECIPE_CLASSES = [gl.recipes.Float8Rowwise, gl.recipes.Float8Tensorwise,
                  gl.recipes.Float8Blockwise]
RECIPE_CASES: list[tuple[str, dict[str, object], Names]] = [
    ("range", {"fp8_format": "e5m2"}, "fp8_format"),
    ("type", {"fp8_format": None}, "fp8_format"),
    ("type", {"fp8_format": 1}, "fp8_format"),
    ("type", {"fp8_format": ["e4m3"]}, "fp8_format"),
    ("type", {"power_of_two_scales": "yes"}, "power_of_two_scales"),
    ("type", {"power_of_two_scales": 1}, "power_of_two_scales"),
    ("type", {"power_of_two_scales": None}, "power_of_two_scales"),
]


@pytest.mark.parametrize("recipe_class", RECIPE_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind, changes, names", RECIPE_CASES,
                         ids=[f"{next(iter(c))}={c[next(iter(c))]!r}" for _, c, _ in
                              RECIPE_CASES])
def test_recipe_rejects(recipe_class: type, kind: str, changes: dict[str, object],
                        names: Names) -> None:
    expect_rejected(kind, lambda: recipe_class(**changes), names)


AUTOCAST_CASES = {"str": "fp8", "class": gl.recipes.Float8Rowwise,
                  "base recipe": gl.recipes.Float8Recipe(), "int": 8}


@pytest.mark.parametrize("case", AUTOCAST_CASES)
def test_autocast_rejects(case: str) -> None:
    """Refused on entry, leaving no recipe behind for later calls."""
    def enter() -> None:
        with gl.autocast(AUTOCAST_CASES[case]):
            pass

    expect_rejected("type", enter, "recipe")
    assert gl.recipes.current_recipe() is None
