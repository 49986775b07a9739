"""Where a GroupedLinear training step's time goes: torch.profiler tables, launch counts and
host time (CUDA).

From the repository root:

* ``PYTHONPATH=. python benchmarks/profile_step.py`` (or ``... profile_step.py bf16``): the
  host and GPU time per op of one small (8 x 128 rows, 1024 -> 1024, no bias) and one large
  (8 x 10240 rows, 1024 -> 4096, bias) bf16 step, next to raw ``grouped_mm``'s;
* ``... profile_step.py fp8 RECIPE SHAPE [SHAPE ...]`` (RECIPE: rowwise, tensorwise,
  blockwise; SHAPE: the bench's): the kernels of one FP8 training step of ``GroupedLinear``
  (no bias, CUDA splits, as the bench's FP8 columns);
* ``... profile_step.py block CASE [COLUMN ...]`` (CASE: the moe suite's, e.g.
  ``qwen3_30b_a3b``; COLUMN: its columns, default ``bf16 fp8_rowwise fp8_blockwise``): the
  kernels of one step of the whole MoE block as that suite times it, each kernel's GPU time
  per step, and the GEMMs' share against everything else (quantization, permutation,
  activation, reductions);
* ``... profile_step.py layouts [--hidden H] [--rows R] [NAME ...]``: the kernels of the
  layouts suite's ops named so (prefixes; default ``permute sort_chunks``), forward and
  backward, and the host time to enqueue a forward;
* ``... profile_step.py fine [CELL ...]`` (CELL: a fine suite cell, e.g.
  ``G64_r128_skewed_2048x768``; default the worst cells of the last table): per column
  (``torch``, ``gl``, ``gl_fwd``, the cached FP8 ones), the host time to enqueue one call,
  the GPU time of its kernels and their number, and the wall time of a call: a column whose
  host time passes its GPU time is host-bound; then the kernels of ``torch``, ``gl`` and the
  cached FP8 columns one by one, and ``gl``'s host time by op;
* ``... profile_step.py launches``: the small step under each recipe (bf16 and the three
  FP8 ones, no bias): the host time to enqueue one forward+backward (synchronize, time the
  call, median of 20: the GPU work is ~0.1 ms, so this is what the step costs on a
  launch-bound host), the GPU time and the number of kernels per step; first, the cost of
  a bare torch launch on this host.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import CUDA, bench_shapes, device_groups, kernel_times, profile_steps, randn, wall_us
from torch.profiler import ProfilerActivity

import grouped_linear as gl
from grouped_linear.cli import bench_fine, bench_layouts, bench_moe

RECIPES = {"rowwise": gl.recipes.Float8Rowwise, "tensorwise": gl.recipes.Float8Tensorwise,
           "blockwise": gl.recipes.Float8Blockwise}
DT = torch.bfloat16


def _layer_step(sizes: list[int], K: int, N: int, bias: bool, recipe=None):
    """A layer's forward+backward on random inputs, gradients dropped first; and the layer."""
    M = sum(sizes)
    x = randn(M, K, device=CUDA, dtype=DT, requires_grad=True)
    grad = randn(M, N, device=CUDA, dtype=DT)
    splits, _ = device_groups(sizes)
    layer = gl.GroupedLinear(len(sizes), K, N, bias=bias, params_dtype=DT, device=CUDA,
                             recipe=recipe)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x, splits).backward(grad)

    return step, x, grad


def bf16_tables(name: str, G: int, m: int, K: int, N: int, bias: bool) -> None:
    """torch.profiler's table of 10 steps of the layer and of raw ``grouped_mm``."""
    sizes = [m] * G
    layer_step, x, grad = _layer_step(sizes, K, N, bias)
    w = randn(G, N, K, device=CUDA, dtype=DT, scale=K ** -0.5, requires_grad=True)
    _, ends = device_groups(sizes)
    steps = {"raw": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=ends).backward(grad),
             "gl": layer_step}
    for label, step in steps.items():
        prof = profile_steps(step, 5, 10, (ProfilerActivity.CPU, ProfilerActivity.CUDA))
        print(f"===== {name} {label} (bias={bias}), 10 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=60))


def fp8_table(recipe_name: str, shape_name: str) -> None:
    """torch.profiler's GPU table of 5 FP8 steps of the layer on a bench shape."""
    (shape,) = bench_shapes([shape_name])
    step, _, _ = _layer_step(list(shape.splits), shape.K, shape.N, False,
                             RECIPES[recipe_name]())
    prof = profile_steps(step, 3, 5)
    print(f"===== {shape_name} {recipe_name}, 5 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24,
                                    max_name_column_width=50))


