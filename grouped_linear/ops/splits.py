"""One normalised form of the user's ``m_splits``, built once per call.

Every op receives a :class:`GroupSplits`: the group count, the row count, the group
``sizes`` (per-group row counts) and their ``ends`` (cumulative sums, what the GEMM
kernels index with) on the compute device and, when the sizes are known on the host,
the sizes as Python ints (what the per-group loop and exact-size allocations use).
"""

from __future__ import annotations

import array
import itertools
import operator
import os
from collections.abc import Sequence
from dataclasses import InitVar, dataclass

import torch

from ..kernels.ends import group_ends

__all__ = ["GroupSplits", "normalize_splits", "debug_checks_enabled", "SPLIT_DTYPES"]

SPLIT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _int32_tensor(values) -> torch.Tensor:
    """A CPU int32 tensor of Python ints, built from a buffer (a few times faster than
    ``torch.tensor`` on a list, which converts element by element); ``torch.tensor`` while
    torch.compile traces (it cannot trace the buffer)."""
    if torch.compiler.is_compiling():
        return torch.tensor(list(values), dtype=torch.int32)
    buffer = array.array("i", values)
    return torch.frombuffer(buffer, dtype=torch.int32) if buffer else torch.empty(0, dtype=torch.int32)


# ``os.environ.get`` encodes the name and decodes the value on every call (~1 µs, read on
# every call of a host-bound small step); CPython keeps the encoded pairs in ``_data``,
# which ``os.environ``'s writes (``monkeypatch.setenv`` included) update.
_ENVIRON_STORE = getattr(os.environ, "_data", None)
_DEBUG_VARIABLE = "GROUPED_LINEAR_DEBUG"
_DEBUG_KEY = os.environ.encodekey(_DEBUG_VARIABLE) if _ENVIRON_STORE is not None else None


def debug_checks_enabled() -> bool:
    """Whether ``GROUPED_LINEAR_DEBUG`` is set to something other than empty or ``0``: checks
    that need a host sync (read at every call)."""
    if _ENVIRON_STORE is None or torch.compiler.is_compiling():
        return os.environ.get(_DEBUG_VARIABLE, "0") not in ("", "0")
    value = _ENVIRON_STORE.get(_DEBUG_KEY)
    return value is not None and value not in (b"", b"0", "", "0")


@dataclass(frozen=True)
class GroupSplits:
    """Row partition of an ``(M, features)`` tensor into ``G`` consecutive groups.

    Attributes:
        num_groups: ``G``.
        num_rows: ``M``, the rows of the tensor being split.
        device: the compute device.
        host_sizes: the group sizes as Python ints when they are known on the
            host (then they sum to ``M``), else ``None`` (device splits, which
            may sum to less than ``M``: rows past the sum belong to no group).
        device_sizes: the user's ``(G,)`` integer split tensor for device
            splits (unclamped: kernels clamp), else ``None``.

    Derived on first use, then cached: ``ends`` (``(G,)`` int32 cumulative group
    ends on the device, non-decreasing, clamped to ``[0, M]``) and ``sizes`` (the
    sizes as a ``(G,)`` device tensor; device splits as given, unclamped).
    """

    num_groups: int
    num_rows: int
    device: torch.device
    host_sizes: tuple[int, ...] | None
    device_sizes: torch.Tensor | None = None
    # normalize_splits passes ``checked=True``: it has validated the sizes already.
    checked: InitVar[bool] = False

    def __post_init__(self, checked: bool) -> None:
        # A GroupSplits may also be built by hand: hold it to what normalize_splits checks.
        if not checked:
            self._check()
        sizes = self.device_sizes
        if sizes is not None and not sizes.is_contiguous():
            # The kernels read the sizes as a dense vector: a strided view (a column of a
            # per-expert table) would be read as other values.
            object.__setattr__(self, "device_sizes", sizes.contiguous())

    def _check(self) -> None:
        if (self.host_sizes is None) == (self.device_sizes is None):
            raise ValueError("GroupSplits takes exactly one of host_sizes and device_sizes, got "
                             f"host_sizes={self.host_sizes!r}, device_sizes={self.device_sizes!r}")
        if self.host_sizes is not None:
            sizes = _host_sizes_from_sequence(self.host_sizes, "host_sizes")
            if len(sizes) != self.num_groups:
                raise ValueError(f"host_sizes={self.host_sizes!r} has {len(sizes)} sizes but "
                                 f"num_groups is {self.num_groups}")
            _check_host_sizes(sizes, self.num_rows, "host_sizes")
            return
        sizes = self.device_sizes
        if not isinstance(sizes, torch.Tensor) or sizes.dtype not in SPLIT_DTYPES:
            raise TypeError(f"device_sizes must be an integer tensor, got {sizes!r}")
        if sizes.shape != (self.num_groups,):
            raise ValueError(f"device_sizes has shape {tuple(sizes.shape)}, expected "
                             f"({self.num_groups},)")

    @property
    def ends(self) -> torch.Tensor:
        cached = self.__dict__.get("_ends")
        if cached is None:
            if self.host_sizes is None:
                cached = group_ends(self.device_sizes, self.num_rows)
            else:
                ends = _int32_tensor(itertools.accumulate(self.host_sizes))
                cached = ends if self.device.type == "cpu" else ends.to(self.device, non_blocking=True)
            object.__setattr__(self, "_ends", cached)
        return cached

    @property
    def sizes(self) -> torch.Tensor:
        if self.host_sizes is None:
            return self.device_sizes
        cached = self.__dict__.get("_sizes")
        if cached is None:
            cached = _int32_tensor(self.host_sizes)
            if self.device.type != "cpu":
                cached = cached.to(self.device, non_blocking=True)
            object.__setattr__(self, "_sizes", cached)
        return cached

    @property
    def on_host(self) -> bool:
        return self.host_sizes is not None

    @property
    def may_have_tail(self) -> bool:
        """True when some rows may belong to no group (device splits)."""
        return self.host_sizes is None

    def sizes_list(self) -> list[int]:
        """Group sizes as Python ints (synchronizes for device splits)."""
        if self.host_sizes is not None:
            return list(self.host_sizes)
        ends = self.ends.tolist()
        return [end - start for start, end in zip([0] + ends[:-1], ends)]

    def host_ends(self) -> torch.Tensor:
        """``(G,)`` int64 CPU tensor of group ends (synchronizes for device splits)."""
        if self.host_sizes is not None:
            return torch.tensor(self.host_sizes, dtype=torch.int64).cumsum(0)
        return self.ends.to("cpu", torch.int64)

    def starts(self) -> torch.Tensor:
        """``(G,)`` group starts on the compute device."""
        return torch.cat([self.ends.new_zeros(1), self.ends[:-1]])


