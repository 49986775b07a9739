"""Store a model's expert weights in FP8: :func:`to_fp8_weights`."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.checks import describe
from ..ops.fp8.primary import Float8WeightTensor, _stored
from ..recipes import Float8Recipe, check_recipe
from .grouped_linear import GroupedLinear

__all__ = ["to_fp8_weights"]


def _check(layer: GroupedLinear, name: str, recipe: Float8Recipe | None) -> Float8Recipe:
    chosen = recipe if recipe is not None else layer.recipe
    if chosen is None:
        raise ValueError(f"{name or 'the module'} has no recipe and none was given: an FP8 "
                         "weight is stored for one recipe")
    if layer.recipe is not None and layer.recipe != chosen:
        raise ValueError(f"recipe={recipe!r} differs from {name or 'the module'}'s own "
                         f"recipe {layer.recipe!r}")
    weight = layer._parameters.get("weight")
    if not layer.single_grouped_weight or weight is None:
        raise ValueError(f"{name or 'the module'} keeps one weight per expert "
                         "(single_grouped_weight=False): FP8 storage takes the grouped one")
    if type(weight.data) is not torch.Tensor or not weight.is_contiguous():
        raise ValueError(f"{name or 'the module'}'s weight is a {type(weight.data).__name__} "
                         f"with strides {tuple(weight.stride())}: FP8 storage takes a plain "
                         "contiguous (G, out, in) tensor (convert before sharding)")
    if weight.device.type == "meta":
        raise ValueError(f"{name or 'the module'}'s weight is on the meta device: initialise "
                         "it first")
    return chosen


def to_fp8_weights(module: nn.Module, recipe: Float8Recipe | None = None) -> nn.Module:
    """Replace the weight of every :class:`GroupedLinear` in ``module`` (itself included) by
    a :class:`~grouped_linear.ops.fp8.primary.Float8WeightTensor` parameter: its values in
    ``recipe``'s FP8 storage (default: each layer's own recipe), one byte per weight plus the
    recipe's factors. The layers' forward then quantizes no weight; train them through
    :class:`~grouped_linear.ops.fp8.primary.MasterWeights`. Biases stay as they are.

    Every layer is checked before any is changed: each needs a recipe (its own, or
    ``recipe``, which must then agree with its own), one grouped ``(G, out, in)`` weight,
    plain and contiguous (not sharded, not stored input-major), and initialised. Layers
    already stored in FP8 stay as they are; a ``recipe`` other than theirs is a ValueError.
    ``module`` must be a ``torch.nn.Module`` (TypeError). Returns ``module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module is {describe(module)}: expected a torch.nn.Module (a model, "
                        "or a GroupedLinear / GroupedMLP)")
    recipe = check_recipe(recipe)
    layers = []
    for name, layer in module.named_modules():
        if not isinstance(layer, GroupedLinear):
            continue
        stored = _stored(layer._parameters.get("weight"))
        if stored is None:
            layers.append((name, layer))
        elif recipe is not None and stored.recipe != recipe:
            raise ValueError(f"recipe={recipe!r} but {name or 'the module'}'s weight is "
                             f"already stored in FP8 for {stored.recipe!r}: pass that recipe "
                             "(or None), or build the layer again for another")
    chosen = [_check(layer, name, recipe) for name, layer in layers]
    for (_, layer), layer_recipe in zip(layers, chosen):
        weight = layer._parameters["weight"]
        stored = Float8WeightTensor.quantize(weight.detach(), layer_recipe)
        layer.recipe = layer_recipe
        layer.weight = nn.Parameter(stored, requires_grad=weight.requires_grad)
    return module
