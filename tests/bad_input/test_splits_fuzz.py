"""Generated malformed group sizes and input shapes, through every entry point that takes them.

Each test's example count is its ``fuzz(n)``; the examples are the same on every run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import grouped_linear as gl
from tests.bad_input.checks import expect_rejected, fuzz

K, N = 4, 3
CPU = torch.device("cpu")
ENTRIES = ("layer", "functional", "mlp", "pad_groups", "unpad m_splits", "unpad padded_splits",
           "GroupSplits")
SPLIT_KINDS = ("list", "tuple", "int64", "int32", "int16", "int8")
UNPAD_ROWS = 1000

# Things that are not a group size, and must be refused wherever a group size is expected.
NOT_A_SIZE = [None, "1", 1.0, 1.5, True, False, np.bool_(True), np.bool_(False), np.float32(1),
              [1], (1,), {"size": 1}, 1j, b"1", torch.tensor(1.0), torch.tensor(True),
              torch.tensor([1, 0])]


def _call(entry: str, sizes: object, num_groups: int, num_rows: int
          ) -> tuple[Callable[[], object], nn.Module | None, str]:
    """The call of ``entry`` with ``sizes`` as its group sizes over ``num_rows`` rows, the
    module whose state it must leave alone, and the name the error must give."""
    x = torch.randn(num_rows, K)
    if entry == "layer":
        layer = gl.GroupedLinear(num_groups, K, N, delay_wgrad_compute=True)
        return (lambda: layer(x, sizes)), layer, "m_splits"
    if entry == "functional":
        weight, bias = torch.randn(num_groups, N, K), torch.randn(num_groups, N)
        return (lambda: gl.grouped_linear(x, weight, bias, sizes)), None, "m_splits"
    if entry == "mlp":
        mlp = gl.GroupedMLP(num_groups, K, 2)
        return (lambda: mlp(x, sizes)), mlp, "m_splits"
    if entry == "pad_groups":
        return (lambda: gl.pad_groups(x, sizes, 2)), None, "m_splits"
    if entry == "unpad m_splits":
        # every padded group larger than any size drawn; num_rows given, so sums are checked
        yp = torch.randn(UNPAD_ROWS * num_groups, K)
        padded = [UNPAD_ROWS] * num_groups
        return (lambda: gl.unpad_groups(yp, sizes, padded, num_rows)), None, "m_splits"
    if entry == "unpad padded_splits":
        # m_splits all zero: any padded sizes summing to the rows are fine but the bad ones
        return (lambda: gl.unpad_groups(x, [0] * num_groups, sizes)), None, "padded_splits"
    return (lambda: gl.GroupSplits(num_groups, num_rows, CPU, sizes)), None, "host_sizes"


def _as_kind(sizes: list[int], kind: str) -> object:
    if kind == "list":
        return sizes
    if kind == "tuple":
        return tuple(sizes)
    return torch.tensor(sizes, dtype=getattr(torch, kind))


@fuzz(60)
@given(entry=st.sampled_from(ENTRIES), num_groups=st.integers(1, 5), data=st.data(),
       bad=st.sampled_from(NOT_A_SIZE))
def test_a_non_integer_size_anywhere(entry: str, num_groups: int, data: st.DataObject,
                                     bad: object) -> None:
    sizes: list[object] = [1] * num_groups
    position = data.draw(st.integers(0, num_groups - 1), label="position")
    sizes[position] = bad
    if entry == "GroupSplits":
        sizes = tuple(sizes)
    call, state, name = _call(entry, sizes, num_groups, num_groups)
    expect_rejected("type", call, name, state=state)


@fuzz(40)
@given(entry=st.sampled_from(ENTRIES), kind=st.sampled_from(SPLIT_KINDS),
       sizes=st.lists(st.integers(0, 3), min_size=2, max_size=5), data=st.data())
def test_a_negative_size_anywhere(entry: str, kind: str, sizes: list[int],
                                  data: st.DataObject) -> None:
    """One size made negative, another raised by as much: the sum stays the row count."""
    position = data.draw(st.integers(0, len(sizes) - 1), label="position")
    depth = data.draw(st.integers(1, 100), label="depth")
    other = (position + 1) % len(sizes)
    sizes = list(sizes)
    sizes[other] += sizes[position] + depth
    sizes[position] = -depth
    if entry == "GroupSplits":
        kind = "tuple"
    call, state, name = _call(entry, _as_kind(sizes, kind), len(sizes), sum(sizes))
    expect_rejected("range", call, name, state=state)


@fuzz(30)
@given(entry=st.sampled_from([e for e in ENTRIES if e != "pad_groups"]),
       kind=st.sampled_from(SPLIT_KINDS), num_groups=st.integers(1, 4), wrong=st.integers(0, 7))
def test_the_wrong_number_of_groups(entry: str, kind: str, num_groups: int, wrong: int) -> None:
    """(``pad_groups`` takes its group count from ``m_splits``: any count is right.)"""
    if wrong == num_groups:
        wrong = num_groups + 1
    if entry == "GroupSplits":
        kind = "tuple"
    call, state, name = _call(entry, _as_kind([1] * wrong, kind), num_groups, wrong)
    expect_rejected("shape", call, name, state=state)


@fuzz(30)
@given(entry=st.sampled_from(ENTRIES), kind=st.sampled_from(SPLIT_KINDS),
       sizes=st.lists(st.integers(0, 5), min_size=1, max_size=5),
       delta=st.integers(-5, 5).filter(bool))
def test_sizes_not_summing_to_the_rows(entry: str, kind: str, sizes: list[int],
                                       delta: int) -> None:
    num_rows = sum(sizes) + delta
    if num_rows < 0:
        num_rows = sum(sizes) - delta
    if entry == "GroupSplits":
        kind = "tuple"
    call, state, name = _call(entry, _as_kind(sizes, kind), len(sizes), num_rows)
    expect_rejected("range", call, name, state=state)


@fuzz(25)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       entry=st.sampled_from(("layer", "functional", "mlp", "pad_groups", "permute")))
def test_an_input_of_the_wrong_shape(shape: list[int], entry: str) -> None:
    """Any shape but ``(rows, K)`` (``pad_groups`` and ``permute`` take any 2-D input: theirs
    gets a third dimension); the splits cover the first dimension where there is one."""
    if len(shape) == 2 and shape[1] == K:
        shape[1] = K + 1
    x = torch.randn(shape)
    any_width = x.unsqueeze(-1) if x.dim() == 2 else x
    rows = shape[0] if shape else 1
    sizes = [rows, 0]
    layer = gl.GroupedLinear(2, K, N, delay_wgrad_compute=True)
    mlp = gl.GroupedMLP(2, K, 2)
    calls: dict[str, tuple[Callable[[], object], nn.Module | None]] = {
        "layer": (lambda: layer(x, sizes), layer),
        "functional": (lambda: gl.grouped_linear(x, torch.randn(2, N, K), None, sizes), None),
        "mlp": (lambda: mlp(x, sizes), mlp),
        "pad_groups": (lambda: gl.pad_groups(any_width, sizes), None),
        "permute": (lambda: gl.permute(any_width, torch.zeros(rows, 1, dtype=torch.int64), 2),
                    None),
    }
    call, state = calls[entry]
    expect_rejected("shape", call, "x", state=state)


INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@fuzz(30)
@given(dtype=st.sampled_from(INDEX_DTYPES), tokens=st.integers(1, 4), k=st.integers(1, 3),
       num_experts=st.integers(1, 4), data=st.data())
def test_a_bad_expert_index_anywhere(dtype: torch.dtype, tokens: int, k: int, num_experts: int,
                                     data: st.DataObject) -> None:
    """Valid indices everywhere but one slot, which holds ``num_experts`` or more (or less
    than -1 for signed dtypes), in every index dtype: the error names ``topk_indices`` and
    the bad value."""
    topk = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, num_experts - 1),
                                                    min_size=k, max_size=k),
                                           min_size=tokens, max_size=tokens), label="topk"))
    # at least 10 (or negative), so that the value cannot be mistaken for a slot or a count
    top = 127 if dtype == torch.int8 else 255 if dtype == torch.uint8 else 1000
    too_large = st.integers(10, top)
    bad = data.draw(st.one_of(too_large, st.integers(-128, -2)) if dtype.is_signed
                    else too_large, label="bad")
    slot = data.draw(st.integers(0, tokens * k - 1), label="slot")
    topk.view(-1)[slot] = bad
    topk = topk.to(dtype)
    expect_rejected("range", lambda: gl.permute(torch.randn(tokens, K), topk, num_experts),
                    "topk_indices", value=str(bad))