def _check_host_sizes(sizes: list[int], num_rows: int | None, name: str) -> None:
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"{name}[{i}] is {size}: group sizes must be non-negative")
    if num_rows is not None and sum(sizes) != num_rows:
        raise ValueError(
            f"{name} sums to {sum(sizes)} but the input has {num_rows} rows "
            f"(host splits must sum to the row count)"
        )


def _host_sizes_from_sequence(m_splits: Sequence, name: str) -> list[int]:
    sizes = []
    for i, value in enumerate(m_splits):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = value.item()
        try:
            if isinstance(value, bool):
                raise TypeError
            sizes.append(operator.index(value))
        except TypeError:
            raise TypeError(
                f"{name}[{i}] is {value!r} of type {type(value).__name__}: splits must be integers"
            ) from None
    return sizes


def normalize_splits(
    m_splits: Sequence[int] | torch.Tensor | GroupSplits,
    *,
    num_groups: int,
    num_rows: int,
    device: torch.device,
    name: str = "m_splits",
) -> GroupSplits:
    """Validate ``m_splits`` and build the :class:`GroupSplits` every op uses.

    Args:
        m_splits: a sequence of ``G`` Python ints, a 1-D integer tensor of
            shape ``(G,)`` on any device, or an already normalised
            :class:`GroupSplits` (checked against ``num_groups``/``num_rows``).
        num_groups: expected ``G``.
        num_rows: ``M``, the input's row count.
        device: the compute device (where ``ends`` and ``sizes`` are placed).

    Host splits (sequences and CPU tensors) are checked in full. Device splits
    are only clamped (never read back) unless ``GROUPED_LINEAR_DEBUG=1``.
    """
    if isinstance(m_splits, GroupSplits):
        if m_splits.num_groups != num_groups or m_splits.num_rows != num_rows:
            raise ValueError(
                f"{name} describes {m_splits.num_groups} groups over {m_splits.num_rows} rows, "
                f"expected {num_groups} groups over {num_rows} rows"
            )
        if m_splits.device != device:
            raise ValueError(f"{name} is on {m_splits.device} but the input is on {device}")
        return m_splits
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype not in SPLIT_DTYPES:
            raise TypeError(f"{name} has dtype {m_splits.dtype}: splits must be an integer tensor")
        if m_splits.dim() != 1:
            raise ValueError(f"{name} has shape {tuple(m_splits.shape)}: expected a 1-D tensor")
        if m_splits.numel() != num_groups:
            raise ValueError(
                f"{name} has length {m_splits.numel()} but num_gemms is {num_groups}"
            )
        if torch.compiler.is_compiling():
            # Traced: never read split values on the host (that would break the graph
            # and specialise on them); treat them as device splits, clamped in the graph.
            return GroupSplits(num_groups, num_rows, device, None, m_splits.to(device),
                               checked=True)
        if m_splits.device.type == "cpu":
            sizes = [int(v) for v in m_splits.tolist()]
        else:
            if device.type == "cpu":
                raise ValueError(
                    f"{name} is on {m_splits.device} but the input is on {device}: "
                    "device splits must live on the input's device"
                )
            if m_splits.device != device:
                raise ValueError(f"{name} is on {m_splits.device} but the input is on {device}")
            if debug_checks_enabled():
                _check_host_sizes([int(v) for v in m_splits.tolist()], None, name)
                if int(m_splits.sum()) > num_rows:
                    raise ValueError(
                        f"{name} sums to {int(m_splits.sum())}, more than the {num_rows} input rows"
                    )
            return GroupSplits(num_groups, num_rows, device, None, m_splits, checked=True)
    elif isinstance(m_splits, (list, tuple)):
        if len(m_splits) != num_groups:
            raise ValueError(f"{name} has length {len(m_splits)} but num_gemms is {num_groups}")
        sizes = _host_sizes_from_sequence(m_splits, name)
    else:
        raise TypeError(
            f"{name} is {type(m_splits).__name__}: expected a list of ints or an integer tensor"
        )
    _check_host_sizes(sizes, num_rows, name)
    return GroupSplits(num_groups, num_rows, device, tuple(sizes), checked=True)
