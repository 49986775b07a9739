"""Normalisation of m_splits into GroupSplits."""

import pytest
import torch

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
