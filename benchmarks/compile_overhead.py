"""Where the host time of a small compiled GroupedLinear step goes (CUDA).

``PYTHONPATH=. python benchmarks/compile_overhead.py``: times forward+backward of
8 groups x 128 rows, 1024 -> 1024 (bf16, CUDA splits) eager, compiled, and compiled
with ``mode="reduce-overhead"`` (CUDA graphs), then prints torch.profiler's top host
entries of one compiled step.
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl


def _host_ms(fn, iters=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main():
    torch.manual_seed(0)
    layer = gl.GroupedLinear(8, 1024, 1024, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.full((8,), 128, device="cuda")
    variants = {"eager": layer, "compiled": torch.compile(layer, fullgraph=True),
                "reduce-overhead": torch.compile(layer, fullgraph=True, mode="reduce-overhead")}
    steps = {}
    for name, module in variants.items():
        def step(m=module):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            m(x, splits).sum().backward()
        steps[name] = step
        print(f"{name:16s} {_host_ms(step):.3f} ms per forward+backward (wall, synchronized)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            steps["compiled"]()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
