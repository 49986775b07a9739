"""Which backend should ``backend="auto"`` run on CPU: the per-group ``loop`` or ``grouped``
(torch's ``grouped_mm``, on CPU torch's own fallback)?

From the repository root, ``PYTHONPATH=. python benchmarks/cpu_backends.py [--threads 1,all]
[--rounds R] [--dtypes bf16,fp32] [--groups 8,32,128] [--shapes 512x256,1024x512,2048x768]
[--rows 4096] [--splits skewed|uniform]``. CPU only (no GPU is touched).

For each thread count (``torch.set_num_threads``; ``all``: every CPU), dtype, group count,
shape ``K x N`` and with and without bias, one forward+backward of ``gl.grouped_linear``
(``x`` ``(rows, K)``, ``weight`` ``(G, N, K)``, CPU split tensor) is timed with
``time.perf_counter`` for each backend, both in one process, in alternating rounds (the
order flips every round, so drift falls on both); the medians and the median of the
per-round ratios ``loop / grouped`` (above 1: ``grouped`` is faster) are printed, then the
ratios' geometric mean per thread count, dtype and bias. For fp32 each backend's forward is
also compared with a float64 reference (the largest error relative to the output's largest
magnitude).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import defaultdict

import torch

import grouped_linear as gl

BACKENDS = ("loop", "grouped")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        k, n = item.split("x")
        shapes.append((int(k), int(n)))
    return shapes


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,all",
                        help="comma-separated thread counts; 'all' is every CPU (default 1,all)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case (default 7)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="bf16 and/or fp32")
    parser.add_argument("--groups", type=_int_list, default=[8, 32, 128], help="group counts")
    parser.add_argument("--shapes", type=_shape_list,
                        default=[(512, 256), (1024, 512), (2048, 768)],
                        help="KxN feature sizes (in x out), comma-separated")
    parser.add_argument("--rows", type=int, default=4096, help="rows of x (tokens x top-k)")
    parser.add_argument("--splits", choices=("skewed", "uniform"), default="skewed",
                        help="rows per group: a fixed Dirichlet(0.5) draw, or equal")
    return parser.parse_args()


def _thread_counts(text: str) -> list[int]:
    every = os.cpu_count() or 1
    return [every if item == "all" else int(item) for item in text.split(",")]


def _sizes(rows: int, groups: int, kind: str) -> list[int]:
    """Rows per group summing to ``rows``: equal (the remainder on the first groups) or a
    seeded Dirichlet(0.5) draw, as a router's uneven counts."""
    if kind == "uniform":
        return [rows // groups + (g < rows % groups) for g in range(groups)]
    generator = torch.Generator().manual_seed(groups)
    gamma = torch.randn(groups, dtype=torch.float64, generator=generator).square()  # Gamma(1/2)
    sizes = (gamma / gamma.sum() * rows).floor().long().tolist()
    sizes[0] += rows - sum(sizes)
    return sizes


class Case:
    """The leaves and output gradient of one problem, and its timed step per backend."""

    def __init__(self, sizes: list[int], k: int, n: int, dtype: torch.dtype, bias: bool):
        rows, groups = sum(sizes), len(sizes)
        self.splits = torch.tensor(sizes, dtype=torch.int64)
        self.x = torch.randn(rows, k, dtype=dtype, requires_grad=True)
        self.weight = (torch.randn(groups, n, k, dtype=dtype) * k ** -0.5).requires_grad_()
        self.bias = torch.randn(groups, n, dtype=dtype, requires_grad=True) if bias else None
        self.grad = torch.randn(rows, n, dtype=dtype)
        self.leaves = [t for t in (self.x, self.weight, self.bias) if t is not None]

    def forward(self, backend: str) -> torch.Tensor:
        return gl.grouped_linear(self.x, self.weight, self.bias, self.splits, backend=backend)

    def step_seconds(self, backend: str) -> float:
        """Seconds of one forward+backward (gradients returned, nothing accumulated)."""
        start = time.perf_counter()
        out = self.forward(backend)
        torch.autograd.grad(out, self.leaves, self.grad)
        return time.perf_counter() - start

    def fp64_error(self, backend: str) -> float:
        """The forward's largest error against float64, relative to its largest value."""
        with torch.no_grad():
            bias = None if self.bias is None else self.bias.double()
            ref = gl.grouped_linear(self.x.double(), self.weight.double(), bias, self.splits,
                                    backend="loop")
            out = self.forward(backend).double()
        return ((out - ref).abs().max() / ref.abs().max()).item()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def time_backends(case: Case, rounds: int) -> tuple[dict[str, float], float]:
    """Median milliseconds of each backend's step over ``rounds`` alternating rounds (one
    untimed step each first), and the median over rounds of ``loop / grouped`` within a
    round (a slow spell of the machine falls on both sides of each ratio)."""
    for backend in BACKENDS:
        case.step_seconds(backend)
    seconds: dict[str, list[float]] = {backend: [] for backend in BACKENDS}
    for r in range(rounds):
        for backend in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
            seconds[backend].append(case.step_seconds(backend))
    ratios = [loop / grouped for loop, grouped in zip(seconds["loop"], seconds["grouped"])]
    return {backend: _median(values) * 1e3 for backend, values in seconds.items()}, _median(ratios)


def main() -> None:
    args = _arguments()
    torch.manual_seed(0)
    ratios: dict[tuple[int, str, bool], list[float]] = defaultdict(list)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, rows {args.rows}, "
          f"{args.splits} splits, {args.rounds} rounds; forward+backward medians")
    print(f"{'thr':>3s} {'dtype':5s} {'G':>4s} {'K x N':>11s} {'bias':4s} | "
          f"{'loop ms':>8s} {'grouped ms':>10s} {'loop/grp':>8s} | fp32 error loop, grouped")
    for threads in _thread_counts(args.threads):
        torch.set_num_threads(threads)
        for label in args.dtypes.split(","):
            dtype = DTYPES[label]
            for groups in args.groups:
                sizes = _sizes(args.rows, groups, args.splits)
                for k, n in args.shapes:
                    for bias in (False, True):
                        case = Case(sizes, k, n, dtype, bias)
                        ms, ratio = time_backends(case, args.rounds)
                        ratios[(threads, label, bias)].append(ratio)
                        errors = ""
                        if dtype == torch.float32:
                            errors = ", ".join(f"{case.fp64_error(b):.1e}" for b in BACKENDS)
                        print(f"{threads:3d} {label:5s} {groups:4d} {f'{k} x {n}':>11s} "
                              f"{'yes' if bias else 'no':4s} | {ms['loop']:8.2f} "
                              f"{ms['grouped']:10.2f} {ratio:8.2f} | {errors}", flush=True)
    print("\ngeometric mean of loop/grouped (above 1: grouped faster), min-max")
    for (threads, label, bias), values in ratios.items():
        mean = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"threads {threads:2d} {label:5s} bias {'yes' if bias else 'no ':3s}: "
              f"{mean:.2f} ({min(values):.2f}-{max(values):.2f}) over {len(values)} cases")


if __name__ == "__main__":
    main()
