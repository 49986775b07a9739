"""The bias's cost inside a GroupedLinear step, from kernel times (CUDA).

``PYTHONPATH=. python benchmarks/bias_in_step.py [SHAPE ...]`` (bench shapes; default the
three the bias bound is stated for): two layers, with and without bias, on the shape's
splits (CUDA splits, bf16). Two rounds of ``do_bench`` medians of each (forward,
forward+backward), then torch.profiler's GPU time per kernel over 5 steps: the bias
epilogue and the bias-gradient kernels against the one-pass bounds (one read and write of
the output forward, one read of its gradient backward, at 4.25 TB/s), and every kernel's
time per step in both layers side by side. The GEMMs' spread
between two layers of the same shape is larger than the bias itself, so the difference of
two medians does not measure it; the kernels' own times do.
"""

import sys

import torch
from profile_step import profile_steps  # benchmarks/profile_step.py
from triton.testing import do_bench

import grouped_linear as gl
from grouped_linear.cli.bench import load_shapes

COPY_BYTES_PER_US = 4.25e6


def run(name):
    shape = load_shapes()[name]
    dt = torch.bfloat16
    x = torch.randn(shape.M, shape.K, device="cuda", dtype=dt, requires_grad=True)
    grad = torch.randn(shape.M, shape.N, device="cuda", dtype=dt)
    splits = torch.tensor(shape.splits, device="cuda")
    layers = {bias: gl.GroupedLinear(shape.G, shape.K, shape.N, bias=bias, params_dtype=dt,
                                     device="cuda") for bias in (True, False)}

    def step_of(layer):
        def step():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(x, splits).backward(grad)
        return step

    for round_ in range(2):
        fwd = {b: do_bench(lambda layer=layer: layer(x, splits), warmup=50, rep=300)
               for b, layer in layers.items()}
        both = {b: do_bench(step_of(layer), warmup=50, rep=300) for b, layer in layers.items()}
        print(f"{name} round {round_}: forward µs bias {fwd[True] * 1e3:.0f} / none "
              f"{fwd[False] * 1e3:.0f}; forward+backward µs bias {both[True] * 1e3:.0f} / none "
              f"{both[False] * 1e3:.0f}")
    out_bytes = shape.M * shape.N * 2
    bounds = {"_bias_epilogue_kernel": 2 * out_bytes / COPY_BYTES_PER_US,
              "_bias_grad_partial_kernel": out_bytes / COPY_BYTES_PER_US}
    per_layer = {}
    for bias, layer in layers.items():
        prof = profile_steps(step_of(layer), 3, 5)
        per_layer[bias] = {e.key: e.device_time_total / 5 for e in prof.key_averages()
                           if e.device_time_total > 0}
    for bias, times in per_layer.items():
        line = f"{name} bias={bias}: GPU µs/step {sum(times.values()):.0f}"
        for kernel, bound in bounds.items():
            if kernel in times:
                line += f", {kernel} {times[kernel]:.0f} (bound {bound:.0f})"
        print(line)
    # Every kernel of the two steps side by side: where the bias's time goes.
    print(f"{'kernel':60s} {'bias µs':>9s} {'none µs':>9s}")
    for kernel in sorted(set(per_layer[True]) | set(per_layer[False]),
                         key=lambda k: -per_layer[True].get(k, 0.0)):
        print(f"{kernel[:60]:60s} {per_layer[True].get(kernel, 0.0):9.1f} "
              f"{per_layer[False].get(kernel, 0.0):9.1f}")

if __name__ == "__main__":
    for shape_name in sys.argv[1:] or ["dsv3_ep32_fc1", "dsv3_ep32_fc2", "qwen35_397b_ep64_fc2"]:
        run(shape_name)
