"""Where the host time of a small compiled GroupedLinear step goes (CUDA).

``PYTHONPATH=. python benchmarks/compile_overhead.py``: 8 groups x 128 rows,
1024 -> 1024, bf16, CUDA splits. Times a synchronized forward+backward eager and
compiled (default mode, its own module copy), checks the compiled step for host
syncs (``torch.cuda.set_sync_debug_mode``), then prints torch.profiler's top host
entries of ten compiled steps.
"""

import copy
import warnings

import torch
from overhead import wall_us  # benchmarks/overhead.py: synchronized wall time per call
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl


def main():
    torch.manual_seed(0)
    layer = gl.GroupedLinear(8, 1024, 1024, params_dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.full((8,), 128, device="cuda")

    def step(module):
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x, splits).sum().backward()

    for name, module in (("eager", layer), ("compiled", compiled)):
        print(f"{name:9s} {wall_us(lambda m=module: step(m), 200) / 1e3:.3f} ms per forward+backward "
              "(wall clock, synchronized)")
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled)
    torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]
    print(f"host syncs in one compiled step: {len(syncs)}", *syncs, sep="\n  ")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step(compiled)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
