"""torch.profiler summary of one small and one large GroupedLinear step next to raw grouped_mm.

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/profile_step.py``, or
``... profile_step.py RECIPE SHAPE [SHAPE ...]`` (RECIPE: rowwise, tensorwise, blockwise)
for the kernels of one FP8 training step of ``GroupedLinear`` (no bias, CUDA splits, as
the bench's FP8 columns) on bench shapes.
"""

import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl


def profile_steps(step, warmup, steps, activities=(ProfilerActivity.CUDA,)):
    """``warmup`` untimed calls of ``step``, then torch.profiler over ``steps`` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=list(activities)) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


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
        prof = profile_steps(step, 5, 10, (ProfilerActivity.CPU, ProfilerActivity.CUDA))
        print(f"===== {name} {label} (bias={bias}), 10 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=60))


def run_fp8(recipe_name, shape_name):
    from grouped_linear.cli.bench import load_shapes

    recipe = {"rowwise": gl.recipes.Float8Rowwise, "tensorwise": gl.recipes.Float8Tensorwise,
              "blockwise": gl.recipes.Float8Blockwise}[recipe_name]()
    shape = load_shapes()[shape_name]
    dt = torch.bfloat16
    x = torch.randn(shape.M, shape.K, device="cuda", dtype=dt, requires_grad=True)
    grad = torch.randn(shape.M, shape.N, device="cuda", dtype=dt)
    splits = torch.tensor(shape.splits, device="cuda")
    # As the bench's FP8 columns: no bias, gradients dropped before each step.
    layer = gl.GroupedLinear(shape.G, shape.K, shape.N, bias=False, params_dtype=dt,
                             device="cuda", recipe=recipe)

    def step():
        x.grad = layer.weight.grad = None
        layer(x, splits).backward(grad)

    prof = profile_steps(step, 3, 5)
    print(f"===== {shape_name} {recipe_name}, 5 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24,
                                    max_name_column_width=50))


if __name__ == "__main__" and len(sys.argv) > 2:
    for name in sys.argv[2:]:
        run_fp8(sys.argv[1], name)
elif __name__ == "__main__":
    run("small 8x128 1024->1024", 8, 128, 1024, 1024, bias=False)
    run("qwen fc2 8x10240 1024->4096", 8, 10240, 1024, 4096, bias=True)
