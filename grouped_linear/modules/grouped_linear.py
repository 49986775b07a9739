"""``GroupedLinear``: one linear layer per expert, run as one grouped GEMM."""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..ops.checks import check_int
from ..ops.dispatch import check_backend
from ..ops.fp8 import Float8WeightTensor, Fp8WeightCache
from ..ops.grouped_linear import apply_grouped_linear, flatten_rows, reads_fp8_rows
from ..ops.weight_grad import WeightGradSink
from ..parallel.tensor_parallel import TensorParallel
from ..recipes import Float8Rowwise, check_recipe

try:  # sharded parameters (FSDP2's fully_shard); absent from builds without distributed
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = distribute_tensor = None

__all__ = ["GroupedLinear"]


class GroupedLinear(nn.Module):
    r"""``G`` linear layers applied to ``G`` consecutive row groups of one input.

    ``y[rows of group i] = x[rows of group i] @ W_i^T + b_i``

    Args:
        num_gemms: ``G``, the number of groups (experts).
        in_features: size of each input row.
        out_features: size of each output row.
        bias: learn a bias per group.
        return_bias: return ``(y, bias)`` with the bias not added (the
            ``(G, out)`` bias, the list of per-expert ones, or ``None``; copies).
        single_grouped_weight: one ``weight`` parameter ``(G, out, in)``; if
            ``False``, ``weight0`` ... ``weight{G-1}`` of shape ``(out, in)``.
        single_grouped_bias: one ``bias`` ``(G, out)``; else ``bias0`` ... ``(out,)``.
        params_dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        device: parameter device; ``"meta"`` defers initialisation
            (``to_empty`` then ``reset_parameters``).
        init_method: called once per expert on its ``(out, in)`` weight, which it fills in
            place or whose values it returns (a floating-point tensor of that shape);
            default is ``nn.Linear``'s initialisation (fan-in = ``in_features``).
        delay_wgrad_compute: backward computes only the input gradient;
            :meth:`backward_dw` computes the weight and bias gradients.
        fuse_wgrad_accumulation: add weight gradients into ``param.main_grad``
            (allocated by the caller) instead of ``.grad``. Megatron-Core's attributes on
            a weight parameter (``bool``, read when the forward runs, absent meaning
            ``False``) are honoured as TransformerEngine does: ``overwrite_main_grad``
            copies the gradient into ``main_grad`` instead of adding it;
            ``zero_out_wgrad`` hands autograd a zero weight gradient (``.grad`` zeros);
            where the parameter carries ``grad_added_to_main_grad`` (Megatron's DDP adds
            it) the backward sets it ``True`` and hands autograd an uninitialised
            placeholder, which DDP's hook drops; otherwise autograd gets ``None``
            (``.grad`` untouched). See :mod:`grouped_linear.ops.weight_grad`.
        backend: ``"auto"``, ``"grouped"`` (torch's grouped GEMM), ``"loop"``
            (one matmul per group) or ``"triton"`` (this library's kernels).
        recipe: ``None`` (the input dtype, or an enclosing ``gl.autocast``'s recipe)
            or an FP8 recipe (:mod:`grouped_linear.recipes`); it wins over ``gl.autocast``.
        save_original_input: with an FP8 recipe, backward keeps the input and quantizes it
            again instead of keeping its FP8 copy (as TransformerEngine's flag).

    Shape:
        - Input: ``(..., in_features)`` (``M`` rows: the leading dims flattened, in order)
          or a list of ``G`` tensors ``(m_i, in_features)``; ``m_splits``: ``G`` ints or an
          integer tensor ``(G,)`` on any device, counting the ``M`` rows.
        - Output: ``(..., out_features)``, the input's leading dims (``(M, out_features)``
          for a list).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        return_bias: bool = False,
        single_grouped_weight: bool = True,
        single_grouped_bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], object] | None = None,
        delay_wgrad_compute: bool = False,
        fuse_wgrad_accumulation: bool = False,
        backend: str = "auto",
        recipe: object | None = None,
        save_original_input: bool = False,
        parallel_mode: str | None = None,
        tp_size: int = 1,
        tp_group: object | None = None,
        reduce_output: bool = True,
        tp_column_blocks: int = 1,
    ) -> None:
        super().__init__()
        # Every argument by type first, each error naming it; then what they mean together.
        flags = {"bias": bias, "return_bias": return_bias, "single_grouped_weight":
                 single_grouped_weight, "single_grouped_bias": single_grouped_bias,
                 "delay_wgrad_compute": delay_wgrad_compute, "fuse_wgrad_accumulation":
                 fuse_wgrad_accumulation, "reduce_output": reduce_output,
                 "save_original_input": save_original_input}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        self.num_gemms = check_int("num_gemms", num_gemms)
        self.in_features = check_int("in_features", in_features)
        self.out_features = check_int("out_features", out_features)
        tp_column_blocks = check_int("tp_column_blocks", tp_column_blocks)
        if params_dtype is not None and (not isinstance(params_dtype, torch.dtype)
                                         or not params_dtype.is_floating_point):
            raise TypeError(f"params_dtype={params_dtype!r}: expected a floating-point torch.dtype")
        if params_dtype not in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"params_dtype={params_dtype}: the weights are initialised and trained in "
                             "float16, bfloat16, float32 or float64; for FP8 weights build the layer in "
                             "one of those, then gl.to_fp8_weights(model) (README: FP8 primary weights)")
        device = _check_device(device)
        if init_method is not None and not callable(init_method):
            raise TypeError(f"init_method must be callable, got {init_method!r}")
        check_backend(backend)
        check_recipe(recipe)
        self.tp = TensorParallel.create(parallel_mode, tp_size, tp_group, reduce_output,
                                        tp_column_blocks, self.in_features, self.out_features)
        if self.tp.mode == "row" and not self.tp.reduce_output and bias and not return_bias:
            raise ValueError("reduce_output=False leaves the reduction to the caller, so the bias "
                             "must be added after it: use return_bias=True (or bias=False)")
        self.use_bias = bool(bias)
        self.return_bias = return_bias
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias
        self.init_method = init_method
        self.delay_wgrad_compute = delay_wgrad_compute
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.backend = backend
        self.recipe = recipe
        self.save_original_input = save_original_input
        self._pending_wgrads: deque = deque()
        self._fp8_weights = Fp8WeightCache()
        self._tp_hooks = self.tp if self.tp.size > 1 else None  # the op's; none on one rank

        factory = {"device": device, "dtype": params_dtype or torch.get_default_dtype()}
        G = self.num_gemms
        K, N = self.tp.local_features(self.in_features, self.out_features)
        # Registered weights before biases, per-expert ones interleaved as TransformerEngine
        # registers them (weight0, bias0, weight1, bias1, ...): the order of parameters(),
        # of the state dict and of optimizer states.
        if single_grouped_weight:
            self.weight = nn.Parameter(torch.empty(G, N, K, **factory))
        expert_biases = self.use_bias and not single_grouped_bias
        for i in range(G):
            if not single_grouped_weight:
                self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(N, K, **factory)))
            if expert_biases:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(N, **factory)))
        if self.use_bias and single_grouped_bias:
            self.bias = nn.Parameter(torch.empty(G, N, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    def weight_list(self) -> list[torch.Tensor]:
        """The ``G`` per-expert ``(out, in)`` weights (views in the single layout)."""
        return self._per_expert("weight", self.single_grouped_weight)

    def bias_list(self) -> list[torch.Tensor] | None:
        """The ``G`` per-expert ``(out,)`` biases, or ``None`` without bias."""
        return self._per_expert("bias", self.single_grouped_bias) if self.use_bias else None

    def _per_expert(self, name: str, single: bool,
                    lookup: Callable[[str], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``name``'s ``G`` per-expert tensors: the stacked tensor's slices in the single
        layout, else ``name0``, ``name1``, ... ``lookup`` finds a tensor by its parameter
        name (default: the layer's own parameter)."""
        lookup = lookup if lookup is not None else (lambda key: getattr(self, key))
        if single:
            return list(lookup(name).unbind(0))
        return [lookup(f"{name}{i}") for i in range(self.num_gemms)]

    def _weight_params(self) -> tuple[list[nn.Parameter], list[str]]:
        if self.single_grouped_weight:
            return [self.weight], ["weight"]
        names = [f"weight{i}" for i in range(self.num_gemms)]
        return [getattr(self, n) for n in names], names

    def _bias_params(self) -> list[nn.Parameter] | None:
        if not self.use_bias:
            return None
        names = ["bias"] if self.single_grouped_bias else [f"bias{i}" for i in range(self.num_gemms)]
        return [getattr(self, name) for name in names]

    def reads_fp8_rows(self, num_rows: int, dtype: torch.dtype, device: torch.device
                       ) -> Float8Rowwise | None:
        """The rowwise recipe whose FP8 rows (``gl.permute(..., recipe=)``, ``GroupedMLP``'s
        activation) a call on ``num_rows`` rows reads as they are, else ``None`` (also with
        ``save_original_input``: the caller keeps its input as it is)."""
        if self._tp_hooks is not None or self.save_original_input:
            return None
        weight = self._parameters.get("weight") if self.single_grouped_weight else None
        recipe = weight.recipe if isinstance(weight, Float8WeightTensor) else self.recipe
        return reads_fp8_rows(self.num_gemms, self.out_features, self.in_features, recipe,
                              num_rows, dtype, device, self.backend)

    def grouped_weight(self) -> torch.Tensor:
        """The weight as one ``(G, out, in)`` tensor (stacked in the per-expert layout)."""
        return self.weight if self.single_grouped_weight else torch.stack(self.weight_list())

    def grouped_bias(self) -> torch.Tensor | None:
        """The bias as one ``(G, out)`` tensor, or ``None``."""
        if not self.use_bias:
            return None
        return self.bias if self.single_grouped_bias else torch.stack(self.bias_list())

    def reset_parameters(self) -> None:
        """Initialise each expert as ``nn.Linear`` would (or with ``init_method``).

        Weights first, expert by expert, then biases: both layouts draw the
        same numbers from the same seed. Under tensor parallelism every rank
        draws the full expert and keeps its slice, so the full weight equals the
        unsharded layer's for the same seed.

        Parameters sharded by ``fully_shard`` (FSDP2) are drawn in full on every rank and
        each keeps its shard (``distribute_tensor`` takes rank 0's draw), so the deferred
        initialisation pattern (``meta`` device, ``fully_shard``, ``to_empty``, then this)
        gives the unsharded layer's values for the same seed. FP8 weights store the draw.
        """
        own = dict(self.named_parameters(recurse=False))
        with torch.no_grad():
            sharded = {name: DTensor is not None and isinstance(p, DTensor) for name, p in own.items()}
            if not any(sharded.values()) and not any(isinstance(p, Float8WeightTensor)
                                                     for p in own.values()):
                self._initialise(self.weight_list(), self.bias_list())
                return
            full = {name: torch.empty(p.shape, dtype=p.dtype, device=(
                p.to_local() if sharded[name] else p).device) for name, p in own.items()}
            weights = self._per_expert("weight", self.single_grouped_weight, full.__getitem__)
            biases = (self._per_expert("bias", self.single_grouped_bias, full.__getitem__)
                      if self.use_bias else None)
            self._initialise(weights, biases)
            for name, param in own.items():
                param.copy_(distribute_tensor(full[name], param.device_mesh, param.placements)
                            if sharded[name] else full[name])

    def _initialise(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None) -> None:
        """Fill the per-expert ``weights`` ``(N, K)`` then ``biases`` ``(N,)`` in place (local
        shards under tensor parallelism, drawn in full)."""
        bound = 1.0 / math.sqrt(self.in_features)
        sharded = self.tp.mode is not None
        with torch.no_grad():
            for weight in weights:
                full = weight.new_empty(self.out_features, self.in_features) if sharded else weight
                if self.init_method is not None:
                    _apply_init_method(self.init_method, full)
                else:
                    nn.init.kaiming_uniform_(full, a=math.sqrt(5))
                if sharded:
                    weight.copy_(self.tp.shard_weight(full))
            for bias in biases or []:
                full = bias.new_empty(self.out_features) if sharded else bias
                nn.init.uniform_(full, -bound, bound)
                if sharded:
                    bias.copy_(self.tp.shard_bias(full))

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor | Sequence[torch.Tensor],
        m_splits: Sequence[int] | torch.Tensor | None = None,
        *,
        is_first_microbatch: bool | None = None,
        return_bias: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, object]:
        """Apply each group's linear map; see the class docstring for shapes.

        ``is_first_microbatch`` only matters for FP8 recipes: ``None`` quantizes the weight on
        every call, ``True`` quantizes it and refreshes the cache, ``False`` reuses the cache
        (filling it if empty), as across the microbatches of one step. ``return_bias``
        overrides the constructor's choice for this call (callers that fold the bias into
        their next kernel, like ``GroupedMLP``)."""
        if (not self.single_grouped_weight and torch.compiler.is_compiling()
                and (self.delay_wgrad_compute or self.fuse_wgrad_accumulation)):
            # eagerly (a graph break): compiled, the experts would get zero `.grad`s, not None
            return _eager(self, x, m_splits, is_first_microbatch=is_first_microbatch,
                          return_bias=return_bias)
        if return_bias is None:
            return_bias = self.return_bias
        elif not isinstance(return_bias, bool):
            raise TypeError(f"return_bias must be None or a bool, got {return_bias!r}")
        if (self.tp.mode == "row" and not self.tp.reduce_output and self.use_bias
                and not return_bias):
            raise ValueError("return_bias=False with reduce_output=False: the caller reduces the "
                             "output, so the bias must be added after that reduction (return_bias=True)")
        # Plain entries from the dict (Module.__getattr__ is a Python call each), else
        # computed (a parametrization); ``sources``: the experts' weights a stacked one is of.
        params = self._parameters
        sources = None if self.single_grouped_weight else self.weight_list()
        weight = params.get("weight") if sources is None else torch.stack(sources)
        if weight is None:
            weight = self.weight
        bias = None
        if self.use_bias and not return_bias:
            bias = params.get("bias") if self.single_grouped_bias else None
            if bias is None:
                bias = self.grouped_bias()
        leading = None  # the leading dims of an N-D input, its rows flattened into one
        if isinstance(x, torch.Tensor) and x.dim() != 2:
            K = self.tp.local_features(self.in_features, self.out_features)[0]
            if x.dim() < 2:
                raise ValueError(f"x has shape {tuple(x.shape)}: expected (..., {K}), its rows "
                                 "in the leading dims (at least one)")
            x, leading = flatten_rows(x, K)
        sink = None
        if self.delay_wgrad_compute or self.fuse_wgrad_accumulation:
            sink = self._weight_grad_sink()
        out = apply_grouped_linear(
            x, weight, bias, m_splits, backend=self.backend, recipe=self.recipe, sink=sink,
            weight_cache=self._fp8_weights, is_first_microbatch=is_first_microbatch,
            tp=self._tp_hooks, save_original_input=self.save_original_input,
            weight_sources=sources)
        if leading is not None:
            out = out.reshape(*leading, out.shape[-1])
        if not return_bias:
            return out
        if not self.use_bias:
            return out, None
        return out, (self.bias.clone() if self.single_grouped_bias  # copies: FSDP2 frees the
                     else [b.clone() for b in self.bias_list()])  # gathered ones after forward

    def _weight_grad_sink(self) -> WeightGradSink | None:
        """Where this call's parameter gradients go under ``delay_wgrad_compute`` or
        ``fuse_wgrad_accumulation`` (``None`` when no weight gradient is wanted); a missing
        ``main_grad`` raises here, before anything runs."""
        weights, names = self._weight_params()
        trains_w = any(w.requires_grad for w in weights)  # (a delayed bias waits even alone)
        if not torch.is_grad_enabled() or not (trains_w or self.delay_wgrad_compute and any(
                b.requires_grad for b in self._bias_params() or ())):
            return None
        sink = WeightGradSink(weights, self._bias_params(), names, delay=self.delay_wgrad_compute,
                              fuse_main_grad=self.fuse_wgrad_accumulation and trains_w,
                              queue=self._pending_wgrads)
        sink.check_main_grad([w.requires_grad for w in weights])  # frozen experts need none
        return sink

    def backward_dw(self) -> None:
        """Compute the weight and bias gradients of every pending backward, oldest first.

        Only does work with ``delay_wgrad_compute=True``; gradients accumulate into ``.grad``
        (or ``main_grad`` with ``fuse_wgrad_accumulation``, copied there where the weight's
        ``overwrite_main_grad`` was set at the forward). Every pending entry is checked first
        (``main_grad`` present, the inputs it reads not changed in place since its backward):
        a call that raises leaves them all pending. Not with ``fully_shard`` (FSDP2): it swaps
        the parameters back to their shards and reduces their gradients when the backward
        ends, so a pending gradient would land on a parameter that is no longer the layer's;
        that raises ``ValueError``."""
        current = {id(p) for p in self.parameters(recurse=False)}
        for sink, *_ in self._pending_wgrads:
            if any(id(p) not in current for p in sink.weights + (sink.biases or [])):
                raise ValueError("backward_dw: the layer's parameters were replaced after the forward "
                                 "that queued this gradient (fully_shard reshards them when the "
                                 "backward ends), so it cannot reach them: delay_wgrad_compute=True "
                                 "does not work under FSDP2's fully_shard")
        WeightGradSink.flush(self._pending_wgrads)

    # ------------------------------------------------------------------ state dict
    def check_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        """Raise ``TypeError`` (not a tensor) or ``ValueError`` (another shape), naming the
        entry, where an entry of ``state_dict`` under ``prefix`` that this layer would load
        (from either weight and bias layout) does not fit its parameter, or where a per-expert
        entry (``weight{i}``, ``bias{i}``) names an expert ``i >= G`` (a checkpoint of more
        experts); changes nothing. Loading checks every entry this way before it copies any."""
        G = self.num_gemms
        for key in state_dict:
            expert = key.startswith(prefix) and re.fullmatch(r"(?:weight|bias)([0-9]+)", key[len(prefix):])
            if expert and int(expert[1]) >= G:  # strict=False would drop it, strict=True load the rest
                raise ValueError(f"state dict entry {key!r} is expert {int(expert[1])}, but this layer "
                                 f"has num_gemms={G} experts (0 to {G - 1})")
        for name, single in (("weight", self.single_grouped_weight),
                             ("bias", self.single_grouped_bias)):
            if name == "bias" and not self.use_bias:
                continue
            K, N = self.tp.local_features(self.in_features, self.out_features)
            shape = (G, N, K) if name == "weight" else (G, N)
            stacked = prefix + name
            experts = [f"{prefix}{name}{i}" for i in range(G)]
            if stacked in state_dict and (single or not any(k in state_dict for k in experts)):
                _check_entry(stacked, state_dict[stacked], shape)
            elif all(k in state_dict for k in experts) or not single:
                for key in experts:
                    if key in state_dict:
                        _check_entry(key, state_dict[key], shape[1:])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self.check_state_dict(state_dict, prefix)
        G = self.num_gemms
        _remap_layout(state_dict, prefix, "weight", G, self.single_grouped_weight)
        if self.use_bias:
            _remap_layout(state_dict, prefix, "bias", G, self.single_grouped_bias)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # A cached FP8 copy describes the weight before the load: re-quantize it in place
        # (captured CUDA graphs keep its buffers); under fully_shard the next forward does.
        if self._fp8_weights.entry is not None:
            weight = self.grouped_weight().detach()
            if DTensor is not None and isinstance(weight, DTensor):
                self._fp8_weights.entry = None
            else:
                self._fp8_weights.refresh_(weight, self._weight_params()[0])

    def extra_repr(self) -> str:
        parts = [
            f"num_gemms={self.num_gemms}",
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.use_bias}",
        ]
        if not self.single_grouped_weight:
            parts.append("single_grouped_weight=False")
        if self.use_bias and not self.single_grouped_bias:
            parts.append("single_grouped_bias=False")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        if self.return_bias:
            parts.append("return_bias=True")
        if self.delay_wgrad_compute:
            parts.append("delay_wgrad_compute=True")
        if self.fuse_wgrad_accumulation:
            parts.append("fuse_wgrad_accumulation=True")
        if self.tp.mode is not None:
            parts.append(f"parallel_mode={self.tp.mode!r}, tp_size={self.tp.size}")
        return ", ".join(parts)


