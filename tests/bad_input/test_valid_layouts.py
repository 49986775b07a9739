"""Valid but unusual calls of the layout ops (no rows, empty groups, one group, one column,
narrow index dtypes, every slot dropped), against the float64 loop reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import grouped_linear as gl
from tests.bad_input import reference
from tests.bad_input.checks import count, fuzz

F64 = torch.float64
SPLIT_KINDS = ("list", "int64", "int32", "int16", "int8", "uint8")
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _splits(sizes: list[int], kind: str) -> object:
    return list(sizes) if kind == "list" else torch.tensor(sizes, dtype=getattr(torch, kind))


def _check_pad_round_trip(sizes: list[int], multiple: int, cols: int, kind: str) -> None:
    count("valid")
    x = torch.randn(sum(sizes), cols, dtype=F64, requires_grad=True)
    xp, padded = gl.pad_groups(x, _splits(sizes, kind), multiple)
    xp_ref, padded_ref = reference.pad(x.detach(), sizes, multiple)
    assert list(padded) == padded_ref
    assert isinstance(padded, list) == (kind == "list")
    torch.testing.assert_close(xp, xp_ref, rtol=0, atol=0)
    grad = torch.randn_like(xp)
    xp.backward(grad)
    torch.testing.assert_close(x.grad, reference.unpad(grad, sizes, padded_ref), rtol=0, atol=0)

    yp = xp_ref.clone().requires_grad_()
    y = gl.unpad_groups(yp, _splits(sizes, kind), padded, sum(sizes))
    torch.testing.assert_close(y, reference.unpad(xp_ref, sizes, padded_ref), rtol=0, atol=0)
    y.backward(x.detach())
    torch.testing.assert_close(yp.grad, reference.pad(x.detach(), sizes, multiple)[0],
                               rtol=0, atol=0)


PAD_CASES = {"no rows": ([0, 0], 4, 2), "one group": ([3], 4, 2), "one column": ([2, 0, 3], 4, 1),
             "multiple 1": ([2, 0, 3], 1, 2), "aligned already": ([4, 8], 4, 2)}


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("case", PAD_CASES)
def test_pad_and_unpad_unusual_calls_match_the_reference(case: str, kind: str) -> None:
    sizes, multiple, cols = PAD_CASES[case]
    _check_pad_round_trip(sizes, multiple, cols, kind)


@fuzz(20)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4), multiple=st.integers(1, 5),
       cols=st.integers(1, 2), kind=st.sampled_from(SPLIT_KINDS))
def test_pad_and_unpad_any_valid_sizes_match_the_reference(sizes: list[int], multiple: int,
                                                           cols: int, kind: str) -> None:
    _check_pad_round_trip(sizes, multiple, cols, kind)


def _check_permute(topk: list[list[int]], tokens: int, k: int, num_experts: int, multiple: int,
                   dtype: torch.dtype, cols: int = 2) -> None:
    """``permute`` and its gradient, then ``unpermute`` of its layout with its row map in the
    same dtype (where that holds the map), each against the float64 loops."""
    count("valid")
    indices = torch.tensor(topk, dtype=torch.int64).view(tokens, k)
    x = torch.randn(tokens, cols, dtype=F64, requires_grad=True)
    x_perm, m_splits, row_map = gl.permute(x, indices.to(dtype), num_experts, multiple)
    x_leaf = x.detach().clone().requires_grad_()
    x_ref, sizes_ref, map_ref = reference.permute(x_leaf, indices, num_experts, multiple)
    assert m_splits.tolist() == sizes_ref and row_map.tolist() == map_ref
    torch.testing.assert_close(x_perm, x_ref, rtol=0, atol=0)
    grad = torch.randn_like(x_ref)
    x_perm.backward(grad)
    x_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_leaf.grad)

    probs = torch.rand(tokens, k, dtype=F64)
    narrow = row_map.to(dtype) if dtype.is_signed or not bool((row_map < 0).any()) else row_map
    out = gl.unpermute(x_ref.detach(), narrow, probs)
    torch.testing.assert_close(out, reference.unpermute(x_ref.detach(), map_ref, probs))


# name: (topk, tokens, k, num_experts, multiple)
PERMUTE_CASES = {
    "no tokens": ([], 0, 2, 3, 4),
    "one expert": ([[0], [0], [0]], 3, 1, 1, 1),
    "every slot dropped": ([[-1, -1], [-1, -1]], 2, 2, 2, 1),
    "padded to 4": ([[0, 2], [2, 1], [1, 0]], 3, 2, 3, 4),
    "unused experts": ([[3], [3]], 2, 1, 5, 2),
}
PERMUTE_PARAMS = [(case, dtype) for case, (topk, *_) in PERMUTE_CASES.items()
                  for dtype in INDEX_DTYPES
                  if dtype.is_signed or all(v >= 0 for row in topk for v in row)]


@pytest.mark.parametrize("case, dtype", PERMUTE_PARAMS, ids=[f"{c}-{d}" for c, d in PERMUTE_PARAMS])
def test_permute_unusual_calls_match_the_reference(case: str, dtype: torch.dtype) -> None:
    _check_permute(*PERMUTE_CASES[case], dtype)


@fuzz(20)
@given(tokens=st.integers(0, 4), k=st.integers(1, 3), num_experts=st.integers(1, 4),
       multiple=st.integers(1, 4), dtype=st.sampled_from(INDEX_DTYPES), data=st.data())
def test_permute_any_valid_routing_matches_the_reference(tokens: int, k: int, num_experts: int,
                                                         multiple: int, dtype: torch.dtype,
                                                         data: st.DataObject) -> None:
    lowest = -1 if dtype.is_signed else 0
    topk = data.draw(st.lists(st.lists(st.integers(lowest, num_experts - 1), min_size=k,
                                       max_size=k), min_size=tokens, max_size=tokens))
    _check_permute(topk, tokens, k, num_experts, multiple, dtype)
