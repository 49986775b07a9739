"""Where weight and bias gradients go when autograd's own accumulation is not wanted.

A :class:`WeightGradSink` is handed to the grouped-linear autograd function by
modules that use ``delay_wgrad_compute`` (gradients computed later, in
``backward_dw``) or ``fuse_wgrad_accumulation`` (weight gradients added into
``param.main_grad``, as Megatron-Core expects). The functional form uses none
and gets its gradients from autograd as usual.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

__all__ = ["WeightGradSink", "check_main_grad", "route_weight_grads"]

GradPair = tuple[torch.Tensor | None, torch.Tensor | None]


def check_main_grad(params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the first parameter without a ``main_grad`` tensor."""
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


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class WeightGradSink:
    """Routes the ``(G, N, K)`` weight gradient and ``(G, N)`` bias gradient of one layer.

    Args:
        weights: ``[weight]`` with one ``(G, N, K)`` parameter, or the ``G``
            per-expert ``(N, K)`` parameters.
        biases: likewise ``[bias]`` ``(G, N)`` or ``G`` parameters ``(N,)``, or ``None``.
        weight_names: names for error messages, parallel to ``weights``.
        delay: defer both gradients to :meth:`flush` (``backward_dw``).
        fuse_main_grad: add weight gradients into ``param.main_grad``.
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

    def _pieces(self, params: list[torch.nn.Parameter], grad: torch.Tensor) -> list[torch.Tensor]:
        if len(params) == 1 and params[0].shape == grad.shape:
            return [grad]
        return list(grad.unbind(0))

    @torch.no_grad()
    def accept_weight_grad(self, grad_w: torch.Tensor) -> None:
        pieces = self._pieces(self.weights, grad_w)
        if self.fuse_main_grad:
            check_main_grad(self.weights, self.weight_names)
            for param, piece in zip(self.weights, pieces):
                param.main_grad.add_(piece)
                param.grad_added_to_main_grad = True
        else:
            for param, piece in zip(self.weights, pieces):
                _accumulate_grad(param, piece)

    @torch.no_grad()
    def accept_bias_grad(self, grad_b: torch.Tensor) -> None:
        assert self.biases is not None
        for param, piece in zip(self.biases, self._pieces(self.biases, grad_b)):
            _accumulate_grad(param, piece)

    def defer(self, compute: Callable[[], GradPair]) -> None:
        """Queue a closure computing ``(grad_w, grad_b)``; :meth:`flush` runs it."""
        self.queue.append((self, compute))

    @staticmethod
    @torch.no_grad()
    def flush(queue: deque) -> None:
        """Compute and apply every queued gradient, oldest first."""
        while queue:
            sink, compute = queue.popleft()
            grad_w, grad_b = compute()
            if grad_w is not None:
                sink.accept_weight_grad(grad_w)
            if grad_b is not None:
                sink.accept_bias_grad(grad_b)


def route_weight_grads(
    sink: WeightGradSink | None, needed: bool, compute: Callable[[], GradPair]
) -> GradPair:
    """What an autograd backward returns for (weight, bias), given the layer's ``sink``.

    No sink: compute both now and hand them to autograd. Delayed: queue ``compute``
    for ``backward_dw`` and return ``(None, None)``. ``main_grad`` fusion: add the
    weight gradient into ``main_grad`` now and return only the bias gradient.
    """
    if sink is None or not needed:
        return compute()
    if sink.delay:
        sink.defer(compute)
        return None, None
    grad_w, grad_b = compute()
    if grad_w is not None and sink.fuse_main_grad:
        sink.accept_weight_grad(grad_w)
        grad_w = None
    return grad_w, grad_b