GEMM_KERNELS = ("mm_kernel", "wgrad", "_dgrad_kernel", "_forward_kernel", "_grouped_backward_kernel",
                "gemm", "nvjet", "cutlass", "xmma")


def block_table(case_name: str, columns: list[str]) -> None:
    """Per column: every kernel of one step of the moe suite's block, by GPU time, and the
    split between the expert GEMMs and the rest."""
    cases = {case.name: case for case in bench_moe.CASES}
    inputs = bench_moe._inputs(cases[case_name], torch.device(CUDA), DT)
    known = bench_moe._columns(torch.device(CUDA))
    for name in columns:
        step = bench_moe._step(inputs, known[name])

        def run(step=step) -> None:
            step()
            inputs.drop_grads()

        kernels = kernel_times(run, 3, 5)
        total = sum(us for us, _ in kernels.values())
        gemm = sum(us for key, (us, _) in kernels.items()
                   if any(tag in key.lower() for tag in GEMM_KERNELS))
        print(f"===== {case_name} {name}: {total:.0f} µs per step, GEMMs {gemm:.0f} µs "
              f"({gemm / total:.0%}), the rest {total - gemm:.0f} µs")
        print(f"{'µs/step':>8}  {'share':>5}  {'calls':>5}  kernel")
        for key, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:24]:
            print(f"{us:8.0f}  {us / total:5.1%}  {count:5.0f}  {key[:90]}")


def layouts_table(hidden: int, rows: int, names: list[str]) -> None:
    """The kernels of the layouts suite's ops (those whose name starts with one of ``names``)
    at ``hidden`` x ``rows``: forward and backward, each kernel's GPU time per call, and the
    host time to enqueue one forward."""
    for op in bench_layouts._case_ops(hidden, rows, torch.device(CUDA), DT):
        if names and not any(op.name.startswith(name) for name in names):
            continue
        out = op.forward()
        grad = torch.randn_like(out)
        for _ in range(5):
            op.forward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            op.forward()
        host_us = (time.perf_counter() - start) / 20 * 1e6
        torch.cuda.synchronize()
        def backward(out=out, inp=op.inp, grad=grad):
            return torch.autograd.grad(out, inp, grad, retain_graph=True)

        for direction, run in (("fwd", op.forward), ("bwd", backward)):
            kernels = kernel_times(run, 3, 5)
            total = sum(us for us, _ in kernels.values())
            print(f"===== {op.name} {direction} {hidden} x {rows}: {total:.0f} µs of kernels"
                  + (f", {host_us:.0f} µs to enqueue" if direction == "fwd" else ""))
            for key, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:10]:
                print(f"{us:8.1f}  {count:5.0f}  {key[:90]}")


FINE_CELLS = ("G64_r128_skewed_2048x768", "G64_r128_balanced_768x2048", "G64_r8_balanced_4096x2048",
              "G128_r32_skewed_7168x2048", "G256_r8_balanced_2048x768")
FINE_COLUMNS = ("torch", "gl", "row_cached", "block_cached", "torch_fwd", "gl_fwd")


def _host_us(call, leaves, n: int = 20) -> float:
    """Median host time to enqueue ``call`` (the GPU idle at the start of each)."""
    host = []
    for _ in range(n):
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(host) * 1e6


