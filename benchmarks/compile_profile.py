"""Where compiled steps differ from eager ones (CUDA): kernels and host ops side by side.

``PYTHONPATH=. python benchmarks/compile_profile.py``: for the two cases of
``compile_vs_eager.py`` where compiled (default mode) was slower than eager --
GroupedMLP 8x4096 2048/1024 swiglu and GroupedLinear 8x128 1024->1024 -- profiles five
forward+backward steps eager and compiled and prints the CUDA kernels by total time
and the host ops by self time, grouped by input shapes (to see what a copy copies).
"""

import copy

import torch
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl

CASES = [  # (label, build, rows per group, groups, in features)
    ("GroupedMLP 8x4096 2048/1024 swiglu", lambda: gl.GroupedMLP(8, 2048, 1024), 4096, 8, 2048),
    ("GroupedLinear 8x128 1024->1024", lambda: gl.GroupedLinear(8, 1024, 1024), 128, 8, 1024),
]


def main():
    torch.manual_seed(0)
    for label, build, rows, groups, features in CASES:
        eager = build().to("cuda", torch.bfloat16)
        compiled = torch.compile(copy.deepcopy(eager), fullgraph=True)
        x = torch.randn(rows * groups, features, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        splits = torch.full((groups,), rows, device="cuda")
        for name, module in (("eager", eager), ("compiled", compiled)):
            def step(module=module, x=x, splits=splits):
                x.grad = None
                module.zero_grad(set_to_none=True)
                module(x, splits).sum().backward()

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         record_shapes=True) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            averages = prof.key_averages()
            print(f"===== {label}: {name}, 5 steps, CUDA kernels")
            print(averages.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            print(f"===== {label}: {name}, host ops by self time, with input shapes")
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40,
                max_shapes_column_width=70))


if __name__ == "__main__":
    main()
