"""The small step (8 groups x 128 rows, 1024 -> 1024, bf16, CUDA splits), every case timed
in every iteration, so host drift between rounds cancels out of the ratios.

``PYTHONPATH=. python benchmarks/small_step.py [iterations]`` (default 3000). Each iteration
runs each case once, in an order rotated per iteration, timed the way ``do_bench`` times a
repetition (gradients reset, L2 flushed, events around one forward+backward). Cases: raw
``grouped_mm``; this layer with and without bias; ``function``, the layer's autograd
function (the one the layer's fast path applies, two Triton launches) called directly, so
the module call and the fast path's checks show as layer minus function; and ``bare``, a
Python node that only allocates its outputs (the least a Python autograd node costs).

Prints each case's median time and the median of its per-iteration ratio to raw's, with a
95% bootstrap interval of that median and the share of iterations at or under raw.
"""

import random
import statistics
import sys

import torch
import torch.nn.functional as F
from _common import Bare, small_step_case, warm_gpu

from grouped_linear.kernels.gemm.triton_gemm import LinearLaunches
from grouped_linear.ops.fast_path import apply_triton_linear


def _median_interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def main(iterations: int) -> None:
    case = small_step_case()
    x, w, b, splits, ends, grad = case.x, case.w, case.b, case.splits, case.ends, case.grad
    layer, layer_nb = case.layer, case.layer_nb
    leaves = [x, w, b, *layer.parameters(), *layer_nb.parameters()]
    launches, launches_nb = LinearLaunches(), LinearLaunches()  # one per geometry, kept
    steps = {
        "raw grouped_mm": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=ends).backward(grad),
        "layer": lambda: layer(x, splits).backward(grad),
        "layer, no bias": lambda: layer_nb(x, splits).backward(grad),
        "function": lambda: apply_triton_linear(x, layer.weight, layer.bias, splits,
                                                launches).backward(grad),
        "function, no bias": lambda: apply_triton_linear(x, layer_nb.weight, None, splits,
                                                         launches_nb).backward(grad),
        "bare": lambda: Bare.apply(x, w, b, splits).backward(grad),
    }
    names = list(steps)
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int, device="cuda")
    for step in steps.values():
        for _ in range(50):
            step()
    warm_gpu(300)  # the small steps alone do not bring the GPU to its sustained clocks
    torch.cuda.synchronize()

    times = {name: [] for name in names}
    for i in range(iterations):
        order = names[i % len(names):] + names[:i % len(names)]
        events = []
        for name in order:
            for t in leaves:
                t.grad = None
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steps[name]()
            end.record()
            events.append((name, start, end))
        end.synchronize()
        for name, start, end in events:
            times[name].append(start.elapsed_time(end) * 1e3)

    raw = times["raw grouped_mm"]
    print(f"{iterations} iterations, every case once per iteration (µs, forward+backward)")
    print(f"{'case':16s} {'median':>8s} {'quartiles':>15s} {'/ raw':>6s} {'95% interval':>13s} "
          f"{'at or under raw':>16s}")
    for name in names:
        ratios = [t / r for t, r in zip(times[name], raw)]
        q = statistics.quantiles(times[name], n=4)
        low, high = _median_interval(ratios)
        under = sum(r <= 1.0 for r in ratios) / len(ratios)
        print(f"{name:16s} {statistics.median(times[name]):8.1f} {q[0]:7.1f}-{q[2]:<7.1f} "
              f"{statistics.median(ratios):6.3f} {low:6.3f}-{high:<6.3f} {under:15.0%}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