def fine_table(cells: list[str]) -> None:
    """Per fine suite cell and column: host µs to enqueue, GPU µs of kernels, kernels per
    call, wall µs per call (back to back); then the kernels of ``gl``."""
    known = {cell["name"]: cell for cell in bench_fine.GRID.cells()}
    for name in cells:
        if name not in known:
            raise SystemExit(f"unknown cell {name!r}; e.g. {next(iter(known))}")
        inputs = bench_fine.cell_columns(known[name], list(FINE_COLUMNS), torch.device(CUDA), DT)
        print(f"===== {name}")
        print(f"{'column':>12}  {'host µs':>8}  {'GPU µs':>8}  {'kernels':>7}  {'wall µs':>8}")
        top = {}
        for column_name, column in inputs.columns.items():
            def run(column=column) -> None:
                column.call()
                for leaf in column.leaves:
                    leaf.grad = None

            for _ in range(5):
                run()
            host = _host_us(column.call, column.leaves)
            kernels = kernel_times(run, 3, 5)
            gpu = sum(us for us, _ in kernels.values())
            count = sum(n for _, n in kernels.values())
            wall = wall_us(run, n=50, warmup=5)
            print(f"{column_name:>12}  {host:8.0f}  {gpu:8.0f}  {count:7.0f}  {wall:8.0f}")
            if column_name in ("torch", "gl", "row_cached", "block_cached"):
                top[column_name] = kernels
        for column_name, kernels in top.items():
            for key, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:10]:
                print(f"    {column_name:>5} {us:8.1f}  {count:5.0f}  {key[:90]}")
        gl_column = inputs.columns["gl"]

        def gl_run(column=gl_column) -> None:
            column.call()
            for leaf in column.leaves:
                leaf.grad = None

        prof = profile_steps(gl_run, 3, 5, (ProfilerActivity.CPU, ProfilerActivity.CUDA))
        print("    gl host time by op (5 calls):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                        max_name_column_width=60))


def launches() -> None:
    """Host time, GPU time and kernel count per small step, per recipe."""
    small = randn(8, device=CUDA, dtype=torch.float32)
    print(f"back to back, synchronized at the end: torch.empty(8) "
          f"{wall_us(lambda: torch.empty(8, device=CUDA), n=200, warmup=0):.1f} µs, "
          f"a.reciprocal() {wall_us(small.reciprocal, n=200, warmup=0):.1f} µs per call")
    recipes = {"bf16": None, **{name: make() for name, make in RECIPES.items()}}
    for name, recipe in recipes.items():
        step, _, _ = _layer_step([128] * 8, 1024, 1024, False, recipe)
        for _ in range(10):
            step()
        host = []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        kernels = kernel_times(step, 3, 10)
        gpu_us = sum(us for us, _ in kernels.values())
        count = sum(n for _, n in kernels.values())
        print(f"{name:10s} host µs/step {statistics.median(host) * 1e6:7.0f}   "
              f"GPU µs/step {gpu_us:6.0f}   kernels/step {count:3.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    sub.add_parser("bf16", help="a small and a large bf16 step next to raw grouped_mm (default)")
    fp8 = sub.add_parser("fp8", help="the kernels of one FP8 step on bench shapes")
    fp8.add_argument("recipe", choices=sorted(RECIPES))
    fp8.add_argument("shapes", nargs="+")
    block = sub.add_parser("block", help="the kernels of one step of the moe suite's block")
    block.add_argument("case", choices=[case.name for case in bench_moe.CASES])
    block.add_argument("columns", nargs="*", default=["bf16", "fp8_rowwise", "fp8_blockwise"])
    fine = sub.add_parser("fine", help="host and GPU time per column of fine suite cells")
    fine.add_argument("cells", nargs="*", default=list(FINE_CELLS))
    sub.add_parser("launches", help="host time, GPU time and kernels per small step, per recipe")
    layouts = sub.add_parser("layouts", help="the kernels of the layouts suite's ops")
    layouts.add_argument("--hidden", type=int, default=4096)
    layouts.add_argument("--rows", type=int, default=65536)
    layouts.add_argument("names", nargs="*", default=["permute", "sort_chunks"])
    args = parser.parse_args()
    if args.mode == "fp8":
        for name in args.shapes:
            fp8_table(args.recipe, name)
    elif args.mode == "block":
        block_table(args.case, args.columns)
    elif args.mode == "fine":
        fine_table(args.cells)
    elif args.mode == "launches":
        launches()
    elif args.mode == "layouts":
        layouts_table(args.hidden, args.rows, args.names)
    else:
        bf16_tables("small 8x128 1024->1024", 8, 128, 1024, 1024, bias=False)
        bf16_tables("qwen fc2 8x10240 1024->4096", 8, 10240, 1024, 4096, bias=True)


if __name__ == "__main__":
    main()
