"""Launches and host time of one small FP8 training step of GroupedLinear (CUDA, sm90).

``PYTHONPATH=. python benchmarks/fp8_launches.py``: 8 groups x 128 rows, 1024 -> 1024,
bf16 input, CUDA splits, no bias. Per recipe: the host time to enqueue one
forward+backward (synchronize, time the call, median of 20: the GPU work is ~0.1 ms, so
this is what the step costs on a launch-bound host), then torch.profiler's GPU time and
kernel count per step. First, the cost of a bare torch launch on this host.
"""

import time

import torch
from profile_step import profile_steps  # benchmarks/profile_step.py

import grouped_linear as gl


def _per_call_us(fn, calls=200):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    small = torch.randn(8, device="cuda")
    print(f"back to back, synchronized at the end: torch.empty(8) "
          f"{_per_call_us(lambda: torch.empty(8, device='cuda')):.1f} µs, "
          f"a.reciprocal() {_per_call_us(small.reciprocal):.1f} µs per call")
    dt = torch.bfloat16
    G, m, K, N = 8, 128, 1024, 1024
    x = torch.randn(G * m, K, device="cuda", dtype=dt, requires_grad=True)
    grad = torch.randn(G * m, N, device="cuda", dtype=dt)
    splits = torch.full((G,), m, device="cuda")
    recipes = {"bf16": None, "rowwise": gl.recipes.Float8Rowwise(),
               "tensorwise": gl.recipes.Float8Tensorwise(),
               "blockwise": gl.recipes.Float8Blockwise()}
    for name, recipe in recipes.items():
        layer = gl.GroupedLinear(G, K, N, bias=False, params_dtype=dt, device="cuda",
                                 recipe=recipe)

        def step(layer=layer):
            x.grad = layer.weight.grad = None
            layer(x, splits).backward(grad)

        for _ in range(10):
            step()
        host = []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        prof = profile_steps(step, 3, 10)
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
        gpu_us = sum(e.device_time_total for e in kernels) / 10
        count = sum(e.count for e in kernels) / 10
        print(f"{name:10s} host µs/step {sorted(host)[10] * 1e6:7.0f}   GPU µs/step {gpu_us:6.0f}"
              f"   kernels/step {count:3.0f}")


if __name__ == "__main__":
    main()
