"""FP8 primary weights: a ``(G, N, K)`` weight kept as the FP8 codes and factors its recipe's
forward GEMM reads, instead of a high-precision tensor quantized at every step.

One copy serves every GEMM of each recipe: ``Float8Rowwise`` codes per output channel (the
dgrad reads them transposed, the channel factors folded into the gradient), ``Float8Tensorwise``
per expert, ``Float8Blockwise`` per 128x128 block (the dgrad reads the blocks transposed). So
the weight costs one byte per element plus its factors, and the forward quantizes nothing.

:class:`Float8WeightTensor` is that weight as a tensor: its dtype, shape and device are the
high-precision weight's, and any operation other than the GEMMs (printing, ``state_dict``
consumers, an optimizer's arithmetic) sees the dequantized values; writes into it (``copy_``,
in-place arithmetic) quantize again, in place. Updates smaller than half an FP8 step are lost
that way: train it through :class:`MasterWeights`, which keeps a float32 copy for the
optimizer and quantizes it into the weight after each step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._pytree import tree_map_only

from ...kernels.quantize import blocks, groups, rows
from ...recipes import Float8Blockwise, Float8Recipe, Float8Tensorwise, check_recipe

__all__ = ["Float8WeightTensor", "MasterWeights", "dequantize_codes", "quantize_weight_codes"]

_BLOCK = 128
_aten = torch.ops.aten
# Ops that would hand out a view or a piece of the weight: refused rather than answered
# with a dequantized copy that writes would not reach.
_VIEWS = {_aten.split, _aten.split_with_sizes, _aten.chunk, _aten.slice, _aten.narrow,
          _aten.view, _aten._unsafe_view, _aten.as_strided, _aten.select, _aten.unbind,
          _aten.t, _aten.transpose, _aten.permute, _aten.expand, _aten.unsqueeze,
          _aten.squeeze, _aten.new_zeros, _aten.new_empty, _aten.new_full, _aten.new_ones,
          _aten.index, _aten.diagonal, _aten.unfold}


def quantize_weight_codes(weight: torch.Tensor, recipe: Float8Recipe
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, N, K)`` -> FP8 codes ``(G, N, K)`` and float32 factors: ``(G, N)`` per output
    channel (rowwise; tensorwise: the expert's factor in every channel) or
    ``(G, cdiv(N, 128), cdiv(K, 128))`` per block (blockwise)."""
    fp8, pow2 = recipe.forward_dtype, recipe.power_of_two_scales
    weight = weight.detach()
    if isinstance(recipe, Float8Blockwise):
        return blocks.quantize_weight_blocks(weight, fp8, pow2)
    group_scale = None
    if isinstance(recipe, Float8Tensorwise):
        group_scale, _ = groups.weight_group_scales(weight, fp8, pow2)
    return rows.quantize_weight_rows(weight, fp8, pow2, group_scale)


