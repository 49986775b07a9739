"""Normalisation of m_splits into GroupSplits."""

import itertools

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels.ends import group_ends, group_ends_reference
from grouped_linear.ops.checks import check_int
from grouped_linear.ops.splits import GroupSplits, debug_checks_enabled, normalize_splits


@pytest.mark.parametrize("splits", [[3, 0, 4], (3, 0, 4), torch.tensor([3, 0, 4]),
                                    torch.tensor([3, 0, 4], dtype=torch.int16)])
def test_host_kinds(splits):
    s = normalize_splits(splits, num_groups=3, num_rows=7, device=torch.device("cpu"))
    assert s.host_sizes == (3, 0, 4) and s.on_host and not s.may_have_tail
    assert s.ends.dtype == torch.int32 and s.ends.tolist() == [3, 3, 7]
    assert s.sizes_list() == [3, 0, 4] and s.host_ends().tolist() == [3, 3, 7]
    assert s.starts().tolist() == [0, 3, 3]


def test_numpy_ints_are_ints():
    np = pytest.importorskip("numpy")
    s = normalize_splits([np.int64(2), np.int32(5)], num_groups=2, num_rows=7,
                         device=torch.device("cpu"))
    assert s.host_sizes == (2, 5)


def test_normalised_splits_pass_through_and_are_checked():
    s = normalize_splits([1, 2], num_groups=2, num_rows=3, device=torch.device("cpu"))
    assert normalize_splits(s, num_groups=2, num_rows=3, device=torch.device("cpu")) is s
    with pytest.raises(ValueError, match="describes 2 groups over 3 rows, expected 2 groups over 4"):
        normalize_splits(s, num_groups=2, num_rows=4, device=torch.device("cpu"))
    assert isinstance(s, GroupSplits)


@pytest.mark.parametrize("args, match", [
    (((5, 5, 5),), "host_sizes sums to 15 but the input has 7 rows"),
    (((9, -2, 0),), r"host_sizes\[1\] is -2"),
    (((7,),), r"host_sizes=\(7,\) has 1 sizes but num_groups is 3"),
    ((None,), "exactly one of host_sizes and device_sizes"),
    ((None, torch.ones(2, dtype=torch.long)), r"device_sizes has shape \(2,\), expected \(3,\)"),
])
def test_hand_built_splits_are_checked(args, match):
    """A GroupSplits built by hand gets the checks normalize_splits applies to raw splits."""
    with pytest.raises(ValueError, match=match):
        GroupSplits(3, 7, torch.device("cpu"), *args)
    with pytest.raises(TypeError, match="device_sizes must be an integer tensor"):
        GroupSplits(3, 7, torch.device("cpu"), None, torch.ones(3))
    assert GroupSplits(3, 7, torch.device("cpu"), (2, 0, 5)).ends.tolist() == [2, 2, 7]


@pytest.mark.parametrize("value, enabled", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_debug_checks_follow_the_environment_at_every_call(monkeypatch, value, enabled):
    monkeypatch.delenv("GROUPED_LINEAR_DEBUG", raising=False)
    assert debug_checks_enabled() is False
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", value)
    assert debug_checks_enabled() is enabled
    monkeypatch.delenv("GROUPED_LINEAR_DEBUG")
    assert debug_checks_enabled() is False


@pytest.mark.parametrize("checked", [True, False])
def test_device_sizes_kept_dense(checked):
    table = torch.tensor([[3, 9], [0, 9], [4, 9]])
    s = GroupSplits(3, 7, torch.device("cpu"), None, table[:, 0], checked=checked)
    assert s.device_sizes.is_contiguous() and s.sizes.tolist() == [3, 0, 4]


# --- booleans are not group sizes, whatever their kind, at every entry point -------------

def _bool_splits():
    np = pytest.importorskip("numpy")
    return [[True, 2], [np.True_, 2], [np.array(True), 2], [torch.tensor(True), 2]]


_ENTRY_POINTS = {
    "GroupedLinear": lambda s: gl.GroupedLinear(2, 4, 3)(torch.randn(3, 4), s),
    "grouped_linear": lambda s: gl.grouped_linear(torch.randn(3, 4), torch.randn(2, 3, 4), None, s),
    "GroupedMLP": lambda s: gl.GroupedMLP(2, 4, 8)(torch.randn(3, 4), s),
    "pad_groups": lambda s: gl.pad_groups(torch.randn(3, 4), s),
    "unpad_groups m_splits": lambda s: gl.unpad_groups(torch.randn(3, 4), s, [1, 2]),
    "unpad_groups padded_splits": lambda s: gl.unpad_groups(torch.randn(3, 4), [1, 2], s),
}
_NAMES = {"unpad_groups padded_splits": "padded_splits"}


@pytest.mark.parametrize("entry", list(_ENTRY_POINTS))
def test_boolean_sizes_are_rejected_at_every_entry_point(entry):
    """A NumPy boolean passes operator.index (as 1): it must be rejected like a Python bool,
    with the same message naming the argument; so must a bool tensor."""
    name = _NAMES.get(entry, "m_splits")
    for splits in _bool_splits():
        with pytest.raises(TypeError, match=rf"{name}\[0\] is .*True.*: group sizes must be "
                                            "integers, not booleans"):
            _ENTRY_POINTS[entry](splits)
    with pytest.raises(TypeError, match=f"{name} is a bool tensor: group sizes must be integers, "
                                        "not booleans"):
        _ENTRY_POINTS[entry](torch.tensor([True, True]))


def test_boolean_sizes_are_rejected_by_hand_built_splits():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"host_sizes\[0\] is np.True_.*not booleans"):
        GroupSplits(2, 3, torch.device("cpu"), (np.True_, 2))
    with pytest.raises(TypeError, match="device_sizes is a bool tensor.*not booleans"):
        GroupSplits(2, 2, torch.device("cpu"), None, torch.tensor([True, True]))
    with pytest.raises(TypeError, match="num_rows is np.True_"):
        GroupSplits(1, np.True_, torch.device("cpu"), (1,))


