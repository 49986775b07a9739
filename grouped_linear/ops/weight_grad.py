"""Where weight and bias gradients go when autograd's own accumulation is not wanted.

A :class:`WeightGradSink` is handed to the grouped-linear autograd functions by modules that
use ``delay_wgrad_compute`` (gradients computed later, in ``backward_dw``) or
``fuse_wgrad_accumulation`` (weight gradients added into ``param.main_grad``, as
Megatron-Core expects). The functional form uses none and gets its gradients from autograd
as usual.

With ``main_grad`` fusion three attributes the caller (Megatron-Core's DDP) sets on a weight
parameter are honoured as TransformerEngine honours them, each read with ``getattr(param,
name, False)`` when the forward runs and required to be a ``bool``:

* ``overwrite_main_grad``: the weight gradient is copied into ``main_grad`` instead of added
  (each per-expert weight by its own attribute; with ``delay_wgrad_compute``, when
  ``backward_dw`` computes it);
* ``zero_out_wgrad``: autograd receives a zero tensor for the weight, so ``.grad`` holds
  zeros (with per-expert weights: zeros for all of them where any asks);
* ``grad_added_to_main_grad``: where the parameter carries it (Megatron-Core's DDP adds it),
  the backward sets it to ``True`` and, without ``zero_out_wgrad``, autograd receives an
  uninitialised placeholder of the weight's shape, as TransformerEngine's ``get_dummy_wgrad``
  hands it: DDP's hook on the gradient accumulator finds a ``.grad`` (it asserts one under
  ``overlap_grad_reduce``), skips it because of the flag and drops it. Parameters without the
  attribute get ``None``: ``.grad`` is left as it was (the accumulator node still runs, with
  its hooks). Per-expert weights of which only some carry it get zeros.

The sink writes only what the running backward pass asks for: an input-only pass
(``torch.autograd.grad(y, x)``, ``y.backward(inputs=[x])``) leaves the parameters alone,
per-expert parameters that are frozen (``requires_grad=False``) or left out of ``inputs=``
get nothing (and need no ``main_grad``), and ``torch.autograd.grad`` over a parameter gets
that gradient back from autograd. A weight
gradient bound for an fp32 ``main_grad`` is computed in fp32 (never rounded to the
parameter's dtype first). A queued gradient remembers the versions of the tensors it reads,
so an in-place change before ``backward_dw`` raises as autograd does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["WeightGradSink", "check_main_grad", "main_grad_flags", "route_weight_grads"]

GradPair = tuple[torch.Tensor | None, torch.Tensor | None]
# ``compute(want_weight, want_bias, weight_dtype)``: the gradients asked for, the weight's in
# ``weight_dtype`` (``None``: the parameter's dtype).
Compute = Callable[[bool, bool, "torch.dtype | None"], GradPair]

_NOWHERE, _AUTOGRAD, _SINK = range(3)


def check_main_grad(params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first parameter whose ``main_grad`` is
    missing, of the wrong shape, dtype or device, or overlapping itself in memory."""
    for param, name in zip(params, names):
        main_grad = getattr(param, "main_grad", None)
        if not isinstance(main_grad, torch.Tensor):
            raise ValueError(
                f"fuse_wgrad_accumulation=True needs {name}.main_grad, a tensor the caller "
                f"allocates with the parameter's shape {tuple(param.shape)}; got {main_grad!r}"
            )
        if main_grad.shape != param.shape:
            raise ValueError(
                f"{name}.main_grad has shape {tuple(main_grad.shape)}, expected {tuple(param.shape)}"
            )
        if not main_grad.is_floating_point() or main_grad.device != param.device:
            raise TypeError(
                f"{name}.main_grad is {main_grad.dtype} on {main_grad.device}: expected a "
                f"floating-point tensor on {param.device}"
            )
        if torch._debug_has_internal_overlap(main_grad) == 1:
            raise ValueError(
                f"{name}.main_grad overlaps itself in memory (strides {main_grad.stride()}, "
                "e.g. an expanded tensor): gradients are added into it in place"
            )


def main_grad_flags(params: Sequence[torch.nn.Parameter], names: Sequence[str],
                    flag: str) -> list[bool]:
    """``getattr(param, flag, False)`` of each parameter; ``TypeError`` naming the first one
    whose attribute is not a ``bool``."""
    values = []
    for param, name in zip(params, names):
        value = getattr(param, flag, False)
        if not isinstance(value, bool):
            raise TypeError(f"{name}.{flag} must be a bool, got {value!r}")
        values.append(value)
    return values


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _destination(params: Sequence[torch.nn.Parameter] | None) -> tuple[int, tuple[bool, ...]]:
    """Where the running backward pass wants the gradients of ``params``: nowhere (a pass
    that does not reach them), back to autograd (``torch.autograd.grad`` over one of them)
    or into the sink (a ``backward`` that accumulates into them); and for the sink, which of
    them it reaches (not the frozen ones, nor those an ``inputs=`` leaves out)."""
    reached = []
    for param in params or ():
        try:
            reached.append(param.requires_grad and bool(
                torch._C._will_engine_execute_node(get_gradient_edge(param).node)))
        except RuntimeError:  # torch.autograd.grad captures this leaf's gradient
            return _AUTOGRAD, ()
    return (_SINK if any(reached) else _NOWHERE), tuple(reached)


