"""The routing inputs of ``permute``: routing maps, top-1 indices, capacity and output limits.

``permute`` takes the routing as ``(T, k)`` expert indices, a boolean ``(T, E)`` routing map
or ``(T,)`` top-1 indices, and may drop slots past a per-expert capacity or past a number of
output rows. The functions here check those arguments (``check_*``) and turn every form into
the ``(T, k)`` indices, ``-1`` for a dropped slot, that the routing map of
:mod:`grouped_linear.kernels.routing` consumes. The conversions are device tensor ops (sorts,
prefix searches, scatters into unique places): nothing is read on the host, so CUDA inputs
never synchronize, and CPU results are exact.

A slot is one entry of the ``(T, k)`` indices: slot ``s = t*k + j``. A routing map's slot
``(t, e)`` (``s = t*E + e``) is expert ``e`` where the map is set, dropped elsewhere.
"""

from __future__ import annotations

import math

import torch

from grouped_linear.ops.checks import MAX_ROWS, check_int, is_bool
from grouped_linear.ops.splits import SPLIT_DTYPES

__all__ = ["DROP_POLICIES", "check_routing", "check_not_mask", "check_probs",
           "check_num_out_tokens", "check_capacity", "check_drop_policy",
           "check_pad_to_capacity", "slot_experts", "permute_probs", "gather_dense_probs"]

DROP_POLICIES = ("probs", "position")


# --------------------------------------------------------------------------- checks
def check_routing(routing: object, tokens: int, device: torch.device, name: str = "topk_indices",
                  against: str = "x") -> torch.Tensor:
    """``routing`` if it is a ``(T, k)`` or ``(T,)`` integer tensor or a 2-D bool tensor
    with ``T = tokens`` rows on ``device``; ``TypeError``/``ValueError`` naming ``name``.
    (A map's column count is checked against ``num_experts`` by the caller.)"""
    if not isinstance(routing, torch.Tensor):
        raise TypeError(f"{name} is {type(routing).__name__}: expected an integer torch.Tensor "
                        "(T, k) or (T,), or a bool routing map (T, E)")
    is_map = routing.dtype == torch.bool
    if not is_map and routing.dtype not in SPLIT_DTYPES:
        raise TypeError(f"{name} has dtype {routing.dtype}: expected an integer tensor (T, k) "
                        "or (T,), or a bool routing map (T, E)")
    if is_map and routing.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(routing.shape)}: a bool routing map must be "
                         "2-D (T, E)")
    if routing.dim() not in (1, 2):
        raise ValueError(f"{name} has shape {tuple(routing.shape)}: expected a 2-D tensor "
                         "(T, k) or 1-D top-1 indices (T,)")
    if routing.device != device:
        raise ValueError(f"{name} is on {routing.device} but {against} is on {device}")
    if routing.shape[0] != tokens:
        raise ValueError(f"{name} has {routing.shape[0]} rows but {against} has {tokens} "
                         "(expected one row of expert indices per token)")
    return routing


def check_not_mask(routing: torch.Tensor, num_experts: int, name: str = "topk_indices") -> None:
    """``ValueError`` where integer ``(T, k)`` indices look like a 0/1 routing map given as
    integers (TransformerEngine's int32 mask): ``k == E >= 3`` and every value 0 or 1, so
    that every row would name an expert more than once. (With two experts every 0/1 row is
    also valid indices, repeats allowed, and is routed as such: a map must come as bool.)
    Reads the values (a host sync): call it only where the indices are read anyway (CPU, or
    CUDA under ``GROUPED_LINEAR_DEBUG=1``)."""
    if (routing.dtype == torch.bool or routing.dim() != 2 or num_experts < 3
            or routing.shape[1] != num_experts or routing.numel() == 0):
        return
    if bool(((routing == 0) | (routing == 1)).all()):  # one host read
        raise ValueError(
            f"{name} is a {routing.dtype} tensor of shape {tuple(routing.shape)} = (T, "
            f"num_experts) holding only 0 and 1: as expert indices each of its rows names an "
            f"expert more than once; a 0/1 routing map is passed as {name}.bool()")


def check_probs(probs: object, routing: torch.Tensor, device: torch.device,
                name: str = "probs") -> torch.Tensor | None:
    """``probs`` (or ``None``) if it is a floating tensor of ``routing``'s shape on ``device``."""
    if probs is None:
        return None
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"{name} is {type(probs).__name__}: expected a torch.Tensor or None")
    if not probs.is_floating_point():
        raise TypeError(f"{name} has dtype {probs.dtype}: expected a floating-point tensor")
    if probs.device != device:
        raise ValueError(f"{name} is on {probs.device} but x is on {device}")
    if probs.shape != routing.shape:
        raise ValueError(f"{name} has shape {tuple(probs.shape)} but topk_indices has shape "
                         f"{tuple(routing.shape)}: expected one probability per slot")
    return probs


def check_num_out_tokens(num_out_tokens: object, slots: int, multiple: int) -> int | None:
    """``num_out_tokens`` as an int in ``[0, slots]``, or ``None``; only with ``multiple=1``."""
    if num_out_tokens is None:
        return None
    value = check_int("num_out_tokens", num_out_tokens, minimum=0, maximum=slots)
    if multiple != 1:
        raise ValueError(f"num_out_tokens is {value} with multiple={multiple}: a row limit and "
                         "padded groups do not go together (pass multiple=1)")
    return value