def test_boolean_scalars_are_not_ints():
    np = pytest.importorskip("numpy")
    for value in (True, np.True_, np.array(True), torch.tensor(True)):
        with pytest.raises(TypeError, match="num_experts is .*True.*: expected an int >= 1"):
            check_int("num_experts", value)
    assert check_int("num_experts", np.int64(3)) == 3


# --- sizes past int32 ----------------------------------------------------------------------

def test_host_sizes_past_int32_keep_their_values():
    """A group of 2**31 rows or more: ends and sizes are int64 (no allocation of the rows)."""
    sizes = [2**31, 5, 0, 2**32]
    s = normalize_splits(sizes, num_groups=4, num_rows=sum(sizes), device=torch.device("cpu"))
    want = list(itertools.accumulate(sizes))
    assert s.ends.dtype == torch.int64 and s.ends.tolist() == want
    assert s.sizes.tolist() == sizes and s.host_ends().tolist() == want
    assert GroupSplits(4, sum(sizes), "cpu", tuple(sizes)).ends.tolist() == want


def test_device_sizes_past_int32_keep_their_values():
    """group_ends (what device splits go through) clamps in int64 and keeps int64 ends when
    the row count is past int32."""
    sizes = torch.tensor([2**31, -3, 7, 2**31])
    num_rows = 2**31 + 10
    want = sizes.tolist()
    want = [min(num_rows, sum(max(v, 0) for v in want[: i + 1])) for i in range(len(want))]
    for ends in (group_ends(sizes, num_rows), group_ends_reference(sizes, num_rows)):
        assert ends.dtype == torch.int64 and ends.tolist() == want
    assert group_ends(torch.tensor([3, 4]), 7).dtype == torch.int32


# --- the device of hand-built splits -------------------------------------------------------

def test_device_given_as_a_string():
    """A GroupSplits built with device="cpu" is on the CPU (not a string unequal to it)."""
    s = GroupSplits(2, 3, "cpu", [1, 2])
    assert s.device == torch.device("cpu") and s.host_sizes == (1, 2)
    assert normalize_splits(s, num_groups=2, num_rows=3, device=torch.device("cpu")) is s
    with pytest.raises(ValueError, match="m_splits was built for cpu but the input is on meta"):
        normalize_splits(s, num_groups=2, num_rows=3, device=torch.device("meta"))
    with pytest.raises(TypeError, match="device is 'nowhere'"):
        GroupSplits(2, 3, "nowhere", (1, 2))
    with pytest.raises(ValueError, match="device_sizes is on cpu but device is meta"):
        GroupSplits(2, 3, "meta", None, torch.tensor([1, 2]))


def test_split_tensor_of_another_device_is_rejected_before_reading():
    """Meta tensors have no values: reading one would fail with another error."""
    with pytest.raises(ValueError, match="m_splits is on meta but the input is on cpu"):
        normalize_splits(torch.tensor([1, 2], device="meta"), num_groups=2, num_rows=3,
                         device=torch.device("cpu"))