def _chosen(items: Sequence, mask: Sequence[bool]) -> list:
    return [item for item, keep in zip(items, mask) if keep]


def _check_versions(reads: Sequence[tuple[torch.Tensor, int]]) -> None:
    for tensor, version in reads:
        if tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{tensor.dtype} {list(tensor.shape)}] is at version "
                f"{tensor._version}; expected version {version} instead (changed between the "
                "backward that queued this weight gradient and backward_dw)"
            )


class WeightGradSink:
    """Routes the ``(G, N, K)`` weight gradient and ``(G, N)`` bias gradient of one layer.

    Args:
        weights: ``[weight]`` with one ``(G, N, K)`` parameter, or the ``G``
            per-expert ``(N, K)`` parameters.
        biases: likewise ``[bias]`` ``(G, N)`` or ``G`` parameters ``(N,)``, or ``None``.
        weight_names: names for error messages, parallel to ``weights``.
        delay: defer both gradients to :meth:`flush` (``backward_dw``).
        fuse_main_grad: add weight gradients into ``param.main_grad`` (or copy them where
            ``param.overwrite_main_grad``; see the module docstring for the attributes read).
        queue: the layer's queue of deferred gradients.
    """

    def __init__(
        self,
        weights: Sequence[torch.nn.Parameter],
        biases: Sequence[torch.nn.Parameter] | None,
        weight_names: Sequence[str],
        *,
        delay: bool,
        fuse_main_grad: bool,
        queue: deque,
    ) -> None:
        self.weights = list(weights)
        self.biases = list(biases) if biases is not None else None
        self.weight_names = list(weight_names)
        self.delay = delay
        self.fuse_main_grad = fuse_main_grad
        self.queue = queue
        self.overwrite = [False] * len(self.weights)
        self.flagged: list[torch.nn.Parameter] = []  # those carrying grad_added_to_main_grad
        self.placeholder = None  # what autograd receives for a weight fused into main_grad
        if fuse_main_grad:
            names = self.weight_names
            self.overwrite = main_grad_flags(self.weights, names, "overwrite_main_grad")
            zero_out = main_grad_flags(self.weights, names, "zero_out_wgrad")
            trained = [w for w in self.weights if w.requires_grad]
            self.flagged = [w for w in trained if hasattr(w, "grad_added_to_main_grad")]
            if any(zero_out) or 0 < len(self.flagged) < len(trained):
                self.placeholder = "zeros"
            elif self.flagged:
                self.placeholder = "empty"

    def weight_grad_dtype(self, mask: Sequence[bool]) -> torch.dtype | None:
        """The dtype the weight gradient is computed in: when fused into ``main_grad``, the
        wider of its dtype and the parameter's (fp32 for half-precision parameters with an
        fp32 ``main_grad``; a narrower ``main_grad`` receives the gradient rounded once, not
        one computed from operands rounded to its dtype), else the parameter's (``None``).
        ``mask``: the weights that receive it."""
        if not self.fuse_main_grad:
            return None
        first = _chosen(self.weights, mask)[0]
        return torch.promote_types(first.dtype, first.main_grad.dtype)

    def _pieces(self, params: list[torch.nn.Parameter], grad: torch.Tensor) -> list[torch.Tensor]:
        if len(params) == 1 and params[0].shape == grad.shape:
            return [grad]
        return list(grad.unbind(0))

    def check_main_grad(self, mask: Sequence[bool]) -> None:
        """:func:`check_main_grad` of the weights in ``mask`` (where fused into it)."""
        if self.fuse_main_grad:
            check_main_grad(_chosen(self.weights, mask), _chosen(self.weight_names, mask))

    @torch.no_grad()
    def accept_weight_grad(self, grad_w: torch.Tensor, mask: Sequence[bool]) -> None:
        """Add ``grad_w``'s pieces into the weights in ``mask`` (their ``main_grad`` or
        ``.grad``)."""
        pieces = self._pieces(self.weights, grad_w)
        self.check_main_grad(mask)
        for param, piece, overwrite, keep in zip(self.weights, pieces, self.overwrite, mask):
            if not keep:
                continue
            if not self.fuse_main_grad:
                _accumulate_grad(param, piece)
            elif overwrite:
                param.main_grad.copy_(piece)
            else:
                param.main_grad.add_(piece)

    def fused_weight_grad(self, mask: Sequence[bool]) -> torch.Tensor | None:
        """What autograd receives for the weight when its gradient goes into ``main_grad``
        (now, or in ``backward_dw``): zeros, an uninitialised placeholder or ``None``, of the
        ``(G, N, K)`` weight the autograd function took; marks ``grad_added_to_main_grad``
        where the parameters in ``mask`` carry it."""
        for param in _chosen(self.weights, mask):
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = True
        if self.placeholder is None:
            return None
        first = self.weights[0]
        shape = first.shape if first.dim() == 3 else (len(self.weights), *first.shape)
        make = torch.zeros if self.placeholder == "zeros" else torch.empty
        return make(shape, dtype=first.dtype, device=first.device)

    @torch.no_grad()
    def accept_bias_grad(self, grad_b: torch.Tensor, mask: Sequence[bool]) -> None:
        assert self.biases is not None
        for param, piece, keep in zip(self.biases, self._pieces(self.biases, grad_b), mask):
            if keep:
                _accumulate_grad(param, piece)

    def defer(self, compute: Callable[[], GradPair], reads: Sequence[torch.Tensor],
              masks: tuple[Sequence[bool], Sequence[bool]]) -> None:
        """Queue a closure computing ``(grad_w, grad_b)`` for :meth:`flush`, with the versions
        of the tensors it ``reads`` as they are now and the ``masks`` of the weights and
        biases that receive them."""
        self.queue.append((self, compute, [(t, t._version) for t in reads if t is not None],
                           masks))

    @staticmethod
    @torch.no_grad()
    def flush(queue: deque) -> None:
        """Compute and apply every queued gradient, oldest first. Every entry is checked
        (``main_grad`` present and sound, inputs unchanged) before any gradient moves; a
        failing check raises and leaves the queue as it was."""
        for sink, _, reads, (mask_w, _) in queue:
            sink.check_main_grad(mask_w)
            _check_versions(reads)
        while queue:
            sink, compute, _, (mask_w, mask_b) = queue[0]
            grad_w, grad_b = compute()
            if grad_w is not None:
                sink.accept_weight_grad(grad_w, mask_w)
            if grad_b is not None:
                sink.accept_bias_grad(grad_b, mask_b)
            queue.popleft()


