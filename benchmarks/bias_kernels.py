"""Bias kernels alone on the benchmark shapes, against one pass at the copy bandwidth.

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/bias_kernels.py``. Timing the
kernels by themselves is far less noisy than differencing two 5-20 ms GEMM steps.
"""

import torch
import triton.testing

from grouped_linear.cli.bench import COPY_BANDWIDTH, load_shapes
from grouped_linear.kernels import bias as bias_kernels


def time_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def measure(shape):
    M, N = shape.M, shape.N
    out = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(shape.G, N, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(shape.splits, device="cuda").cumsum(0).to(torch.int32)
    nbytes = M * N * 2
    epi = time_ms(lambda: bias_kernels.bias_epilogue_(out, bias, offsets, True))
    grad = time_ms(lambda: bias_kernels.bias_grad(out, offsets, torch.bfloat16))
    tail = time_ms(lambda: bias_kernels.zero_tail_(out, offsets))
    sweep = {
        (chunk, block_n): time_ms(lambda c=chunk, b=block_n: bias_kernels.bias_grad(
            out, offsets, torch.bfloat16, chunk=c, block_n=b))
        for chunk in (256, 512, 1024, 2048) for block_n in (64, 128, 256)
    }
    best = min(sweep, key=sweep.get)
    epi_bound = 2 * nbytes / COPY_BANDWIDTH * 1e3
    grad_bound = nbytes / COPY_BANDWIDTH * 1e3
    print(f"{shape.name:22s} {epi:11.3f} {epi_bound:7.3f} {2 * nbytes / epi / 1e6:6.0f} "
          f"{grad:12.3f} {grad_bound:7.3f} {nbytes / grad / 1e6:6.0f} {tail:12.4f}"
          f"  best grad (chunk, block_n) {best}: {sweep[best]:.3f} ms")


def main():
    torch.manual_seed(0)
    print(f"{'shape':22s} {'epilogue ms':>11s} {'bound':>7s} {'GB/s':>6s} "
          f"{'bias grad ms':>12s} {'bound':>7s} {'GB/s':>6s} {'zero tail ms':>12s}")
    for shape in load_shapes().values():
        measure(shape)


if __name__ == "__main__":
    main()
