"""Host time per call of each piece of a small GroupedLinear step (8 x 128 rows, 1024 -> 1024).

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/overhead.py``. Small problems
are launch-bound, so this times back-to-back calls with a wall clock (synchronizing
once at the end) next to ``do_bench``'s median.
"""

import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton.testing

import grouped_linear as gl
from grouped_linear.kernels import bias as bias_kernels
from grouped_linear.kernels import offsets as offset_kernels


def wall_us(fn, n=300, warmup=20, host_only=False):
    """Microseconds per call of ``n`` back-to-back calls after a synchronized warm-up: until
    the GPU has finished them, or (``host_only``) until the host has queued them."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if not host_only:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def small_step_case():
    """The small problem's tensors and layers: 8 groups x 128 rows, 1024 -> 1024, bf16, CUDA
    splits (``splits``; ``sizes`` as a host list) and the matching int32 offsets for raw
    ``grouped_mm`` (``offs``)."""
    torch.manual_seed(0)
    G, m, K, N = 8, 128, 1024, 1024
    M = G * m
    dt = torch.bfloat16
    return SimpleNamespace(
        G=G, M=M, K=K, N=N, dtype=dt, sizes=[m] * G,
        x=torch.randn(M, K, device="cuda", dtype=dt, requires_grad=True),
        w=(torch.randn(G, N, K, device="cuda", dtype=dt) / 32).requires_grad_(),
        b=torch.randn(G, N, device="cuda", dtype=dt, requires_grad=True),
        splits=torch.full((G,), m, device="cuda"),
        offs=torch.arange(1, G + 1, device="cuda", dtype=torch.int32) * m,
        grad=torch.randn(M, N, device="cuda", dtype=dt),
        layer=gl.GroupedLinear(G, K, N, params_dtype=dt, device="cuda"),
        layer_nb=gl.GroupedLinear(G, K, N, bias=False, params_dtype=dt, device="cuda"),
    )


def main():
    case = small_step_case()
    M, N, dt = case.M, case.N, case.dtype
    x, w, b, splits, offs, grad = case.x, case.w, case.b, case.splits, case.offs, case.grad
    layer, layer_nb = case.layer, case.layer_nb
    out = torch.randn(M, N, device="cuda", dtype=dt)
    cases = {
        "raw grouped_mm fwd": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "raw grouped_mm fwd+bwd": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(grad),
        "group_offsets kernel": lambda: offset_kernels.group_offsets(splits, M),
        "bias epilogue kernel": lambda: bias_kernels.bias_epilogue_(out, b.detach(), offs, True),
        "zero tail kernel": lambda: bias_kernels.zero_tail_(out, offs),
        "bias grad kernel": lambda: bias_kernels.bias_grad(grad, offs, dt),
        "gl fwd no bias": lambda: layer_nb(x, splits),
        "gl fwd bias": lambda: layer(x, splits),
        "gl fwd+bwd no bias": lambda: layer_nb(x, splits).backward(grad),
        "gl fwd+bwd bias": lambda: layer(x, splits).backward(grad),
        "gl fwd+bwd bias, list splits": lambda: layer(x, case.sizes).backward(grad),
    }
    print(f"{'case':32s} {'wall us/call':>12s} {'do_bench us':>12s}")
    for name, fn in cases.items():
        bench = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median",
                                        grad_to_none=[x, w, b])
        print(f"{name:32s} {wall_us(fn):12.1f} {bench * 1e3:12.1f}")


if __name__ == "__main__":
    main()
