"""torch.profiler summary of one small and one large GroupedLinear step next to raw grouped_mm.

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/profile_step.py``.
"""

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl


def run(name, G, m, K, N, bias):
    dt = torch.bfloat16
    M = G * m
    x = torch.randn(M, K, device="cuda", dtype=dt, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda", dtype=dt) / K**0.5).requires_grad_()
    offs = torch.arange(1, G + 1, device="cuda", dtype=torch.int32) * m
    splits = torch.full((G,), m, device="cuda")
    grad = torch.randn(M, N, device="cuda", dtype=dt)
    layer = gl.GroupedLinear(G, K, N, bias=bias, params_dtype=dt, device="cuda")
    steps = {
        "raw": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(grad),
        "gl": lambda: layer(x, splits).backward(grad),
    }
    for label, step in steps.items():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        print(f"===== {name} {label} (bias={bias}), 10 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=60))


if __name__ == "__main__":
    run("small 8x128 1024->1024", 8, 128, 1024, 1024, bias=False)
    run("qwen fc2 8x10240 1024->4096", 8, 10240, 1024, 4096, bias=True)
