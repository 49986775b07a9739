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

from ..kernels.ends import ends_dtype, group_ends
from .checks import MAX_ROWS, check_int, is_bool

__all__ = ["GroupSplits", "normalize_splits", "check_split_kind", "host_split_sizes",
           "debug_checks_enabled", "SPLIT_DTYPES"]

SPLIT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_NOT_BOOLEANS = "group sizes must be integers, not booleans"


def _host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A CPU ``int32`` or ``int64`` tensor of Python ints, built from a buffer (a few times
    faster than ``torch.tensor`` on a list, which converts element by element);
    ``torch.tensor`` while torch.compile traces (it cannot trace the buffer)."""
    if torch.compiler.is_compiling():
        return torch.tensor(list(values), dtype=dtype)
    buffer = array.array("i" if dtype == torch.int32 else "q", values)
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)


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

    Derived on first use, then cached: ``ends`` (``(G,)`` cumulative group ends on
    the device, non-decreasing, clamped to ``[0, M]``; int32, or int64 when ``M`` is
    past what int32 holds) and ``sizes`` (the sizes as a ``(G,)`` device tensor of the
    same dtype; device splits as given, unclamped).

    Built by hand (without ``checked=True``), the fields are checked as
    :func:`normalize_splits` checks raw splits: ``device`` may be a string (``"cuda"``
    stands for the current CUDA device) and ``host_sizes`` any sequence of integers
    (kept as a tuple of Python ints).
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
        object.__setattr__(self, "num_groups", check_int("num_groups", self.num_groups, 0))
        object.__setattr__(self, "num_rows",
                           check_int("num_rows", self.num_rows, 0, maximum=MAX_ROWS))
        object.__setattr__(self, "device", _device(self.device))
        if (self.host_sizes is None) == (self.device_sizes is None):
            raise ValueError("GroupSplits takes exactly one of host_sizes and device_sizes, got "
                             f"host_sizes={self.host_sizes!r}, device_sizes={self.device_sizes!r}")
        if self.host_sizes is not None:
            if not isinstance(self.host_sizes, (list, tuple)):
                raise TypeError(f"host_sizes is {type(self.host_sizes).__name__}: expected a "
                                "tuple of ints")
            sizes = _host_sizes_from_sequence(self.host_sizes, "host_sizes")
            if len(sizes) != self.num_groups:
                raise ValueError(f"host_sizes={self.host_sizes!r} has {len(sizes)} sizes but "
                                 f"num_groups is {self.num_groups}")
            _check_host_sizes(sizes, self.num_rows, "host_sizes")
            object.__setattr__(self, "host_sizes", tuple(sizes))
            return
        sizes = self.device_sizes
        if is_bool(sizes):
            raise TypeError(f"device_sizes is a bool tensor: {_NOT_BOOLEANS}")
        if not isinstance(sizes, torch.Tensor) or sizes.dtype not in SPLIT_DTYPES:
            raise TypeError(f"device_sizes must be an integer tensor, got {sizes!r}")
        if sizes.shape != (self.num_groups,):
            raise ValueError(f"device_sizes has shape {tuple(sizes.shape)}, expected "
                             f"({self.num_groups},)")
        if sizes.device != self.device:
            raise ValueError(f"device_sizes is on {sizes.device} but device is {self.device}")

    @property
    def ends(self) -> torch.Tensor:
        cached = self.__dict__.get("_ends")
        if cached is None:
            if self.host_sizes is None:
                cached = group_ends(self.device_sizes, self.num_rows)
            else:
                ends = _host_tensor(itertools.accumulate(self.host_sizes),
                                    ends_dtype(self.num_rows))
                cached = ends if self.device.type == "cpu" else ends.to(self.device, non_blocking=True)
            object.__setattr__(self, "_ends", cached)
        return cached

    @property
    def sizes(self) -> torch.Tensor:
        if self.host_sizes is None:
            return self.device_sizes
        cached = self.__dict__.get("_sizes")
        if cached is None:
            cached = _host_tensor(self.host_sizes, ends_dtype(self.num_rows))
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


def _device(device: object) -> torch.device:
    """``device`` as a ``torch.device``; ``"cuda"`` (no index) as the current CUDA device,
    the one a CUDA tensor reports."""
    try:
        result = torch.device(device)
    except (TypeError, RuntimeError):
        raise TypeError(f"device is {device!r}: expected a torch.device or a device string"
                        ) from None
    if result.type == "cuda" and result.index is None and torch.cuda.is_available():
        result = torch.device("cuda", torch.cuda.current_device())
    return result


def _check_host_sizes(sizes: list[int], num_rows: int | None, name: str) -> None:
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"{name}[{i}] is {size}: group sizes must be non-negative")
    if num_rows is not None and sum(sizes) != num_rows:
        raise ValueError(
            f"{name} sums to {sum(sizes)} but the input has {num_rows} rows "
            f"(host splits must sum to the row count)"
        )


def _host_size(value: object, name: str, i: int) -> int:
    """One entry of a sequence of splits as a Python int (a one-element integer tensor is
    read); booleans of every kind are rejected, although NumPy's pass ``operator.index``."""
    if is_bool(value):
        raise TypeError(f"{name}[{i}] is {value!r} of type {type(value).__name__}: "
                        f"{_NOT_BOOLEANS}")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}[{i}] is {value!r} of type {type(value).__name__}: splits must be integers"
        ) from None