def check_capacity(capacity: object, tokens: int, k: int, num_experts: int, is_map: bool,
                   pad_to_capacity: object = False) -> int | None:
    """The per-expert capacity: an int ``>= 1`` as given, or for a float factor ``f > 0``
    ``ceil(f * T * k / E)`` computed exactly (in integers); ``None`` for no limit.

    Without ``pad_to_capacity`` a capacity above the ``T * k`` slots keeps every slot, as
    ``T * k`` does: it is taken as ``max(T * k, 1)``, however large (``2**70``, a factor of
    ``1e300``). With ``pad_to_capacity=True`` it is the group size, kept as it is and
    checked by :func:`check_pad_to_capacity`."""
    if capacity is None:
        return None
    if isinstance(capacity, float) and not is_bool(capacity):
        if not math.isfinite(capacity) or capacity <= 0:
            raise ValueError(f"capacity is {capacity!r}: a capacity factor must be a finite "
                             "float > 0")
        if is_map:
            raise ValueError(f"capacity is {capacity!r}, a capacity factor, but topk_indices is "
                             "a routing map, whose k is not known without reading it: pass "
                             "the capacity as an int, ceil(factor * T * k / E)")
        numerator, denominator = capacity.as_integer_ratio()  # exact: no rounding
        value = -(-numerator * tokens * k // (denominator * num_experts))
        if pad_to_capacity is True and num_experts * value > MAX_ROWS:
            raise ValueError(f"capacity is {capacity!r}, a capacity factor of {value} rows per "
                             f"expert: {num_experts} groups of it pass the rows a tensor holds "
                             f"({MAX_ROWS}) with pad_to_capacity=True")
    else:
        try:
            value = check_int("capacity", capacity, minimum=1)
        except TypeError:
            raise TypeError(f"capacity is {capacity!r} of type {type(capacity).__name__}: "
                            "expected an int >= 1 (a count) or a float > 0 (a capacity "
                            "factor)") from None
    if pad_to_capacity is True:
        return value
    return min(value, max(tokens * k, 1))  # no expert has more slots than there are


def check_drop_policy(drop_policy: object, capacity: int | None,
                      probs: torch.Tensor | None) -> str:
    """``drop_policy`` if it is one of :data:`DROP_POLICIES`; ``"probs"`` with a capacity
    needs ``probs``."""
    if not isinstance(drop_policy, str):
        raise TypeError(f"drop_policy is {drop_policy!r} of type {type(drop_policy).__name__}: "
                        f"expected one of {DROP_POLICIES}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy is {drop_policy!r}: expected one of {DROP_POLICIES}")
    if drop_policy == "probs" and capacity is not None and probs is None:
        raise ValueError("drop_policy is 'probs' but probs is None: dropping the slots past "
                         "an expert's capacity by probability needs probs (or pass "
                         "drop_policy='position')")
    return drop_policy


def check_pad_to_capacity(pad_to_capacity: object, capacity: int | None, num_experts: int,
                          multiple: int) -> bool:
    """``pad_to_capacity`` as a bool; ``True`` needs a capacity that is a multiple of
    ``multiple`` and whose ``E * capacity`` rows a tensor holds."""
    if not isinstance(pad_to_capacity, bool):
        raise TypeError(f"pad_to_capacity is {pad_to_capacity!r} of type "
                        f"{type(pad_to_capacity).__name__}: expected a bool")
    if not pad_to_capacity:
        return False
    if capacity is None:
        raise ValueError("pad_to_capacity is True but capacity is None: padding every group "
                         "to the capacity needs a capacity")
    if capacity % multiple:
        raise ValueError(f"multiple is {multiple} but capacity is {capacity} with "
                         "pad_to_capacity=True: every group has capacity rows, which must be "
                         "a multiple of multiple")
    if num_experts * capacity > MAX_ROWS:
        raise ValueError(f"capacity is {capacity}: {num_experts} groups of it pass the rows a "
                         f"tensor holds ({MAX_ROWS}) with pad_to_capacity=True")
    return True


# --------------------------------------------------------------------------- conversions
def slot_experts(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(T, k)`` int64 expert of every slot, ``-1`` where dropped or out of range: ``(T,)``
    top-1 indices as ``(T, 1)``, a bool ``(T, E)`` map as ``e`` where set."""
    if routing.dtype == torch.bool:
        experts = torch.arange(num_experts, device=routing.device, dtype=torch.int64)
        return torch.where(routing, experts, -1)
    wide = (routing if routing.dim() == 2 else routing.unsqueeze(1)).to(torch.int64)
    return torch.where((wide >= 0) & (wide < num_experts), wide, -1)


def permute_probs(probs: torch.Tensor, row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``(num_rows,)``: ``out[row_map[t, j]] = probs[t, j]`` for the kept slots, 0 in rows no
    slot holds. A scatter into unique places (a dropped slot writes past the rows, to a place
    of its own), so its gradient is a gather: deterministic, 0 for dropped slots."""
    flat = row_map.reshape(-1)
    slots = flat.numel()
    spare = num_rows + torch.arange(slots, device=flat.device, dtype=torch.int64)
    held = (flat >= 0) & (flat < num_rows)
    out = probs.new_zeros(num_rows + slots)
    return out.scatter(0, torch.where(held, flat, spare), probs.reshape(-1))[:num_rows]


def gather_dense_probs(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``(T, k)``: ``probs[t, experts[t, j]]`` from dense ``(T, E)`` ``probs``, 0 where the
    slot's expert is ``-1`` or not a column of ``probs``."""
    routed = (experts >= 0) & (experts < probs.shape[1])
    index = torch.where(routed, experts, 0)
    if probs.shape[1] == 0:
        return probs.new_zeros(experts.shape)
    return torch.where(routed, probs.gather(1, index), 0)
