"""Independent float64 references the tests compare against."""

from __future__ import annotations

import sys

import torch

# Python 3.10 keeps a call's arguments on the caller's stack until it returns (3.11 hands
# them to the callee's frame): a tensor handed over is then alive for the whole call.
HOLDS_ARGUMENTS = sys.version_info < (3, 11)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are zero)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm()
    if denom == 0:
        return float((out - ref).norm())
    return float((out - ref).norm() / denom)


def grouped_linear_ref(x, weight, bias, sizes):
    """Per-group ``x_g @ W_g^T + b_g`` in float64 with autograd; rows past ``sum(sizes)`` are 0.

    The pieces come from ``split``/``unbind``, whose backward joins the pieces' gradients
    once; indexing a group (``weight[g]``) would give each group's gradient a zero tensor of
    the whole weight (quadratic in the groups: minutes at a thousand of them)."""
    tail = x.shape[0] - sum(sizes)
    rows = x.split(list(sizes) + [tail])
    weights = weight.unbind(0)
    biases = bias.unbind(0) if bias is not None else [None] * len(sizes)
    outs = [rows_g @ w_g.t() if b_g is None else rows_g @ w_g.t() + b_g
            for rows_g, w_g, b_g in zip(rows, weights, biases)]
    outs.append(x.new_zeros(tail, weight.shape[1]))
    return torch.cat(outs)


def reference_grads(x, weight, bias, sizes, grad_out):
    """Float64 ``(y, dx, dW, db)`` of :func:`grouped_linear_ref` for ``grad_out``."""
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = weight.detach().double().cpu().requires_grad_()
    b64 = bias.detach().double().cpu().requires_grad_() if bias is not None else None
    y = grouped_linear_ref(x64, w64, b64, sizes)
    y.backward(grad_out.detach().double().cpu())
    return y.detach(), x64.grad, w64.grad, (b64.grad if b64 is not None else None)


def random_sizes(generator: torch.Generator, num_groups: int, max_size: int) -> list[int]:
    """Random group sizes in ``[0, max_size]``, some forced to zero."""
    sizes = torch.randint(0, max_size + 1, (num_groups,), generator=generator).tolist()
    if num_groups > 2:
        sizes[1] = 0
    return sizes


def codes_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """FP8 tensors equal up to one step of rounding (a kernel's conversion may round ties
    differently from torch's) in under 5 % of the entries."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.numel() == 0:
        return True
    diff = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
    return bool((diff <= 1).all()) and float((diff != 0).float().mean()) < 0.05


def gathered_reference(x, weight, bias, sizes, grad_out):
    """Float64 ``(y, dx, dW, db)`` on the CPU from each row's own group weight, gathered (no
    loop over groups): an independent check for many groups."""
    x64, w64, b64 = (t.detach().double().cpu() for t in (x, weight, bias))
    dy = grad_out.detach().double().cpu()
    groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    y = torch.einsum("mk,mnk->mn", x64, w64[groups]) + b64[groups]
    dx = torch.einsum("mn,mnk->mk", dy, w64[groups])
    dw = torch.zeros_like(w64).index_add_(0, groups, dy[:, :, None] * x64[:, None, :])
    db = torch.zeros_like(b64).index_add_(0, groups, dy)
    return y, dx, dw, db


def saved_by(fn):
    """The tensors autograd saves while ``fn()`` runs, and ``fn``'s result."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out
