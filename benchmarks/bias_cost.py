"""What the bias costs: its kernels alone against one pass at the copy bandwidth, and its
share of a GroupedLinear step (CUDA, bf16).

From the repository root, ``PYTHONPATH=. python benchmarks/bias_cost.py [--part
kernels|step] [SHAPE ...]`` (default: both parts; SHAPE: the bench's shapes):

* ``kernels`` (default shapes: all of them): the bias epilogue (add the bias,
  zero the rows past the groups), the bias gradient and the tail zeroing alone, in ms
  (median), against the one-pass bounds (one read and write of the output forward, one
  read of its gradient backward, at 4.25 TB/s), and the bias gradient's best
  ``(chunk, block_n)``. Timing the kernels alone is far less noisy than differencing two
  5-20 ms steps.
* ``step`` (default shapes: the three the bias bound is stated for): two layers, with and
  without bias, on the shape's CUDA splits; two rounds of medians of each (forward,
  forward+backward), then torch.profiler's GPU time per kernel over 5 steps: the bias
  kernels against their bounds, and every kernel's time per step in both layers side by
  side. The GEMMs' spread between two layers of one shape is larger than the bias itself,
  so the difference of two medians does not measure it; the kernels' own times do.
"""

import torch
from _common import (
    COPY_BANDWIDTH,
    CUDA,
    bench_shapes,
    device_groups,
    kernel_times,
    median_ms,
    part_arguments,
    randn,
    warm_gpu,
)

import grouped_linear as gl
from grouped_linear.kernels import bias as bias_kernels

DT = torch.bfloat16
STEP_SHAPES = ["dsv3_ep32_fc1", "dsv3_ep32_fc2", "qwen35_397b_ep64_fc2"]


def kernels(shape) -> None:
    """One line: each bias kernel's ms, its bound and GB/s, and the best gradient config."""
    M, N = shape.M, shape.N
    out = randn(M, N, device=CUDA, dtype=DT)
    bias = randn(shape.G, N, device=CUDA, dtype=DT)
    _, ends = device_groups(shape.splits)
    nbytes = M * N * 2
    epi = median_ms(lambda: bias_kernels.bias_epilogue_(out, bias, ends, True))
    grad = median_ms(lambda: bias_kernels.bias_grad(out, ends, DT))
    tail = median_ms(lambda: bias_kernels.zero_tail_(out, ends))
    sweep = {
        (chunk, block_n): median_ms(lambda c=chunk, b=block_n: bias_kernels.bias_grad(
            out, ends, DT, chunk=c, block_n=b))
        for chunk in (256, 512, 1024, 2048) for block_n in (64, 128, 256)
    }
    best = min(sweep, key=sweep.get)
    epi_bound = 2 * nbytes / COPY_BANDWIDTH * 1e3
    grad_bound = nbytes / COPY_BANDWIDTH * 1e3
    print(f"{shape.name:22s} {epi:11.3f} {epi_bound:7.3f} {2 * nbytes / epi / 1e6:6.0f} "
          f"{grad:12.3f} {grad_bound:7.3f} {nbytes / grad / 1e6:6.0f} {tail:12.4f}"
          f"  best grad (chunk, block_n) {best}: {sweep[best]:.3f} ms", flush=True)


def step(shape) -> None:
    """Medians of the layer with and without bias, then their kernels side by side."""
    x = randn(shape.M, shape.K, device=CUDA, dtype=DT, requires_grad=True)
    grad = randn(shape.M, shape.N, device=CUDA, dtype=DT)
    splits, _ = device_groups(shape.splits)
    layers = {bias: gl.GroupedLinear(shape.G, shape.K, shape.N, bias=bias, params_dtype=DT,
                                     device=CUDA) for bias in (True, False)}

    def step_of(layer):
        def run():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(x, splits).backward(grad)
        return run

    name = shape.name
    for round_ in range(2):
        warm_gpu()
        fwd = {b: median_ms(lambda layer=layer: layer(x, splits)) for b, layer in layers.items()}
        both = {b: median_ms(step_of(layer)) for b, layer in layers.items()}
        print(f"{name} round {round_}: forward µs bias {fwd[True] * 1e3:.0f} / none "
              f"{fwd[False] * 1e3:.0f}; forward+backward µs bias {both[True] * 1e3:.0f} / none "
              f"{both[False] * 1e3:.0f}")
    out_bytes = shape.M * shape.N * 2
    bounds = {"bias_epilogue": 2 * out_bytes / COPY_BANDWIDTH * 1e6,
              "bias_grad": out_bytes / COPY_BANDWIDTH * 1e6}
    per_layer = {bias: {k: us for k, (us, _) in kernel_times(step_of(layer), 3, 5).items()}
                 for bias, layer in layers.items()}
    for bias, times in per_layer.items():
        line = f"{name} bias={bias}: GPU µs/step {sum(times.values()):.0f}"
        for part, bound in bounds.items():
            part_us = sum(us for kernel, us in times.items() if part in kernel)
            if part_us:
                line += f", {part} kernels {part_us:.0f} (bound {bound:.0f})"
        print(line)
    print(f"{'kernel':60s} {'bias µs':>9s} {'none µs':>9s}")
    for kernel in sorted(set(per_layer[True]) | set(per_layer[False]),
                         key=lambda k: -per_layer[True].get(k, 0.0)):
        print(f"{kernel[:60]:60s} {per_layer[True].get(kernel, 0.0):9.1f} "
              f"{per_layer[False].get(kernel, 0.0):9.1f}")


def main() -> None:
    args = part_arguments(__doc__, ("kernels", "step"), "bench shapes (default: per part)")
    torch.manual_seed(0)
    if "kernels" in args.parts:
        print(f"{'shape':22s} {'epilogue ms':>11s} {'bound':>7s} {'GB/s':>6s} "
              f"{'bias grad ms':>12s} {'bound':>7s} {'GB/s':>6s} {'zero tail ms':>12s}")
        for shape in bench_shapes(args.shapes):
            kernels(shape)
    if "step" in args.parts:
        for shape in bench_shapes(args.shapes or STEP_SHAPES):
            step(shape)


if __name__ == "__main__":
    main()
