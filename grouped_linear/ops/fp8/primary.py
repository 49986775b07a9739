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
from itertools import accumulate

import torch
from torch.autograd.graph import increment_version
from torch.utils._pytree import tree_map_only

from ...kernels.quantize import blocks, groups, rows
from ...kernels.quantize.emulate import dequantize_codes
from ...recipes import Float8Blockwise, Float8Recipe, Float8Rowwise, Float8Tensorwise, check_recipe
from ..checks import describe

__all__ = ["Float8WeightTensor", "MasterWeights", "quantize_weight_codes"]

_aten = torch.ops.aten
# Ops that would hand out a view or a piece of the weight other than whole experts or a
# reshape of the whole: refused rather than answered with a dequantized copy that writes
# would not reach.
_VIEWS = {_aten.split, _aten.split_with_sizes, _aten.chunk, _aten.slice, _aten.narrow,
          _aten.view, _aten._unsafe_view, _aten.as_strided, _aten.select, _aten.unbind,
          _aten.t, _aten.transpose, _aten.permute, _aten.expand, _aten.unsqueeze,
          _aten.squeeze, _aten.new_zeros, _aten.new_empty, _aten.new_full, _aten.new_ones,
          _aten.index, _aten.diagonal, _aten.unfold}


def quantize_weight_codes(weight: torch.Tensor, recipe: Float8Recipe,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, N, K)`` -> FP8 codes ``(G, N, K)`` and float32 factors: ``(G, N)`` per output
    channel (rowwise; tensorwise: the expert's factor in every channel) or
    ``(G, cdiv(N, 128), cdiv(K, 128))`` per block (blockwise); written into ``out`` (such a
    pair, contiguous) if given."""
    fp8, pow2 = recipe.forward_dtype, recipe.power_of_two_scales
    weight = weight.detach()
    if isinstance(recipe, Float8Blockwise):
        return blocks.quantize_weight_blocks(weight, fp8, pow2, out=out)
    group_scale = None
    if isinstance(recipe, Float8Tensorwise):
        group_scale, _ = groups.weight_group_scales(weight, fp8, pow2)
    return rows.quantize_weight_rows(weight, fp8, pow2, group_scale, out)


def _codes_bytes(codes: torch.Tensor) -> int:
    """Bytes of ``codes`` rounded up to 16: where the factors start in a packed buffer."""
    return -(-codes.numel() // 16) * 16


def _pack(codes: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``codes`` and ``inv`` (float32) in one uint8 buffer, the factors 16-byte aligned."""
    start = _codes_bytes(codes)
    packed = torch.empty(start + 4 * inv.numel(), dtype=torch.uint8, device=codes.device)
    packed[:codes.numel()].copy_(codes.reshape(-1).view(torch.uint8))
    packed[start:].view(torch.float32).copy_(inv.reshape(-1))
    return packed


def _unpack(packed: torch.Tensor, codes: torch.Tensor, inv: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a :func:`_pack` buffer shaped and typed as ``codes`` and ``inv``."""
    start = _codes_bytes(codes)
    return (packed[:codes.numel()].view(codes.dtype).view(codes.shape),
            packed[start:start + 4 * inv.numel()].view(torch.float32).view(inv.shape))


class Float8WeightTensor(torch.Tensor):
    """A ``(G, N, K)`` expert weight stored as ``recipe``'s FP8 codes and factors (module doc).

    Build one with :meth:`quantize`. ``codes``, ``inv`` and ``recipe`` are what the FP8 routes
    read; :meth:`dequantize` gives the values in the tensor's dtype.

    Pieces along the experts (``weight[a:b]``, ``torch.chunk(weight, n)``, ``new_zeros`` of
    ``(g, N, K)``) share the buffers, so writes into them reach the weight, and FSDP2's
    ``fully_shard`` shards it by experts and all-gathers the codes and factors
    (:meth:`fsdp_pre_all_gather`): half a bf16 weight's bytes. Other views are refused.
    """

    codes: torch.Tensor
    inv: torch.Tensor
    recipe: Float8Recipe

    @staticmethod
    def __new__(cls, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Recipe,
                dtype: torch.dtype, requires_grad: bool = False,
                shape: tuple[int, ...] | None = None):
        shape = codes.shape if shape is None else torch.Size(shape)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype,
                                                   device=codes.device,
                                                   requires_grad=requires_grad)

    def __init__(self, codes: torch.Tensor, inv: torch.Tensor, recipe: Float8Recipe,
                 dtype: torch.dtype, requires_grad: bool = False,
                 shape: tuple[int, ...] | None = None) -> None:
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
        """The stored values, in this tensor's shape and in ``dtype`` (default: its own)."""
        return dequantize_codes(self.codes, self.inv, dtype or self.dtype).view(self.shape)

    @torch.no_grad()
    def store_(self, values: torch.Tensor) -> Float8WeightTensor:
        """Quantize ``values`` into this tensor's buffers, in place (CUDA graphs that read them
        keep their addresses). Another FP8 weight of the same recipe is copied as it is."""
        if (isinstance(values, Float8WeightTensor) and values.recipe == self.recipe
                and values.codes.shape == self.codes.shape):
            self.codes.copy_(values.codes)
            self.inv.copy_(values.inv)
        else:
            if isinstance(values, Float8WeightTensor):
                values = values.dequantize()
            values = values.to(self.device).reshape(self.codes.shape)
            if self.codes.is_contiguous() and self.inv.is_contiguous():
                quantize_weight_codes(values, self.recipe, out=(self.codes, self.inv))
            else:
                codes, inv = quantize_weight_codes(values, self.recipe)
                self.codes.copy_(codes)
                self.inv.copy_(inv)
        # torch counts no write made by a kernel through pointers or inside
        # __torch_dispatch__; MasterWeights finds writes by these counters.
        increment_version((self.codes, self.inv))
        return self

    def _like(self, codes: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype | None = None,
              shape: tuple[int, ...] | None = None) -> Float8WeightTensor:
        return Float8WeightTensor(codes, inv, self.recipe, dtype or self.dtype, shape=shape)

    def _experts(self, start: int, stop: int) -> Float8WeightTensor:
        return self._like(self.codes[start:stop], self.inv[start:stop])

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"Float8WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"recipe={self.recipe!r}, device={self.device})")

    def __tensor_flatten__(self):
        return ["codes", "inv"], (self.recipe, self.dtype, tuple(self.shape))

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        recipe, dtype, shape = meta
        return Float8WeightTensor(inner["codes"], inner["inv"], recipe, dtype, shape=shape)

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self.codes, self.inv, self.recipe, self.dtype, self.requires_grad,
                           isinstance(self, torch.nn.Parameter), tuple(self.shape)))

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2: all-gather this rank's experts' codes and factors, not high-precision
        values."""
        if outer_size[0] % mesh.size() != 0:
            raise ValueError(f"a Float8WeightTensor of {outer_size[0]} experts is sharded over "
                             f"{mesh.size()} ranks: FP8 primary weights shard by whole experts, "
                             "so the expert count must divide evenly")
        if mesh.size() == 1:  # FSDP2 copies a one-rank group's first input alone
            return (_pack(self.codes, self.inv),), None
        return (self.codes, self.inv), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """FSDP2: the gathered codes and factors as the whole weight (no copy); on one rank
        the codes and factors travel packed in one byte buffer, and the weight views it."""
        if len(outputs) == 1:
            (packed,) = outputs
            (codes, inv), inner = _unpack(packed, self.codes, self.inv), (packed,)
        else:
            (codes, inv), inner = outputs, tuple(outputs)
        if out is not None:  # FSDP2 gathered into the buffers ``out`` already reads
            if out.codes.data_ptr() != codes.data_ptr():
                out.codes.copy_(codes)
                out.inv.copy_(inv)
            return None
        return self._like(codes, inv, param_dtype), inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args and isinstance(args[0], cls) else None
        if t is not None:
            answer = _answer_shape_op(t, func, args[1:], kwargs)
            if answer is not NotImplemented:
                return answer
        if func.overloadpacket in _VIEWS:
            raise NotImplementedError(
                f"{func.overloadpacket.__name__} of a Float8WeightTensor: its FP8 codes and "
                "factors are taken only by whole experts along dim 0 or reshaped whole "
                "(FSDP2 shards them so), not split, sliced or viewed otherwise (no tensor-"
                "parallel sharding of FP8 primary weights); use .dequantize() for the values")
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


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _answer_shape_op(t: Float8WeightTensor, func, args, kwargs):
    """The ops that keep the buffers: aliases, copies, moves, whole-expert pieces and
    reshapes of the whole; ``NotImplemented`` for any other."""
    aten, whole = _aten, t.shape == t.codes.shape
    if func in (aten.detach.default, aten.alias.default):
        return t._like(t.codes, t.inv, shape=t.shape)
    if func is aten.clone.default:
        return t._like(t.codes.clone(), t.inv.clone(), shape=t.shape)
    if func is aten.copy_.default:
        return t.store_(args[0])
    if func is aten._to_copy.default:  # .to(device/dtype)
        device = kwargs.get("device")
        move = (lambda b: b) if device is None else (lambda b: b.to(device))
        return t._like(move(t.codes), move(t.inv), kwargs.get("dtype"), t.shape)
    if func in (aten.view.default, aten._unsafe_view.default):
        shape = _infer_shape(args[0], t.numel())
        return t._like(t.codes, t.inv, shape=shape) if shape is not None else NotImplemented
    if func is aten.as_strided.default:
        size, stride = list(args[0]), list(args[1])
        offset = args[2] if len(args) > 2 else kwargs.get("storage_offset")
        if (offset or 0) == 0 and stride == _contiguous_strides(size) \
                and _infer_shape(size, t.numel()) is not None:
            return t._like(t.codes, t.inv, shape=size)
        return NotImplemented
    if func in (aten.new_zeros.default, aten.new_empty.default):
        size = list(args[0])
        if size[1:] == list(t.codes.shape[1:]) or size == [0]:
            experts = size[0] if len(size) == 3 else 0
            codes = t.codes.new_zeros((experts, *t.codes.shape[1:]))
            inv = t.inv.new_zeros((experts, *t.inv.shape[1:]))
            return t._like(codes, inv, shape=size)
        return NotImplemented
    if not whole:
        return NotImplemented
    if func is aten.slice.Tensor:
        dim, start, stop, step = (list(args) + [0, None, None, 1][len(args):])[:4]
        if dim % 3 != 0 or step != 1:
            return NotImplemented
        start, stop, _ = slice(start, stop).indices(t.shape[0])
        return t._experts(start, max(start, stop))
    if func in (aten.split.Tensor, aten.split_with_sizes.default):
        size, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if dim % 3 != 0:
            return NotImplemented
        G = t.shape[0]
        sizes = list(size) if func is aten.split_with_sizes.default else \
            [min(size, G - i) for i in range(0, G, size)] or [0]
        return [t._experts(end - n, end) for n, end in zip(sizes, accumulate(sizes))]
    return NotImplemented


def _infer_shape(shape, numel: int) -> list[int] | None:
    shape = list(shape)
    if shape.count(-1) == 1:
        known = 1
        for size in shape:
            known *= size if size != -1 else 1
        if known == 0 or numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    total = 1
    for size in shape:
        total *= size
    return shape if total == numel and -1 not in shape else None


def _rebuild(codes, inv, recipe, dtype, requires_grad, parameter=None, shape=None):
    """The unpickled weight: a parameter where it was one (frozen or not), of its shape (a
    reshaped view's too). Pickles without the last two (older ones) give a parameter where
    the weight required grad, of the codes' shape."""
    tensor = Float8WeightTensor(codes, inv, recipe, dtype, shape=shape)
    if parameter if parameter is not None else requires_grad:
        return torch.nn.Parameter(tensor, requires_grad)
    return tensor.requires_grad_(requires_grad)


# ``torch.load(weights_only=True)`` (torch.distributed.checkpoint's loads among them) may
# rebuild FP8 weights: their pickles hold only tensors, a dtype and a frozen recipe.
torch.serialization.add_safe_globals([_rebuild, Float8Rowwise, Float8Tensorwise,
                                      Float8Blockwise])


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if it is a DTensor, else ``t``."""
    return getattr(t, "_local_tensor", t)


def _stored(p: torch.Tensor) -> Float8WeightTensor | None:
    """The FP8 storage of a parameter: itself, or its local shard under FSDP2 (a DTensor)."""
    local = _local(p)
    return local if isinstance(local, Float8WeightTensor) else None


def _check_parameters(parameters: object) -> list[torch.nn.Parameter]:
    """``parameters`` as a list of distinct ``torch.nn.Parameter``; ``TypeError`` for a
    tensor, a string, a non-iterable or an entry that is no parameter, ``ValueError`` for a
    parameter given twice, each naming ``parameters``."""
    if isinstance(parameters, (torch.Tensor, str, bytes)) or not isinstance(parameters,
                                                                           Iterable):
        raise TypeError(f"parameters is {describe(parameters)}: expected an iterable of "
                        "torch.nn.Parameter (e.g. model.parameters())")
    found = list(parameters)
    seen: dict[int, int] = {}
    for i, p in enumerate(found):
        if not isinstance(p, torch.nn.Parameter):
            raise TypeError(f"parameters[{i}] is {describe(p)}: expected a torch.nn.Parameter "
                            "(e.g. from model.parameters())")
        if id(p) in seen:
            raise ValueError(f"parameters[{i}] is parameters[{seen[id(p)]}] again: each "
                             "parameter is given once")
        seen[id(p)] = i
    return found


def version_counter(t: torch.Tensor) -> int:
    """``t``'s version counter (-1 for an inference tensor, which keeps none)."""
    return -1 if t.is_inference() else t._version


def _signature(p: torch.Tensor) -> tuple[int, ...]:
    """What any write into the FP8 parameter ``p`` changes: the version counters of ``p``,
    its local shard and their codes and factors (in-place ops, ``store_``, aliases such as
    ``state_dict()`` entries, whole-expert pieces) and the buffers' addresses
    (``torch.utils.swap_tensors``, which ``load_state_dict(assign=True)`` uses under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``)."""
    stored = _stored(p)
    return (*map(version_counter, (p, stored, stored.codes, stored.inv)),
            stored.codes.data_ptr(), stored.inv.data_ptr())


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

    A master follows its FP8 weight written elsewhere since the master last read or stored
    it (``model.load_state_dict(checkpoint)``, a checkpoint loaded into ``state_dict()``
    entries, ``copy_``, ``store_``): :meth:`step` reads the weight's values into the master
    before the optimizer updates it. Writes are found by the weight's version counters and
    buffer addresses (``swap_tensors``), free at every step, then confirmed by value: a weight
    rewritten with exactly the quantized master (a checkpoint of these same weights) keeps the
    master and its bits below the FP8 step. A kernel writing the codes through their pointers
    must count its write (``torch.autograd.graph.increment_version``). A master equal to its
    weight's values (just read, left as it was by the optimizer: ``lr=0``, a frozen weight) is
    not stored back, so such a step leaves the weight bit for bit.
    ``load_state_dict(assign=True)`` without swapping tensors puts new parameter objects in
    the model, which the masters do not see: build the masters and the optimizer again.

    Under FSDP2 (parameters sharded by ``fully_shard``), each master is a DTensor sharded as
    its parameter: every rank keeps float32 copies of its own experts only.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """``parameters``: an iterable of ``torch.nn.Parameter`` (``model.parameters()``),
        each once; ``TypeError``/``ValueError`` naming it otherwise (the iterable is read
        whole before any master is made)."""
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.others: list[torch.nn.Parameter] = []
        for p in _check_parameters(parameters):
            stored = _stored(p)
            if stored is None:
                self.others.append(p)
                continue
            master = stored.dequantize(torch.float32)
            if stored is not p:  # a DTensor shard: the master is sharded alike
                master = type(p).from_local(master, p.device_mesh, p.placements,
                                            run_check=False, shape=p.shape,
                                            stride=p.stride())
            self.pairs.append((p, master.detach().requires_grad_(p.requires_grad)))
        self.params = [master for _, master in self.pairs]
        # Per pair: the weight's signature when the master last read or stored it, and
        # whether the master was read from it (holds its values) rather than stored into it.
        self._seen = [_signature(p) for p, _ in self.pairs]
        self._read = [True] * len(self.pairs)

    def _check_optimizer(self, optimizer: object) -> None:
        """``TypeError`` for what is no optimizer, ``ValueError`` for one that holds an FP8
        parameter or lacks a master that requires grad; both name ``optimizer``."""
        if not isinstance(optimizer, torch.optim.Optimizer) and not (
                callable(getattr(optimizer, "step", None))
                and hasattr(optimizer, "param_groups")):
            raise TypeError(f"optimizer is {describe(optimizer)}: expected a "
                            "torch.optim.Optimizer over the masters (MasterWeights.params)")
        try:
            held = {id(t) for group in optimizer.param_groups for t in group["params"]}
        except (TypeError, KeyError) as e:
            raise TypeError(f"optimizer is {describe(optimizer)}: its param_groups are not "
                            "dicts of 'params' as a torch.optim.Optimizer's are") from e
        fp8 = [i for i, (p, _) in enumerate(self.pairs) if id(p) in held]
        lacks = [i for i, (_, m) in enumerate(self.pairs) if m.requires_grad and id(m) not in held]
        if fp8 or lacks:
            what = (f"it holds the FP8 parameters of masters.pairs {fp8}" if fp8 else
                    f"it lacks masters.params {lacks}")
            raise ValueError(f"optimizer is {describe(optimizer)}: its parameters are not the "
                             f"masters ({what}); build it over masters.params + "
                             "masters.others, the masters of this MasterWeights")

    def _follow(self, i: int) -> None:
        """Read pair ``i``'s weight into its master if something else wrote the weight."""
        p, master = self.pairs[i]
        signature = _signature(p)
        if signature == self._seen[i]:
            return
        self._seen[i] = signature
        stored, local = _stored(p), _local(master)
        if not self._read[i]:
            codes, inv = quantize_weight_codes(local, stored.recipe)
            if (codes.shape == stored.codes.shape and inv.shape == stored.inv.shape
                    and torch.equal(codes.view(torch.uint8), stored.codes.view(torch.uint8))
                    and torch.equal(inv, stored.inv)):
                return  # rewritten with the values the master stored
        local.copy_(stored.dequantize(torch.float32))
        self._read[i] = True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Read weights written elsewhere into their masters, move the FP8 parameters'
        gradients onto the masters, ``optimizer.step()``, quantize the masters into the FP8
        parameters. ``optimizer`` must be an optimizer (a ``torch.optim.Optimizer``, or an
        object with ``step()`` and ``param_groups``) whose parameters include every master
        that requires grad and no FP8 parameter: ``TypeError``/``ValueError`` naming it
        otherwise, before anything changes."""
        self._check_optimizer(optimizer)
        for i in range(len(self.pairs)):
            self._follow(i)
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        optimizer.step()
        for i, (p, master) in enumerate(self.pairs):
            stored, local = _stored(p), _local(master)
            if not (self._read[i] and torch.equal(local, stored.dequantize(torch.float32))):
                stored.store_(local)
                self._read[i] = False
            self._seen[i] = _signature(p)
