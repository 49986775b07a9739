"""pad_groups, unpad_groups, permute and unpermute called with malformed arguments."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import grouped_linear as gl
from tests.bad_input.checks import Names, expect_rejected, rejected_or

H = 3
SIZES = [2, 0, 3]
M = sum(SIZES)
PADDED = [4, 0, 4]


def _x(rows: int = M, cols: int = H) -> torch.Tensor:
    return torch.randn(rows, cols)


def _long(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


Case = tuple[str, Callable[[], object], Names, str | None]
PAD_CASES: dict[str, Case] = {
    "x=None": ("type", lambda: gl.pad_groups(None, SIZES), "x", None),
    "x=str": ("type", lambda: gl.pad_groups("x", SIZES), "x", None),
    "x=ndarray": ("type", lambda: gl.pad_groups(np.zeros((M, H)), SIZES), "x", None),
    "x=list of None": ("type", lambda: gl.pad_groups([None, None]), "x", None),
    "x 1-D": ("shape", lambda: gl.pad_groups(torch.randn(M), SIZES), "x", None),
    "x 3-D": ("shape", lambda: gl.pad_groups(torch.randn(M, H, 1), SIZES), "x", None),
    "x=[]": ("shape", lambda: gl.pad_groups([], SIZES), "x", None),
    "x list of mixed widths": ("shape", lambda: gl.pad_groups([_x(2), _x(3, H + 1)]), "x", None),
    "x list of mixed dtypes": (
        "dtype", lambda: gl.pad_groups([_x(2), _x(3).double()]), "x", None),
    "x list with a meta piece": (
        "device", lambda: gl.pad_groups([_x(2), torch.empty(3, H, device="meta")]), "x", None),
    "x list, m_splits=int": ("type", lambda: gl.pad_groups([_x(2), _x(3)], 5), "m_splits", None),
    "x list, m_splits disagree": (
        "range", lambda: gl.pad_groups([_x(2), _x(3)], [3, 2]), "m_splits", None),
    "m_splits=None": ("type", lambda: gl.pad_groups(_x(), None), "m_splits", None),
    "m_splits=[]": ("shape", lambda: gl.pad_groups(_x(0), []), "m_splits", None),
    "m_splits float tensor": (
        "dtype", lambda: gl.pad_groups(_x(), torch.tensor(SIZES, dtype=torch.float32)),
        "m_splits", None),
    "m_splits on meta": (
        "device", lambda: gl.pad_groups(_x(), torch.tensor(SIZES, device="meta")), "m_splits",
        None),
    "multiple=None": ("type", lambda: gl.pad_groups(_x(), SIZES, None), "multiple", None),
    "multiple=str": ("type", lambda: gl.pad_groups(_x(), SIZES, "16"), "multiple", None),
    "multiple=2.5": ("type", lambda: gl.pad_groups(_x(), SIZES, 2.5), "multiple", None),
    "multiple=True": ("type", lambda: gl.pad_groups(_x(), SIZES, True), "multiple", None),
    "multiple numpy bool": (
        "type", lambda: gl.pad_groups(_x(), SIZES, np.bool_(True)), "multiple", None),
    "multiple=0": ("range", lambda: gl.pad_groups(_x(), SIZES, 0), "multiple", None),
    "multiple=-16": ("range", lambda: gl.pad_groups(_x(), SIZES, -16), "multiple", None),
    "multiple=2**62": ("range", lambda: gl.pad_groups(_x(), [2, 3], 2**62), "multiple", None),
}

UNPAD_CASES: dict[str, Case] = {
    "yp=None": ("type", lambda: gl.unpad_groups(None, SIZES, PADDED), "yp", None),
    "yp 1-D": ("shape", lambda: gl.unpad_groups(torch.randn(8), SIZES, PADDED), "yp", None),
    "m_splits=str": ("type", lambda: gl.unpad_groups(_x(8), "203", PADDED), "m_splits", None),
    "m_splits numpy bool": (
        "type", lambda: gl.unpad_groups(_x(8), [np.bool_(True), 0, 3], PADDED), "m_splits", None),
    "m_splits float tensor": (
        "dtype", lambda: gl.unpad_groups(_x(8), torch.tensor([2.0, 0.0, 3.0]), PADDED),
        "m_splits", None),
    "m_splits on meta": (
        "device", lambda: gl.unpad_groups(_x(8), torch.tensor(SIZES, device="meta"), PADDED),
        "m_splits", None),
    "padded_splits on meta": (
        "device", lambda: gl.unpad_groups(_x(8), SIZES, torch.tensor(PADDED, device="meta")),
        "padded_splits", None),
    "padded_splits count": (
        "shape", lambda: gl.unpad_groups(_x(8), SIZES, [4, 4]), "padded_splits", None),
    "padded_splits below m_splits": (
        "range", lambda: gl.unpad_groups(_x(8), SIZES, [1, 0, 7]), "padded_splits", None),
    "padded_splits sum": (
        "range", lambda: gl.unpad_groups(_x(8), SIZES, [4, 0, 5]), "padded_splits", None),
    "num_rows=-1": ("range", lambda: gl.unpad_groups(_x(8), SIZES, PADDED, -1), "num_rows", None),
    "num_rows=str": ("type", lambda: gl.unpad_groups(_x(8), SIZES, PADDED, "5"), "num_rows", None),
    "num_rows=5.0": ("type", lambda: gl.unpad_groups(_x(8), SIZES, PADDED, 5.0), "num_rows", None),
    "num_rows numpy bool": (
        "type", lambda: gl.unpad_groups(_x(4), [1, 0], [4, 0], np.bool_(True)), "num_rows", None),
    "num_rows not the sum": (
        "range", lambda: gl.unpad_groups(_x(8), SIZES, PADDED, 4), "num_rows", None),
}

TOPK = [[0, 1], [2, -1], [1, 1], [0, 2]]


def _topk(dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(TOPK).to(dtype)


PERMUTE_CASES: dict[str, Case] = {
    "x=None": ("type", lambda: gl.permute(None, _topk(), 3), "x", None),
    "x=ndarray": ("type", lambda: gl.permute(np.zeros((4, H)), _topk(), 3), "x", None),
    "x 1-D": ("shape", lambda: gl.permute(torch.randn(4), _topk(), 3), "x", None),
    "topk_indices=list": ("type", lambda: gl.permute(_x(4), TOPK, 3), "topk_indices", None),
    "topk_indices float": (
        "dtype", lambda: gl.permute(_x(4), _topk().float(), 3), "topk_indices", None),
    "topk_indices bool": (
        "dtype", lambda: gl.permute(_x(4), _topk() > 0, 3), "topk_indices", None),
    "topk_indices on meta": (
        "device", lambda: gl.permute(_x(4), _topk().to("meta"), 3), "topk_indices", None),
    "topk_indices 1-D rows": (
        "shape", lambda: gl.permute(_x(5), _topk()[:, 0], 3), ("topk_indices", "x"), None),
    "topk_indices 3-D": (
        "shape", lambda: gl.permute(_x(4), _topk()[..., None], 3), "topk_indices", None),
    "topk_indices rows": (
        "shape", lambda: gl.permute(_x(5), _topk(), 3), ("topk_indices", "x"), None),
    "topk_indices = num_experts": (
        "range", lambda: gl.permute(_x(4), _topk(), 2), "topk_indices", "2"),
    "topk_indices = -7": (
        "range", lambda: gl.permute(_x(4), _long([[0, 1], [2, -7], [1, 1], [0, 2]]), 3),
        "topk_indices", "-7"),
    "topk_indices uint8 past num_experts": (
        "range", lambda: gl.permute(_x(4), _long([[0, 1], [2, 0], [1, 1], [0, 200]]).to(
            torch.uint8), 3), "topk_indices", "200"),
    "num_experts=None": ("type", lambda: gl.permute(_x(4), _topk(), None), "num_experts", None),
    "num_experts=str": ("type", lambda: gl.permute(_x(4), _topk(), "3"), "num_experts", None),
    "num_experts=3.0": ("type", lambda: gl.permute(_x(4), _topk(), 3.0), "num_experts", None),
    "num_experts=True": ("type", lambda: gl.permute(_x(4), _topk() * 0, True), "num_experts",
                         None),
    "num_experts numpy bool": (
        "type", lambda: gl.permute(_x(4), _topk() * 0, np.bool_(True)), "num_experts", None),
    "num_experts=0": ("range", lambda: gl.permute(_x(4), _topk(), 0), "num_experts", None),
    "multiple=0": ("range", lambda: gl.permute(_x(4), _topk(), 3, 0), "multiple", None),
    "multiple numpy bool": (
        "type", lambda: gl.permute(_x(4), _topk(), 3, np.bool_(True)), "multiple", None),
    "multiple=2**62": ("range", lambda: gl.permute(_x(4), _topk(), 3, 2**62), "multiple", None),
}

ROW_MAP = [[0, 3], [1, -1], [4, 2]]


def _row_map(dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(ROW_MAP).to(dtype)


UNPERMUTE_CASES: dict[str, Case] = {
    "y_perm=None": ("type", lambda: gl.unpermute(None, _row_map()), "y_perm", None),
    "y_perm 1-D": ("shape", lambda: gl.unpermute(torch.randn(5), _row_map()), "y_perm", None),
    "row_map=list": ("type", lambda: gl.unpermute(_x(5), ROW_MAP), "row_map", None),
    "row_map float": ("dtype", lambda: gl.unpermute(_x(5), _row_map().float()), "row_map", None),
    "row_map bool": ("dtype", lambda: gl.unpermute(_x(5), _row_map() > 0), "row_map", None),
    "row_map on meta": (
        "device", lambda: gl.unpermute(_x(5), _row_map().to("meta")), "row_map", None),
    "row_map 1-D": ("shape", lambda: gl.unpermute(_x(5), _row_map()[:, 0]), "row_map", None),
    "row_map past y_perm": ("range", lambda: gl.unpermute(_x(4), _row_map()), "row_map", "4"),
    "row_map = -9": (
        "range", lambda: gl.unpermute(_x(5), _long([[0, 3], [1, -9], [4, 2]])), "row_map", "-9"),
    "row_map repeated": (
        "range", lambda: gl.unpermute(_x(5), _long([[0, 3], [1, -1], [3, 2]])), "row_map", "3"),
    "row_map repeated names both slots": (
        "range", lambda: gl.unpermute(_x(5), _long([[0, 3], [1, -1], [3, 2]])),
        "row_map[0, 1]", "row_map[2, 0]"),
    "topk_indices without probs": (
        "range", lambda: gl.unpermute(_x(5), _row_map(), topk_indices=_long([[0, 1]] * 3)),
        ("topk_indices", "probs"), None),
    "topk_indices=junk without probs": (
        "type", lambda: gl.unpermute(_x(5), _row_map(), topk_indices="junk"), "topk_indices",
        "junk"),
    "row_map uint8 past y_perm": (
        "range", lambda: gl.unpermute(_x(5), _long([[0, 3], [1, 200], [4, 2]]).to(torch.uint8)),
        "row_map", "200"),
    "probs=list": ("type", lambda: gl.unpermute(_x(5), _row_map(), [[1.0, 1.0]] * 3), "probs",
                   None),
    "integer y_perm weighted": (
        "dtype", lambda: gl.unpermute(_long([[1, 3]] * 5), _row_map(), torch.full((3, 2), 0.5)),
        "y_perm", "torch.int64"),
    "probs int": (
        "dtype", lambda: gl.unpermute(_x(5), _row_map(), torch.ones(3, 2, dtype=torch.long)),
        "probs", None),
    "probs bool": (
        "dtype", lambda: gl.unpermute(_x(5), _row_map(), torch.ones(3, 2, dtype=torch.bool)),
        "probs", None),
    "probs on meta": (
        "device", lambda: gl.unpermute(_x(5), _row_map(), torch.ones(3, 2, device="meta")),
        "probs", None),
    "probs shape": ("shape", lambda: gl.unpermute(_x(5), _row_map(), torch.ones(2, 3)), "probs",
                    None),
}

ALL_CASES = {f"pad_groups {k}": v for k, v in PAD_CASES.items()} | {
    f"unpad_groups {k}": v for k, v in UNPAD_CASES.items()} | {
    f"permute {k}": v for k, v in PERMUTE_CASES.items()} | {
    f"unpermute {k}": v for k, v in UNPERMUTE_CASES.items()}


@pytest.mark.parametrize("case", ALL_CASES)
def test_layout_op_rejects(case: str) -> None:
    kind, call, names, value = ALL_CASES[case]
    expect_rejected(kind, call, names, value=value)


def test_pad_and_unpad_2_31_rows_of_zero_width() -> None:
    """2**31 rows cost nothing at zero width: the ops work or refuse the sizes by name."""
    sizes = [2**31 - 5, 5, 0]

    def check_padded(result: object) -> None:
        xp, padded = result
        assert list(padded) == [2**31, 16, 0] and xp.shape == (2**31 + 16, 0)

    def check_unpadded(y: object) -> None:
        assert isinstance(y, torch.Tensor) and y.shape == (2**31, 0)

    for kind in (list, torch.tensor):
        rejected_or("range", lambda k=kind: gl.pad_groups(torch.empty(2**31, 0), k(sizes), 16),
                    ("m_splits", "x"), check_padded)
        rejected_or("range", lambda k=kind: gl.unpad_groups(
            torch.empty(2**31 + 16, 0), k(sizes), k([2**31, 16, 0])),
                    ("m_splits", "padded_splits", "yp"), check_unpadded)
