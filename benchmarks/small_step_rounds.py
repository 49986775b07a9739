"""The small step (8 groups x 128 rows, 1024 -> 1024, bf16, CUDA splits) as the bench times
it, in alternating rounds, with the host time of its forward and its backward.

``PYTHONPATH=. python benchmarks/small_step_rounds.py [rounds]``. Each round times raw
``grouped_mm``, this layer with and without bias, and a bare Python autograd node (the
least a Python node costs: the autograd engine's hand-off to its device thread): first a
loop shaped like ``do_bench``'s (gradients reset, L2 flushed, then one step) that reads the
host clock around the forward call and around ``backward()``, then ``do_bench`` itself.
Host time measured inside such a loop is the figure that matters: the same code runs up
to 2-3x slower there than in a tight loop of one call (caches cold after the backward).
Last, each case's forward+backward over raw's in the same round: the median of those
ratios, their quartiles, and how many rounds came in at or under raw.
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing
from autograd_floor import _Bare  # benchmarks/autograd_floor.py
from overhead import small_step_case  # benchmarks/overhead.py


def main(rounds: int) -> None:
    case = small_step_case()
    x, w, b, splits, offs, grad = case.x, case.w, case.b, case.splits, case.offs, case.grad
    layer, layer_nb = case.layer, case.layer_nb
    leaves = [x, w, b, *layer.parameters(), *layer_nb.parameters()]
    forwards = {
        "raw grouped_mm": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "layer": lambda: layer(x, splits),
        "layer, no bias": lambda: layer_nb(x, splits),
        "bare node": lambda: _Bare.apply(x, w, b, splits),
    }
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int, device="cuda")

    def host_times(forward, steps=300):
        fwd, bwd = [], []
        for _ in range(steps):
            for t in leaves:
                t.grad = None
            flush.zero_()
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            y.backward(grad)
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
        torch.cuda.synchronize()
        return statistics.median(fwd) * 1e6, statistics.median(bwd) * 1e6

    for forward in forwards.values():
        for _ in range(30):
            forward().backward(grad)
    torch.cuda.synchronize()
    medians = {name: ([], []) for name in forwards}
    print(f"{'round':5s} {'case':16s} {'host fwd':>9s} {'host bwd':>9s} {'do_bench fwd':>13s} "
          f"{'do_bench fwd+bwd':>17s}   (µs)")
    for r in range(rounds):
        for name, forward in forwards.items():
            host_fwd, host_bwd = host_times(forward)
            fwd = triton.testing.do_bench(forward, warmup=50, rep=80, grad_to_none=leaves,
                                          return_mode="median") * 1e3
            step = triton.testing.do_bench(lambda f=forward: f().backward(grad), warmup=50, rep=80,
                                           grad_to_none=leaves, return_mode="median") * 1e3
            medians[name][0].append(fwd)
            medians[name][1].append(step)
            print(f"{r:<5d} {name:16s} {host_fwd:9.1f} {host_bwd:9.1f} {fwd:13.1f} {step:17.1f}",
                  flush=True)
    raw_fwd, raw_step = (statistics.median(v) for v in medians["raw grouped_mm"])
    print(f"\nmedian over {rounds} rounds      fwd  (vs raw)   fwd+bwd  (vs raw)")
    for name, (fwds, steps) in medians.items():
        fwd, step = statistics.median(fwds), statistics.median(steps)
        print(f"{name:24s} {fwd:7.1f} ({fwd / raw_fwd:4.2f}x) {step:9.1f} ({step / raw_step:4.2f}x)")
    # Each round's ratio to raw's in the same round: host drift between rounds cancels.
    print("\nper-round fwd+bwd / raw's   median  quartiles   rounds under raw")
    for name, (_, steps) in medians.items():
        ratios = sorted(s / r for s, r in zip(steps, medians["raw grouped_mm"][1]))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        under = sum(r <= 1.0 for r in ratios)
        print(f"{name:24s} {statistics.median(ratios):7.2f}  {quartiles[0]:4.2f}-{quartiles[2]:4.2f}"
              f"   {under:>6d} / {len(ratios)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
