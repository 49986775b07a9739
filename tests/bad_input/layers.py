"""Small layers in the states a rejected call must preserve."""

from __future__ import annotations

import torch
from torch import nn

import grouped_linear as gl

G, K, N = 3, 4, 5
SIZES = [2, 0, 4]
M = sum(SIZES)
LAYER_KINDS = ("plain", "delayed", "fp8", "triton")


def rows(m: int = M, k: int = K, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An ``(m, k)`` input."""
    return torch.randn(m, k, dtype=dtype)


def _fill_grads(module: nn.Module) -> None:
    for param in module.parameters():
        param.grad = torch.randn_like(param)


def make_layer(kind: str, **kwargs: object) -> gl.GroupedLinear:
    """A ``GroupedLinear(G, K, N)`` in one of :data:`LAYER_KINDS`:

    * ``plain``: the default backend, every ``.grad`` set;
    * ``delayed``: per-expert parameters, ``delay_wgrad_compute`` and
      ``fuse_wgrad_accumulation``, every ``main_grad`` and bias ``.grad`` set, one weight
      gradient queued;
    * ``fp8``: ``Float8Rowwise`` with the same delayed state, and a cached FP8 weight
      quantized from an older weight (so a refresh of the cache would show);
    * ``triton``: ``backend="triton"`` (the interpreter on CPU), every ``.grad`` set.
    """
    if kind in ("plain", "triton"):
        layer = gl.GroupedLinear(G, K, N, backend="triton" if kind == "triton" else "auto",
                                 **kwargs)
        _fill_grads(layer)
        return layer
    recipe = gl.recipes.Float8Rowwise() if kind == "fp8" else None
    layer = gl.GroupedLinear(G, K, N, single_grouped_weight=kind != "delayed",
                             single_grouped_bias=kind != "delayed", delay_wgrad_compute=True,
                             fuse_wgrad_accumulation=True, recipe=recipe, **kwargs)
    for name, param in layer.named_parameters():
        if name.startswith("bias"):
            param.grad = torch.randn_like(param)
        else:
            param.main_grad = torch.randn_like(param)
    if recipe is not None:
        with torch.no_grad():
            layer(rows(), SIZES, is_first_microbatch=True)
            for param in layer.parameters():
                param.add_(0.25)
    x = rows().requires_grad_()
    layer(x, SIZES, is_first_microbatch=False).backward(torch.randn(M, N))
    return layer


def make_mlp(**kwargs: object) -> gl.GroupedMLP:
    """A ``GroupedMLP(G, K, 3)`` with ``delay_wgrad_compute``: one backward queued in each
    layer, every ``.grad`` set."""
    mlp = gl.GroupedMLP(G, K, 3, delay_wgrad_compute=True, **kwargs)
    mlp(rows().requires_grad_(), SIZES).sum().backward()
    _fill_grads(mlp)
    return mlp


class Holder(nn.Module):
    """The weight and bias of a functional call, held as parameters so that their state
    can be compared before and after."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        _fill_grads(self)