def _host_sizes_from_sequence(m_splits: Sequence, name: str) -> list[int]:
    # Python ints (the common case) go straight through.
    return [value if type(value) is int else _host_size(value, name, i)
            for i, value in enumerate(m_splits)]


def check_split_kind(m_splits: object, name: str, device: torch.device) -> int:
    """The group count of raw splits, after checking what they are without reading a value:
    a list or tuple, or a 1-D integer tensor on the CPU or on ``device`` (``TypeError`` or
    ``ValueError`` naming ``name`` otherwise)."""
    if isinstance(m_splits, (list, tuple)):
        return len(m_splits)
    if not isinstance(m_splits, torch.Tensor):
        raise TypeError(
            f"{name} is {type(m_splits).__name__}: expected a list of ints or an integer tensor"
        )
    if m_splits.dtype == torch.bool:
        raise TypeError(f"{name} is a bool tensor: {_NOT_BOOLEANS}")
    if m_splits.dtype not in SPLIT_DTYPES:
        raise TypeError(f"{name} has dtype {m_splits.dtype}: splits must be an integer tensor")
    if m_splits.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(m_splits.shape)}: expected a 1-D tensor")
    if m_splits.device.type != "cpu" and m_splits.device != device:
        raise ValueError(
            f"{name} is on {m_splits.device} but the input is on {device}: "
            "split tensors must be on the CPU or on the input's device"
        )
    return m_splits.numel()


def host_split_sizes(m_splits: Sequence[int] | torch.Tensor, name: str) -> list[int] | None:
    """The sizes of host splits (a sequence, or a CPU tensor, that :func:`check_split_kind`
    has passed) as Python ints, checked non-negative; ``None`` for a device tensor (not read)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device.type != "cpu":
            return None
        sizes = m_splits.tolist()
    else:
        sizes = _host_sizes_from_sequence(m_splits, name)
    _check_host_sizes(sizes, None, name)
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
            shape ``(G,)`` on the CPU or on ``device``, or an already normalised
            :class:`GroupSplits` (checked against ``num_groups``/``num_rows``).
        num_groups: expected ``G``.
        num_rows: ``M``, the input's row count.
        device: the compute device (where ``ends`` and ``sizes`` are placed).

    What the splits are (type, dtype, shape, device) is checked before any value
    is read. Host splits (sequences and CPU tensors) are checked in full. Device
    splits are only clamped (never read back) unless ``GROUPED_LINEAR_DEBUG=1``.
    """
    if isinstance(m_splits, GroupSplits):
        if m_splits.num_groups != num_groups or m_splits.num_rows != num_rows:
            raise ValueError(
                f"{name} describes {m_splits.num_groups} groups over {m_splits.num_rows} rows, "
                f"expected {num_groups} groups over {num_rows} rows"
            )
        if m_splits.device != device:
            raise ValueError(f"{name} was built for {m_splits.device} but the input is on {device}")
        return m_splits
    count = check_split_kind(m_splits, name, device)
    if count != num_groups:
        raise ValueError(f"{name} has length {count} but num_gemms is {num_groups}")
    if isinstance(m_splits, torch.Tensor):
        if torch.compiler.is_compiling():
            # Traced: never read split values on the host (that would break the graph
            # and specialise on them); treat them as device splits, clamped in the graph.
            return GroupSplits(num_groups, num_rows, device, None, m_splits.to(device),
                               checked=True)
        if m_splits.device.type != "cpu":
            if debug_checks_enabled():
                _check_host_sizes(m_splits.tolist(), None, name)
                if int(m_splits.sum()) > num_rows:
                    raise ValueError(
                        f"{name} sums to {int(m_splits.sum())}, more than the {num_rows} input rows"
                    )
            return GroupSplits(num_groups, num_rows, device, None, m_splits, checked=True)
        sizes = m_splits.tolist()
    else:
        sizes = _host_sizes_from_sequence(m_splits, name)
    _check_host_sizes(sizes, num_rows, name)
    return GroupSplits(num_groups, num_rows, device, tuple(sizes), checked=True)