def route_weight_grads(sink: WeightGradSink | None, need_w: bool, need_b: bool,
                       compute: Compute, reads: Sequence[torch.Tensor] = ()) -> GradPair:
    """What an autograd backward returns for (weight, bias), given the layer's ``sink``.

    ``need_w``/``need_b``: the function's ``needs_input_grad`` for them; ``reads``: the
    tensors ``compute`` reads that a caller could change in place (saved inputs, split
    tensors, the incoming gradient).

    No sink: compute what is needed now and hand it to autograd. With a sink, only what the
    running backward pass reaches: delayed, queued for ``backward_dw`` (returned as
    ``None``); ``main_grad`` fusion, the weight gradient added into (or copied to)
    ``main_grad`` now in its dtype and the bias gradient returned. A weight gradient bound for
    ``main_grad``, now or later, returns :meth:`WeightGradSink.fused_weight_grad`. Gradients
    ``torch.autograd.grad`` asks for go back to autograd either way.
    """
    if not (need_w or need_b):
        return None, None
    if sink is None:
        return compute(need_w, need_b, None)
    if torch.compiler.is_compiling():  # traced: no engine to ask, no versions to keep
        to_w = _SINK if need_w else _NOWHERE
        to_b = _SINK if need_b else _NOWHERE
        mask_w = tuple(w.requires_grad for w in sink.weights)
        mask_b = tuple(b.requires_grad for b in sink.biases or ())
        reads = ()
    else:
        to_w, mask_w = _destination(sink.weights) if need_w else (_NOWHERE, ())
        to_b, mask_b = _destination(sink.biases) if need_b else (_NOWHERE, ())
    if not sink.delay and to_b == _SINK:  # only weight gradients skip autograd when not delayed
        to_b = _AUTOGRAD
    now_w, now_b = to_w == _AUTOGRAD, to_b == _AUTOGRAD
    later_w, later_b = to_w == _SINK, to_b == _SINK
    if sink.delay:
        if later_w or later_b:
            sink.defer(lambda: compute(later_w, later_b,
                                       sink.weight_grad_dtype(mask_w) if later_w else None),
                       reads, (mask_w, mask_b))
        grad_w, grad_b = compute(now_w, now_b, None) if now_w or now_b else (None, None)
    elif later_w:  # fused into main_grad now
        grad_w, grad_b = compute(True, now_b, sink.weight_grad_dtype(mask_w))
        sink.accept_weight_grad(grad_w, mask_w)
    else:
        return compute(now_w, now_b, None) if now_w or now_b else (None, None)
    if later_w and sink.fuse_main_grad:
        grad_w = sink.fused_weight_grad(mask_w)
    return grad_w, grad_b
