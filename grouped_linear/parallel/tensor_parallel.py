"""Tensor parallelism for grouped linear layers, over a ``torch.distributed`` group.

``column``: each rank holds a slice of ``out_features`` (of each of ``column_chunks``
equal blocks, so a gated MLP keeps matching gate and up slices); the input is
replicated, its gradient all-reduced. ``row``: each rank holds a slice of
``in_features``; the input arrives sharded, the partial outputs are all-reduced
(unless ``reduce_output=False``: then the caller reduces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["TensorParallel", "check_tp_size", "check_tp_group", "copy_to_tp_region",
           "reduce_from_tp_region"]


def check_tp_size(size: object) -> int:
    """``tp_size`` as given, or ``ValueError`` naming it when it is not an int >= 1."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tp_size={size!r} must be an int >= 1")
    return size


def check_tp_group(group: object) -> object | None:
    """``tp_group`` as given, or ``TypeError`` naming it when it is neither ``None`` nor a
    ``torch.distributed`` process group."""
    if group is None:
        return None
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"tp_group must be None or a torch.distributed ProcessGroup, got {group!r} of type "
            f"{type(group).__name__}"
        )
    return group


MODES = (None, "column", "row")


@dataclass(frozen=True)
class TensorParallel:
    """How one layer is sharded: ``mode`` (``None``, ``"column"``, ``"row"``), ``size``
    ranks, this ``rank`` in ``group``, whether row mode all-reduces its output, and
    how many independently sharded blocks ``out_features`` has (column mode)."""

    mode: str | None = None
    size: int = 1
    rank: int = 0
    group: object | None = None
    reduce_output: bool = True
    column_chunks: int = 1

    @classmethod
    def create(cls, mode: str | None, size: int, group: object | None, reduce_output: bool,
               column_chunks: int, in_features: int, out_features: int) -> TensorParallel:
        """Validate the constructor arguments of a layer and read the rank."""
        if mode is not None and (not isinstance(mode, str) or mode not in MODES):
            raise ValueError(f"parallel_mode={mode!r} is not one of {MODES}")
        check_tp_size(size)
        check_tp_group(group)
        if mode is None:
            if size != 1:
                raise ValueError(f"tp_size={size} needs parallel_mode='column' or 'row'")
            if group is not None:
                raise ValueError(f"tp_group={group!r} needs parallel_mode='column' or 'row'")
            return cls()
        rank = 0
        if size > 1 or group is not None:
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError(
                    f"tp_size={size} with tp_group={group!r} needs an initialised "
                    "torch.distributed process group"
                )
            world = dist.get_world_size(group)
            if world != size:
                raise ValueError(f"tp_size={size} but tp_group has {world} ranks")
            rank = dist.get_rank(group)
        if mode == "column" and out_features % (size * column_chunks):
            raise ValueError(
                f"out_features={out_features} is not divisible by tp_size={size}"
                + (f" x {column_chunks} blocks" if column_chunks > 1 else "")
            )
        if mode == "row" and in_features % size:
            raise ValueError(f"in_features={in_features} is not divisible by tp_size={size}")
        return cls(mode, size, rank, group, bool(reduce_output), column_chunks)

    @property
    def bias_after_leave(self) -> bool:
        """Row mode: the bias goes on after the partial outputs are reduced."""
        return self.mode == "row"

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input as its GEMM reads it: column mode replicates it (the gradient is
        all-reduced in backward), row mode takes it as it comes (already sharded)."""
        return copy_to_tp_region(x, self.group) if self.mode == "column" else x

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """The GEMM's output as the layer returns it: row mode all-reduces the partial outputs
        unless ``reduce_output=False`` (the caller reduces)."""
        if self.mode == "row" and self.reduce_output:
            return reduce_from_tp_region(out, self.group)
        return out

    def local_features(self, in_features: int, out_features: int) -> tuple[int, int]:
        """``(in, out)`` of this rank's parameters."""
        if self.mode == "column":
            return in_features, out_features // self.size
        if self.mode == "row":
            return in_features // self.size, out_features
        return in_features, out_features

    def shard_weight(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``(out, in)`` expert weight."""
        if self.mode == "column":
            return self._shard_rows(full)
        if self.mode == "row":
            return full.chunk(self.size, dim=1)[self.rank]
        return full

    def shard_bias(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``(out,)`` bias (row mode keeps it whole)."""
        return self._shard_rows(full) if self.mode == "column" else full

    def _shard_rows(self, full: torch.Tensor) -> torch.Tensor:
        blocks = full.chunk(self.column_chunks, dim=0)
        return torch.cat([b.chunk(self.size, dim=0)[self.rank] for b in blocks], dim=0)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp_region(x: torch.Tensor, group: object | None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (a replicated input)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(y: torch.Tensor, group: object | None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (partial outputs of row shards)."""
    return _ReduceFromRegion.apply(y, group)
