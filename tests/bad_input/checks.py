"""What every bad-input test asserts, and the counter of inputs tried.

* :func:`assert_value_or_type_error`: the error is a ``ValueError`` or ``TypeError``;
* :func:`assert_names`: its message names the argument (as a word, so ``x`` is not found in
  ``x_perm`` nor ``max``);
* :func:`snapshot` / :func:`assert_unchanged`: a module's state (parameters, ``.grad``,
  ``main_grad``, and every other attribute of every submodule, the FP8 weight cache and the
  delayed-gradient queue included) is the same before and after;
* :func:`expect_rejected` puts the three together for one call.
"""

from __future__ import annotations

import re
import types
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, settings
from torch import nn

__all__ = ["TRIED", "KINDS", "Names", "fuzz", "assert_value_or_type_error", "assert_names", "snapshot",
           "assert_unchanged", "expect_rejected", "rejected_or", "count"]

#: Inputs tried so far in this process, by class.
TRIED: Counter[str] = Counter()
KINDS = ("type", "dtype", "device", "shape", "range", "aliasing", "order", "valid")

Names = str | tuple[str, ...]


def fuzz(max_examples: int) -> settings:
    """Hypothesis settings of this suite: few examples, no deadline, the same examples on
    every run (derandomized, no example database), and a failure reported as found (no
    shrinking: a few seconds at most per failing test)."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate))


def count(kind: str) -> None:
    """Count one input of class ``kind`` (one of :data:`KINDS`) as tried."""
    assert kind in KINDS, kind
    TRIED[kind] += 1


# --------------------------------------------------------------------------- the error
def assert_value_or_type_error(err: BaseException) -> None:
    """``err`` is a ``ValueError`` or ``TypeError`` (what bad input must raise)."""
    assert isinstance(err, (ValueError, TypeError)), (
        f"expected ValueError or TypeError, got {type(err).__name__}: {err}")


def _mentions(message: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def assert_names(err: BaseException, *names: Names) -> None:
    """``str(err)`` names every entry of ``names`` (a tuple entry: any one of its names)."""
    message = str(err)
    for name in names:
        options = (name,) if isinstance(name, str) else name
        assert any(_mentions(message, option) for option in options), (
            f"the message does not name {' or '.join(map(repr, options))}: {message!r}")


# --------------------------------------------------------------------------- the state
@dataclass
class _TensorPrint:
    """A tensor as it was: which object, its metadata and a copy of its values."""

    ident: int
    meta: tuple
    values: torch.Tensor | None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorPrint:
        meta = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device,
                tensor._version)
        values = None if tensor.device.type == "meta" else tensor.detach().clone()
        return cls(id(tensor), meta, values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TensorPrint) or (self.ident, self.meta) != (other.ident,
                                                                              other.meta):
            return False
        if self.values is None or other.values is None:
            return self.values is other.values
        a, b = self.values, other.values
        if a.dtype.itemsize == 1 and a.is_floating_point():  # FP8 codes: bit for bit
            return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(a.isnan(), b.isnan())
                        and torch.equal(a.nan_to_num(), b.nan_to_num()))
        return bool(torch.equal(a, b))


_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_MODULE_REGISTRIES = {"_parameters", "_buffers", "_modules"}


def _fingerprint(value: object, depth: int, seen: frozenset[int]) -> object:
    """A comparable picture of ``value``: tensors copied, containers and plain objects
    walked ``depth`` levels deep, anything else by identity."""
    if value is None or isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return _TensorPrint.of(value)
    if isinstance(value, (nn.Module, type, types.FunctionType, types.MethodType,
                          types.BuiltinFunctionType)) or depth == 0 or id(value) in seen:
        return ("object", type(value).__name__, id(value))
    seen = seen | {id(value)}
    if isinstance(value, (list, tuple, deque, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, id(value),
                tuple(_fingerprint(item, depth - 1, seen) for item in items))
    if isinstance(value, dict):
        return ("dict", id(value), _fields(value, depth, seen))
    if hasattr(value, "__dict__"):
        return ("object", type(value).__name__, id(value), _fields(vars(value), depth, seen))
    return ("object", type(value).__name__, id(value))


def _fields(mapping: dict, depth: int, seen: frozenset[int]) -> tuple:
    return tuple((repr(key), _fingerprint(item, depth - 1, seen)) for key, item in mapping.items())


def snapshot(module: nn.Module) -> dict[str, object]:
    """Everything a rejected call must leave alone, by name: each parameter (object and
    values), its ``.grad``, ``main_grad`` and ``grad_added_to_main_grad``, each buffer, and
    every other attribute of every submodule (caches, queues), walked a few levels deep."""
    state: dict[str, object] = {}
    for name, param in module.named_parameters():
        state[f"parameter {name}"] = _TensorPrint.of(param)
        state[f"{name}.grad"] = _fingerprint(param.grad, 1, frozenset())
        state[f"{name}.main_grad"] = _fingerprint(getattr(param, "main_grad", None), 1, frozenset())
        state[f"{name}.grad_added_to_main_grad"] = getattr(param, "grad_added_to_main_grad", None)
    for name, buffer in module.named_buffers():
        state[f"buffer {name}"] = _TensorPrint.of(buffer)
    for prefix, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr not in _MODULE_REGISTRIES:
                state[f"{prefix or type(sub).__name__}.{attr}"] = _fingerprint(value, 5,
                                                                               frozenset())
    return state


def assert_unchanged(before: dict[str, object], module: nn.Module) -> None:
    """``module``'s :func:`snapshot` equals ``before``, entry by entry."""
    after = snapshot(module)
    assert before.keys() == after.keys(), (
        f"entries appeared or vanished: {sorted(before.keys() ^ after.keys())}")
    changed = [key for key in before if before[key] != after[key]]
    assert not changed, f"state changed by the call: {changed}"


# --------------------------------------------------------------------------- one call
def expect_rejected(kind: str, call: Callable[[], object], *names: Names,
                    state: nn.Module | None = None, value: str | None = None) -> BaseException:
    """``call()`` raises ``ValueError`` or ``TypeError`` naming every entry of ``names``
    (and ``value`` where given), and ``state``'s :func:`snapshot` is unchanged by it."""
    count(kind)
    before = snapshot(state) if state is not None else None
    with pytest.raises(Exception) as info:  # any exception; its class is checked below
        call()
    err = info.value
    assert_value_or_type_error(err)
    assert_names(err, *names)
    if value is not None:
        assert _mentions(str(err), value), f"the message does not give the value {value}: {err}"
    if state is not None:
        assert before is not None
        assert_unchanged(before, state)
    return err


def rejected_or(kind: str, call: Callable[[], object], names: Names,
                check: Callable[[object], None]) -> None:
    """Where an input is valid but past a limit the library may keep: ``call()`` either
    raises ``ValueError``/``TypeError`` naming ``names``, or returns what ``check`` accepts."""
    count(kind)
    try:
        result = call()
    except Exception as err:  # any exception; its class is checked here
        assert_value_or_type_error(err)
        assert_names(err, names)
        return
    check(result)
