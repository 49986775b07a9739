"""GroupedLinear's constructor and forward, the functional grouped_linear and GroupSplits,
each called with malformed arguments."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import grouped_linear as gl
from tests.bad_input.checks import Names, expect_rejected, rejected_or
from tests.bad_input.layers import LAYER_KINDS, SIZES, G, Holder, K, M, N, make_layer, rows

CPU = torch.device("cpu")

# ----------------------------------------------------------------------------- constructor
CONSTRUCTOR_CASES: list[tuple[str, dict[str, object], Names]] = [
    ("type", {"num_gemms": None}, "num_gemms"),
    ("type", {"num_gemms": "3"}, "num_gemms"),
    ("type", {"num_gemms": 3.0}, "num_gemms"),
    ("type", {"num_gemms": [3]}, "num_gemms"),
    ("type", {"num_gemms": True}, "num_gemms"),
    ("type", {"num_gemms": np.bool_(True)}, "num_gemms"),
    ("range", {"num_gemms": 0}, "num_gemms"),
    ("range", {"num_gemms": -1}, "num_gemms"),
    ("type", {"in_features": 4.0}, "in_features"),
    ("type", {"in_features": np.bool_(True)}, "in_features"),
    ("range", {"in_features": 0}, "in_features"),
    ("type", {"out_features": "5"}, "out_features"),
    ("type", {"out_features": np.bool_(True)}, "out_features"),
    ("range", {"out_features": -5}, "out_features"),
    ("type", {"bias": "yes"}, "bias"),
    ("type", {"bias": None}, "bias"),
    ("type", {"bias": 1}, "bias"),
    ("type", {"return_bias": "yes"}, "return_bias"),
    ("type", {"single_grouped_weight": 1}, "single_grouped_weight"),
    ("type", {"single_grouped_bias": "no"}, "single_grouped_bias"),
    ("type", {"delay_wgrad_compute": None}, "delay_wgrad_compute"),
    ("type", {"fuse_wgrad_accumulation": 0}, "fuse_wgrad_accumulation"),
    ("type", {"reduce_output": "no"}, "reduce_output"),
    ("dtype", {"params_dtype": torch.int32}, "params_dtype"),
    ("dtype", {"params_dtype": torch.bool}, "params_dtype"),
    ("dtype", {"params_dtype": torch.float8_e4m3fn}, "params_dtype"),
    ("dtype", {"params_dtype": torch.float8_e5m2}, "params_dtype"),
    ("type", {"params_dtype": "float32"}, "params_dtype"),
    ("type", {"params_dtype": float}, "params_dtype"),
    ("device", {"device": "banana"}, "device"),
    ("type", {"init_method": 3}, "init_method"),
    ("type", {"init_method": "kaiming"}, "init_method"),
    ("type", {"backend": None}, "backend"),
    ("type", {"backend": 3}, "backend"),
    ("range", {"backend": "cublas"}, "backend"),
    ("type", {"recipe": "fp8"}, "recipe"),
    ("type", {"recipe": gl.recipes.Float8Rowwise}, "recipe"),
    ("type", {"recipe": gl.recipes.Float8Recipe()}, "recipe"),
    ("range", {"parallel_mode": "diagonal"}, "parallel_mode"),
    ("type", {"parallel_mode": 1}, "parallel_mode"),
    ("type", {"tp_size": "2"}, "tp_size"),
    ("type", {"tp_size": True}, "tp_size"),
    ("range", {"tp_size": 0}, "tp_size"),
    ("range", {"tp_size": 2}, "tp_size"),
    ("type", {"tp_group": "g"}, "tp_group"),
    ("type", {"tp_column_blocks": 1.5}, "tp_column_blocks"),
    ("range", {"tp_column_blocks": 0}, "tp_column_blocks"),
]


@pytest.mark.parametrize("kind, changes, names", CONSTRUCTOR_CASES,
                         ids=[f"{next(iter(c))}={c[next(iter(c))]!r}" for _, c, _ in
                              CONSTRUCTOR_CASES])
def test_constructor_rejects(kind: str, changes: dict[str, object], names: Names) -> None:
    args = {"num_gemms": G, "in_features": K, "out_features": N} | changes
    expect_rejected(kind, lambda: gl.GroupedLinear(**args), names)


# ----------------------------------------------------------------------------- forward
Call = Callable[[], tuple[object, object, dict[str, object]]]
FORWARD_CASES: dict[str, tuple[str, Call, Names]] = {
    "x=None": ("type", lambda: (None, SIZES, {}), "x"),
    "x=str": ("type", lambda: ("x", SIZES, {}), "x"),
    "x=dict": ("type", lambda: ({"x": rows()}, SIZES, {}), "x"),
    "x=ndarray": ("type", lambda: (np.zeros((M, K), np.float32), SIZES, {}), "x"),
    "x=list of ints": ("type", lambda: ([1, 2, 3], None, {}), "x"),
    "x=list of None": ("type", lambda: ([None] * G, None, {}), "x"),
    "x=list of ndarrays": ("type", lambda: ([np.zeros((s, K)) for s in SIZES], None, {}), "x"),
    "x int64": ("dtype", lambda: (torch.ones(M, K, dtype=torch.int64), SIZES, {}), "x"),
    "x bool": ("dtype", lambda: (torch.ones(M, K, dtype=torch.bool), SIZES, {}), "x"),
    "x float64": ("dtype", lambda: (rows(dtype=torch.float64), SIZES, {}), "x"),
    "x list of mixed dtypes": (
        "dtype", lambda: ([rows(2), rows(0, dtype=torch.float64), rows(4)], None, {}), "x"),
    "x on meta": ("device", lambda: (torch.empty(M, K, device="meta"), SIZES, {}), "x"),
    "x list with a meta piece": (
        "device", lambda: ([rows(2), torch.empty(0, K, device="meta"), rows(4)], None, {}), "x"),
    "x 0-d": ("shape", lambda: (torch.tensor(1.0), SIZES, {}), "x"),
    "x 1-D": ("shape", lambda: (torch.randn(M * K), SIZES, {}), "x"),
    "x 3-D": ("shape", lambda: (torch.randn(M, K, 1), SIZES, {}), "x"),
    "x wrong features": ("shape", lambda: (rows(k=K + 1), SIZES, {}), "x"),
    "x=[]": ("shape", lambda: ([], SIZES, {}), "x"),
    "x list of G-1": ("shape", lambda: ([rows(2), rows(4)], None, {}), ("x", "m_splits")),
    "x list wrong features": ("shape", lambda: ([rows(2), rows(0, K + 1), rows(4)], None, {}), "x"),
    "x list, m_splits=int": ("type", lambda: ([rows(s) for s in SIZES], M, {}), "m_splits"),
    "x list, m_splits disagree": (
        "range", lambda: ([rows(s) for s in SIZES], [3, 0, 3], {}), "m_splits"),
    "m_splits=None": ("type", lambda: (rows(), None, {}), "m_splits"),
    "m_splits=str": ("type", lambda: (rows(), "204", {}), "m_splits"),
    "m_splits=dict": ("type", lambda: (rows(), dict(enumerate(SIZES)), {}), "m_splits"),
    "m_splits=ndarray": ("type", lambda: (rows(), np.array(SIZES), {}), "m_splits"),
    "m_splits numpy bool": ("type", lambda: (rows(), [2, np.bool_(False), 4], {}), "m_splits"),
    "m_splits float element": ("type", lambda: (rows(), [2.0, 0, 4], {}), "m_splits"),
    "m_splits float32 tensor": (
        "dtype", lambda: (rows(), torch.tensor(SIZES, dtype=torch.float32), {}), "m_splits"),
    "m_splits bool tensor": (
        "dtype", lambda: (rows(3), torch.tensor([True, True, True]), {}), "m_splits"),
    "m_splits complex tensor": (
        "dtype", lambda: (rows(), torch.tensor(SIZES, dtype=torch.complex64), {}), "m_splits"),
    "m_splits on meta": (
        "device", lambda: (rows(), torch.tensor(SIZES, device="meta"), {}), "m_splits"),
    "m_splits 2-D": ("shape", lambda: (rows(), torch.tensor([SIZES]), {}), "m_splits"),
    "m_splits G-1 list": ("shape", lambda: (rows(), [2, 4], {}), "m_splits"),
    "m_splits G+1 tensor": ("shape", lambda: (rows(), torch.tensor(SIZES + [0]), {}), "m_splits"),
    "m_splits sum list": ("range", lambda: (rows(), [2, 1, 4], {}), "m_splits"),
    "m_splits sum tensor": ("range", lambda: (rows(), torch.tensor([2, 0, 3]), {}), "m_splits"),
    "m_splits negative": ("range", lambda: (rows(), [3, -1, 4], {}), "m_splits"),
    "m_splits negative int8": (
        "range", lambda: (rows(), torch.tensor([3, -1, 4], dtype=torch.int8), {}), "m_splits"),
    "is_first_microbatch=str": (
        "type", lambda: (rows(), SIZES, {"is_first_microbatch": "yes"}), "is_first_microbatch"),
    "is_first_microbatch=1": (
        "type", lambda: (rows(), SIZES, {"is_first_microbatch": 1}), "is_first_microbatch"),
    "return_bias=str": ("type", lambda: (rows(), SIZES, {"return_bias": "yes"}), "return_bias"),
}


@pytest.mark.parametrize("layer_kind", LAYER_KINDS)
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_rejects(layer_kind: str, case: str) -> None:
    kind, make, names = FORWARD_CASES[case]
    layer = make_layer(layer_kind)
    x, m_splits, kwargs = make()
    kwargs = {"is_first_microbatch": True} | kwargs
    expect_rejected(kind, lambda: layer(x, m_splits, **kwargs), names, state=layer)


# ----------------------------------------------------------------------------- functional
def _weight(g: int = G, n: int = N, k: int = K, **kwargs: object) -> torch.Tensor:
    return torch.randn(g, n, k, **kwargs)


FUNCTIONAL_CASES: dict[str, tuple[str, Callable[[], tuple], dict[str, object], Names]] = {
    "weight=None": ("type", lambda: (rows(), None, None), {}, "weight"),
    "weight=str": ("type", lambda: (rows(), "w", None), {}, "weight"),
    "weight=list": ("type", lambda: (rows(), list(_weight()), None), {}, "weight"),
    "weight int64": ("dtype", lambda: (rows(), _weight().long(), None), {}, "weight"),
    "weight float64": ("dtype", lambda: (rows(), _weight().double(), None), {}, "weight"),
    "weight on meta": ("device", lambda: (rows(), _weight(device="meta"), None), {}, "weight"),
    "weight 2-D": ("shape", lambda: (rows(), torch.randn(N, K), None), {}, "weight"),
    "weight 4-D": ("shape", lambda: (rows(), _weight().unsqueeze(0), None), {}, "weight"),
    "weight G-1 groups": ("shape", lambda: (rows(), _weight(g=G - 1), None), {},
                          ("weight", "m_splits")),
    "weight wrong in_features": ("shape", lambda: (rows(), _weight(k=K + 1), None), {},
                                 ("weight", "x")),
    "bias=str": ("type", lambda: (rows(), _weight(), "b"), {}, "bias"),
    "bias=list": ("type", lambda: (rows(), _weight(), [0.0] * G), {}, "bias"),
    "bias int64": ("dtype", lambda: (rows(), _weight(), torch.ones(G, N, dtype=torch.long)), {},
                   "bias"),
    "bias float64": ("dtype", lambda: (rows(), _weight(), torch.randn(G, N).double()), {},
                     "bias"),
    "bias on meta": ("device", lambda: (rows(), _weight(), torch.empty(G, N, device="meta")),
                     {}, "bias"),
    "bias 1-D": ("shape", lambda: (rows(), _weight(), torch.randn(N)), {}, "bias"),
    "bias G-1 groups": ("shape", lambda: (rows(), _weight(), torch.randn(G - 1, N)), {}, "bias"),
    "backend=None": ("type", lambda: (rows(), _weight(), None), {"backend": None}, "backend"),
    "backend=cublas": ("range", lambda: (rows(), _weight(), None), {"backend": "cublas"},
                       "backend"),
    "backend=triton float64": (
        "dtype", lambda: (rows(dtype=torch.float64), _weight().double(), None),
        {"backend": "triton"}, "backend"),
    "backend=grouped one column": (
        "shape", lambda: (rows(k=1), _weight(k=1), None), {"backend": "grouped"}, "backend"),
    "recipe=str": ("type", lambda: (rows(), _weight(), None), {"recipe": "fp8"}, "recipe"),
    "recipe=class": ("type", lambda: (rows(), _weight(), None),
                     {"recipe": gl.recipes.Float8Blockwise}, "recipe"),
}


@pytest.mark.parametrize("case", FUNCTIONAL_CASES)
def test_functional_rejects(case: str) -> None:
    kind, make, kwargs, names = FUNCTIONAL_CASES[case]
    x, weight, bias = make()
    is_tensor = isinstance(weight, torch.Tensor) and weight.is_floating_point()
    holder = Holder(weight, bias if isinstance(bias, torch.Tensor) and bias.is_floating_point()
                    else None) if is_tensor else None
    if holder is not None:
        weight = holder.weight
        bias = holder.bias if holder.bias is not None else bias
    expect_rejected(kind, lambda: gl.grouped_linear(x, weight, bias, SIZES, **kwargs), names,
                    state=holder)


def test_functional_2_31_rows_of_zero_width() -> None:
    """2**31 rows cost nothing at zero width: the call works or is refused by name."""
    def check(y: object) -> None:
        assert isinstance(y, torch.Tensor) and y.shape == (2**31, 0)

    for splits in ([2**31, 0, 0], torch.tensor([0, 2**31, 0])):
        rejected_or("range", lambda s=splits: gl.grouped_linear(
            torch.empty(2**31, 0), torch.empty(G, 0, 0), None, s), ("m_splits", "x"), check)


# ----------------------------------------------------------------------------- GroupSplits
def _ones() -> torch.Tensor:
    return torch.ones(2, dtype=torch.int64)


GROUP_SPLITS_CASES: dict[str, tuple[str, Callable[[], object], Names]] = {
    "neither sizes": ("type", lambda: gl.GroupSplits(2, 2, CPU, None), ("host_sizes",)),
    "both sizes": ("type", lambda: gl.GroupSplits(2, 2, CPU, (1, 1), _ones()), "host_sizes"),
    "host_sizes numpy bool": ("type", lambda: gl.GroupSplits(2, 2, CPU, (np.bool_(True), 1)),
                              "host_sizes"),
    "host_sizes None element": ("type", lambda: gl.GroupSplits(2, 2, CPU, (None, 2)),
                                "host_sizes"),
    "host_sizes float element": ("type", lambda: gl.GroupSplits(2, 2, CPU, (1.0, 1)),
                                 "host_sizes"),
    "host_sizes negative": ("range", lambda: gl.GroupSplits(2, 2, CPU, (3, -1)), "host_sizes"),
    "host_sizes sum": ("range", lambda: gl.GroupSplits(2, 3, CPU, (1, 1)), "host_sizes"),
    "host_sizes count": ("shape", lambda: gl.GroupSplits(3, 2, CPU, (1, 1)), "host_sizes"),
    "device_sizes float": ("dtype", lambda: gl.GroupSplits(2, 2, CPU, None, _ones().float()),
                           "device_sizes"),
    "device_sizes bool": ("dtype", lambda: gl.GroupSplits(2, 2, CPU, None, _ones().bool()),
                          "device_sizes"),
    "device_sizes 2-D": ("shape", lambda: gl.GroupSplits(2, 2, CPU, None, _ones()[None]),
                         "device_sizes"),
    "device_sizes count": ("shape", lambda: gl.GroupSplits(3, 2, CPU, None, _ones()),
                           "device_sizes"),
    "num_rows=-1": ("range", lambda: gl.GroupSplits(2, -1, CPU, None, _ones()), "num_rows"),
}


@pytest.mark.parametrize("case", GROUP_SPLITS_CASES)
def test_group_splits_rejects(case: str) -> None:
    kind, call, names = GROUP_SPLITS_CASES[case]
    expect_rejected(kind, call, names)


def test_group_splits_past_int32() -> None:
    """Sizes past 2**31: ``ends`` hold them exactly, or the sizes are refused by name."""
    def check(ends: object) -> None:
        assert isinstance(ends, torch.Tensor)
        assert ends.tolist() == [2**31, 2**31 + 1]

    rejected_or("range", lambda: gl.GroupSplits(2, 2**31 + 1, CPU, (2**31, 1)).ends,
                ("host_sizes", "num_rows"), check)