_eager = torch.compiler.disable(GroupedLinear.forward)


def _check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays), or an error naming it."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device, a str or an int, got {device!r}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device={device!r} is not a device torch knows") from None


def _apply_init_method(init_method: Callable[[torch.Tensor], object], weight: torch.Tensor) -> None:
    """Run ``init_method`` on one expert's ``weight``: it fills the tensor in place (and
    returns it or ``None``) or returns a new floating-point tensor of the same shape, which is
    copied in. Anything else raises, naming ``init_method``: the weight would stay as
    ``torch.empty`` left it."""
    result = init_method(weight)
    if result is None or result is weight:
        return
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"init_method returned {type(result).__name__}: expected None (the weight "
                        f"filled in place) or a tensor of shape {tuple(weight.shape)}")
    if result.shape != weight.shape:
        raise ValueError(f"init_method returned a tensor of shape {tuple(result.shape)}: expected "
                         f"the weight's shape {tuple(weight.shape)}")
    if not result.is_floating_point():
        raise TypeError(f"init_method returned a tensor of dtype {result.dtype}: expected a "
                        "floating-point tensor")
    if result.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        result = result.clone()  # a view of the weight itself (its transpose, say)
    weight.copy_(result)


def _check_entry(key: str, value: object, shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict entry {key!r} is {type(value).__name__}: expected a tensor "
                        f"of shape {shape}")
    if tuple(value.shape) != shape:
        raise ValueError(f"state dict entry {key!r} has shape {tuple(value.shape)}, expected {shape}")
    if value.is_meta:
        raise ValueError(f"state dict entry {key!r} is on the meta device: it holds no values")


def _remap_layout(state_dict: dict, prefix: str, name: str, num_groups: int, single: bool) -> None:
    """Rewrite ``name{i}`` keys into one stacked ``name`` key, or the reverse, in place
    (entries checked by :meth:`GroupedLinear.check_state_dict`)."""
    single_key = prefix + name
    expert_keys = [f"{prefix}{name}{i}" for i in range(num_groups)]
    if single and single_key not in state_dict and all(k in state_dict for k in expert_keys):
        state_dict[single_key] = torch.stack([state_dict[k] for k in expert_keys])
        for key in expert_keys:
            del state_dict[key]
    elif not single and single_key in state_dict and not any(k in state_dict for k in expert_keys):
        stacked = state_dict.pop(single_key)
        if isinstance(stacked, Float8WeightTensor):  # FP8 primary weights: their values
            stacked = stacked.dequantize()
        state_dict.update(zip(expert_keys, stacked.unbind(0)))
