"""Host time of the small step against the floor a Python autograd node sets (CUDA).

``PYTHONPATH=. python benchmarks/autograd_floor.py``: 8 groups x 128 rows, 1024 -> 1024,
bf16, CUDA splits. Synchronized wall time per call over back-to-back calls for raw
``grouped_mm``, a bare ``autograd.Function`` that only allocates its outputs (the least a
Python autograd node costs), this layer, the layer's backward node called directly, and the
Triton kernels alone.
"""

import torch
import torch.nn.functional as F
from overhead import small_step_case, wall_us  # benchmarks/overhead.py

from grouped_linear.kernels import triton_gemm


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, sizes):
        ctx.save_for_backward(x, w, sizes)
        return torch.empty(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w, _ = ctx.saved_tensors
        bias_grad = torch.empty(w.shape[0], w.shape[1], device=w.device, dtype=w.dtype)
        return torch.empty_like(x), torch.empty_like(w), bias_grad, None


def main():
    case = small_step_case()
    x, w, b, splits, offs, grad = case.x, case.w, case.b, case.splits, case.offs, case.grad
    layer = case.layer
    y, y_bare = layer(x, splits), _Bare.apply(x, w, b, splits)
    grad_rows = grad.contiguous()

    def zero():
        x.grad = w.grad = b.grad = None
        for p in layer.parameters():
            p.grad = None

    cases = {
        "raw grouped_mm fwd+bwd": lambda: (
            F.grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(grad), zero()),
        "bare autograd node fwd+bwd": lambda: (_Bare.apply(x, w, b, splits).backward(grad), zero()),
        "layer fwd+bwd": lambda: (layer(x, splits).backward(grad), zero()),
        "layer backward node only": lambda: y.grad_fn.apply(grad),
        "bare backward node only": lambda: y_bare.grad_fn.apply(grad),
        "Triton backward kernel": lambda: triton_gemm.backward(grad_rows, x.detach(), w.detach(),
                                                               splits, True),
        "Triton forward kernel": lambda: triton_gemm.forward(x.detach(), w.detach(), b.detach(),
                                                             splits),
    }
    print(f"{'case':30s} {'wall µs/call':>12s}")
    for name, fn in cases.items():
        print(f"{name:30s} {min(wall_us(fn, n=300) for _ in range(3)):12.1f}")


if __name__ == "__main__":
    main()