def dequantize_codes(codes: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of :func:`quantize_weight_codes`'s codes and factors, in ``dtype``."""
    values = codes.float()
    if inv.dim() == 2:  # per output channel
        values = values * inv[:, :, None]
    else:  # per 128x128 block
        G, N, K = codes.shape
        factors = inv.repeat_interleave(_BLOCK, 1).repeat_interleave(_BLOCK, 2)
        values = values * factors[:, :N, :K]
    return values.to(dtype)


class Float8WeightTensor(torch.Tensor):
    """A ``(G, N, K)`` expert weight stored as ``recipe``'s FP8 codes and factors (module doc).

    Build one with :meth:`quantize`. ``codes``, ``inv`` and ``recipe`` are what the FP8 routes
    read; :meth:`dequantize` gives the values in the tensor's dtype.
    """

    codes: torch.Tensor
    inv: torch.Tensor
    recipe: Float8Recipe

    @staticmethod
    def __new__(cls, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Recipe,
                dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype,
                                                   device=codes.device,
                                                   requires_grad=requires_grad)

    def __init__(self, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Recipe,
                 dtype: torch.dtype, requires_grad: bool = False) -> None:
        self.codes, self.inv, self.recipe = codes, inv, recipe

    @classmethod
    def quantize(cls, weight: torch.Tensor, recipe: Float8Recipe,
                 requires_grad: bool = False) -> Float8WeightTensor:
        """``weight`` ``(G, N, K)`` (a floating tensor) in ``recipe``'s FP8 storage."""
        recipe = check_recipe(recipe)
        if recipe is None:
            raise TypeError("recipe=None: an FP8 weight needs an FP8 recipe")
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight must be a floating-point tensor, got {weight!r}")
        if weight.dim() != 3:
            raise ValueError(f"weight has shape {tuple(weight.shape)}: expected (G, N, K)")
        codes, inv = quantize_weight_codes(weight, recipe)
        return cls(codes, inv, recipe, weight.dtype, requires_grad)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored values, ``(G, N, K)`` in ``dtype`` (default: this tensor's)."""
        return dequantize_codes(self.codes, self.inv, dtype or self.dtype)

    @torch.no_grad()
    def store_(self, values: torch.Tensor) -> Float8WeightTensor:
        """Quantize ``values`` into this tensor's buffers, in place (CUDA graphs that read them
        keep their addresses)."""
        if isinstance(values, Float8WeightTensor):
            values = values.dequantize()
        codes, inv = quantize_weight_codes(values.to(self.device), self.recipe)
        self.codes.copy_(codes)
        self.inv.copy_(inv)
        return self

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Float8WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"recipe={self.recipe!r}, device={self.device})")

    def __tensor_flatten__(self):
        return ["codes", "inv"], (self.recipe, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        recipe, dtype = meta
        return Float8WeightTensor(inner["codes"], inner["inv"], recipe, dtype)

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self.codes, self.inv, self.recipe, self.dtype, self.requires_grad))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = _aten
        if func in (aten.detach.default, aten.alias.default):
            (t,) = args
            return cls(t.codes, t.inv, t.recipe, t.dtype)
        if func is aten.clone.default:
            t = args[0]
            return cls(t.codes.clone(), t.inv.clone(), t.recipe, t.dtype)
        if func is aten.copy_.default and isinstance(args[0], cls):
            return args[0].store_(args[1])
        if func is aten._to_copy.default and isinstance(args[0], cls):  # .to(device/dtype)
            t, device = args[0], kwargs.get("device")
            move = (lambda b: b) if device is None else (lambda b: b.to(device))
            return cls(move(t.codes), move(t.inv), t.recipe, kwargs.get("dtype") or t.dtype)
        if func.overloadpacket in _VIEWS:
            raise NotImplementedError(
                f"{func.overloadpacket.__name__} of a Float8WeightTensor: its FP8 codes and "
                "factors are one expert-grouped weight, not split, sliced or viewed (no "
                "per-expert views, FSDP2 or tensor-parallel sharding of FP8 primary weights); "
                "use .dequantize() for the values")
        # Anything else on the dequantized values; what the op writes is quantized back.
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        written = [i for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        if not written:
            return out
        for i in written:
            target, values = args[i], plain_args[i]
            pairs = zip(target, values) if isinstance(target, (list, tuple)) else [(target,
                                                                                   values)]
            for mine, new in pairs:
                if isinstance(mine, cls):
                    mine.store_(new)
        first = args[written[0]]
        return first if not isinstance(first, (list, tuple)) else out


def _rebuild(codes, inv, recipe, dtype, requires_grad):
    tensor = Float8WeightTensor(codes, inv, recipe, dtype)
    return torch.nn.Parameter(tensor, requires_grad) if requires_grad else tensor


class MasterWeights:
    """float32 master copies of FP8 primary weights, for an optimizer to update.

    Give the optimizer :attr:`params` (the masters) in place of the FP8 parameters; after
    ``backward``, :meth:`step` moves each FP8 parameter's gradient onto its master, runs
    ``optimizer.step()``, quantizes the masters into the FP8 parameters and clears the
    FP8 parameters' gradients::

        masters = gl.MasterWeights(model.parameters())
        opt = torch.optim.AdamW(masters.params + masters.others, lr=1e-4)
        ...
        loss.backward()
        masters.step(opt)
        opt.zero_grad()
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.others: list[torch.nn.Parameter] = []
        for p in parameters:
            if isinstance(p, Float8WeightTensor):
                master = p.dequantize(torch.float32).detach().requires_grad_(p.requires_grad)
                self.pairs.append((p, master))
            else:
                self.others.append(p)
        self.params = [master for _, master in self.pairs]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        optimizer.step()
        for p, master in self.pairs:
            p.store_(master)
