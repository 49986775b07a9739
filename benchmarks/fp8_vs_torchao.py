"""Float8Rowwise against torchao and bf16 on one shape, alternating in one process (CUDA).

``PYTHONPATH=.:<torchao> python benchmarks/fp8_vs_torchao.py [SHAPE]`` (default
``unaligned_g16``): three rounds of the bench's ``torchao``, ``fp8_row`` and ``torch``
cases, forward+backward ``do_bench`` medians in µs, then each case's GPU time per step
(sum of its kernels, torch.profiler) with its largest kernels.
"""

import sys

import torch
from profile_step import profile_steps  # benchmarks/profile_step.py
from triton.testing import do_bench

from grouped_linear.cli import bench


def _gpu_time(case):
    def step():
        for leaf in case.leaves:
            leaf.grad = None
        case.forward_backward()

    events = profile_steps(step, 3, 5).key_averages()
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
    total = sum(e.self_device_time_total for e in events) / 5
    return total, [(e.key[:40], round(e.self_device_time_total / 5)) for e in top]


def main():
    shape = bench.load_shapes()[sys.argv[1] if len(sys.argv) > 1 else "unaligned_g16"]
    device = torch.device("cuda")
    grad = bench._randn(shape.M, shape.N, device=device, dtype=torch.bfloat16)
    columns = ["torchao", "fp8_row", "torch"] if bench.torchao_available() else ["fp8_row", "torch"]
    cases = {c: bench._build_case(c, shape, device, torch.bfloat16, grad) for c in columns}
    for round_ in range(3):
        times = []
        for c, case in cases.items():
            ms = do_bench(case.forward_backward, grad_to_none=case.leaves, return_mode="median")
            times.append(f"{c} {ms * 1e3:7.1f}")
        print(f"round {round_} " + " | ".join(times), flush=True)
    for c, case in cases.items():
        total, top = _gpu_time(case)
        print(f"{c} GPU µs/step {total:.0f} {top}")


if __name__ == "__main__":
    main()
