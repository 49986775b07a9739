"""Low-precision recipes: frozen dataclasses, given per module (``recipe=``) or for a
region (``with gl.autocast(recipe): ...``); a module's own recipe wins.

Every recipe quantizes the three GEMMs of a grouped linear layer to FP8:

* forward ``y = x @ W^T``: ``x`` and ``W``;
* dgrad ``dx = dy @ W``: ``dy`` and ``W``;
* wgrad ``dW_g = dy_g^T @ x_g``: ``dy`` and ``x``, scaled along the tokens of each group.

Scales are ``fp8_max / amax`` over the scaling unit (1 where the unit is all zero), optionally
rounded down to a power of two; values are multiplied by the scale, saturated to the format's
range and rounded to FP8; the GEMM divides the scales back out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["Float8Recipe", "Float8Rowwise", "Float8Tensorwise", "Float8Blockwise", "autocast",
           "current_recipe", "check_recipe"]

_FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Float8Recipe:
    """Common options of the FP8 recipes.

    Args:
        fp8_format: ``"e4m3"`` (every tensor E4M3) or ``"hybrid"`` (E4M3 forward,
            E5M2 for gradients, which need range more than precision).
        power_of_two_scales: round every scale down to a power of two (scaling is
            then exact in binary; a little range is lost).
    """

    fp8_format: str = "e4m3"
    power_of_two_scales: bool = False

    def __post_init__(self) -> None:
        if self.fp8_format not in _FORMATS:
            raise ValueError(f"fp8_format={self.fp8_format!r} is not one of {_FORMATS}")
        if not isinstance(self.power_of_two_scales, bool):
            raise TypeError(f"power_of_two_scales must be a bool, got {self.power_of_two_scales!r}")

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def gradient_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn


@dataclass(frozen=True)
class Float8Rowwise(Float8Recipe):
    """Dynamic per-row scales: per token for activations and gradients, per output
    channel for weights, per group along tokens for wgrad. The dgrad reuses the forward's
    weight copy: the gradient is multiplied by the weight's per-channel factors (the
    reduced dimension there) before its per-token quantization."""


@dataclass(frozen=True)
class Float8Tensorwise(Float8Recipe):
    """Dynamic per-tensor scales, one per group ("current scaling"). The weight gradient
    takes ``x``'s forward codes and scales ``dy`` per (group, column), with ``x``'s group
    scale moved onto it (the tokens being the reduced dimension)."""


@dataclass(frozen=True)
class Float8Blockwise(Float8Recipe):
    """Block scaling (DeepSeek-V3): 1x128 tiles for activations and gradients (along the
    reduction dimension of each GEMM, so 128x1 along the tokens for wgrad), 128x128
    blocks for weights."""


_RECIPES = (Float8Rowwise, Float8Tensorwise, Float8Blockwise)
class _AutocastState(threading.local):
    recipe: Float8Recipe | None = None  # per thread; a class default, so reads never miss


_state = _AutocastState()


def current_recipe() -> Float8Recipe | None:
    """The recipe of the innermost ``gl.autocast`` region, or ``None``."""
    return _state.recipe


def check_recipe(recipe: object, device: torch.device | None = None) -> Float8Recipe | None:
    """``recipe`` if it is ``None`` or a known recipe usable on ``device``, else raise."""
    if recipe is None:
        return None
    if not isinstance(recipe, _RECIPES):
        raise TypeError(
            f"recipe={recipe!r} is not a known recipe; use gl.recipes.Float8Rowwise(), "
            "Float8Tensorwise() or Float8Blockwise() (or None)"
        )
    if device is not None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"recipe={type(recipe).__name__}() needs FP8 matrix units (sm89 or newer); "
                f"device {device} is sm{capability[0]}{capability[1]}"
            )
    return recipe


@contextlib.contextmanager
def autocast(recipe: Float8Recipe | None) -> Iterator[None]:
    """Run grouped linear layers inside the region with ``recipe`` (modules that set
    their own ``recipe=`` keep it). Nests; ``autocast(None)`` turns FP8 off inside."""
    check_recipe(recipe)
    previous = current_recipe()
    _state.recipe = recipe
    try:
        yield
    finally:
        _state.recipe = previous


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
    context_fn=gl.checkpoint_context)`` around layers that take their recipe from an enclosing
    :func:`autocast`: the recomputation, which runs in backward (outside the region), runs
    under the recipe of the checkpointed forward. ``torch.utils.checkpoint`` restores torch's
    own autocast state, not this one; without it the recomputed forward would run without
    the recipe and backward would mix two computations. (The reentrant form has no such hook:
    there give the modules their ``recipe=``.)"""
    return contextlib.nullcontext(), autocast(current_recipe())
