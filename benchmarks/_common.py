"""What the scripts in ``benchmarks/`` share: the bench's shapes, device inputs, the small
step, a wall-clock timer, a profiler summary and a bare autograd node.

Timing goes through the package's harness, :mod:`grouped_linear.cli.timing`
(``median_ms`` below is its ``median_seconds`` in milliseconds, with the long warm-up that
reaches the GPU's sustained clocks). The scripts run from the repository root as
``PYTHONPATH=. python benchmarks/<script>.py``, which puts this folder on the import path.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 (spawn)
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl
from grouped_linear.cli.bench import COPY_BANDWIDTH, Shape, load_shapes, uniform_shape
from grouped_linear.cli.timing import median_seconds, randn, warm_gpu
from grouped_linear.kernels.ends import group_ends

__all__ = ["COPY_BANDWIDTH", "CUDA", "E4M3", "Shape", "Bare", "bench_shapes", "device_groups",
           "distributed_arguments", "kernel_times", "median_ms", "part_arguments",
           "process_group", "profile_steps", "randn", "small_step_case", "spawn", "tflops",
           "wall_us", "warm_gpu"]

CUDA = torch.device("cuda")
E4M3 = torch.float8_e4m3fn


# --------------------------------------------------------------------------- shapes and inputs
def bench_shapes(names: Sequence[str] = ()) -> list[Shape]:
    """The bench's shapes (``grouped_linear/cli/shapes.json``) named in ``names``, default all
    of them. A name may also be ``uniform:G:M:K:N``: ``G`` equal groups of ``M // G`` rows,
    ``K`` -> ``N``."""
    shapes = load_shapes()
    if not names:
        return list(shapes.values())
    selected = []
    for name in names:
        if name.startswith("uniform:"):
            selected.append(uniform_shape(name))
        elif name in shapes:
            selected.append(shapes[name])
        else:
            raise SystemExit(f"unknown shape {name!r}; available: {sorted(shapes)} or "
                             "uniform:G:M:K:N")
    return selected


def device_groups(sizes: Sequence[int], num_rows: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sizes`` as ``(G,)`` int64 on the GPU and their int32 cumulative ``ends`` (clamped to
    ``num_rows``, default their sum), as the layer computes them."""
    sizes_t = torch.tensor(list(sizes), device=CUDA, dtype=torch.int64)
    return sizes_t, group_ends(sizes_t, sum(sizes) if num_rows is None else num_rows)


def part_arguments(doc: str, parts: Sequence[str], shapes_help: str | None = None
                   ) -> argparse.Namespace:
    """A script's command line ``[--part PART] [SHAPE ...]``: ``parts``, the parts to run
    (the one ``--part`` names, default all), and with ``shapes_help`` ``shapes``, the
    names given. ``doc``: the script's docstring, whose first line describes it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--part", choices=parts, default=None, help="one part only (default: all)")
    if shapes_help:
        parser.add_argument("shapes", nargs="*", help=shapes_help)
    args = parser.parse_args()
    args.parts = [args.part] if args.part else list(parts)
    return args


# --------------------------------------------------------------------------- timing
def median_ms(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = (),
              **options: int) -> float:
    """Median milliseconds of one call of ``fn`` on the GPU (``do_bench``, L2 flushed, the
    harness's long warm-up); ``options``: ``cuda_warmup_ms``, ``cuda_rep_ms``."""
    return median_seconds(fn, CUDA, grad_to_none=grad_to_none, **options) * 1e3


def tflops(flops: float, ms: float) -> float:
    """``flops`` done in ``ms`` milliseconds, in TFLOP/s."""
    return flops / ms / 1e9


def wall_us(fn: Callable[[], object], n: int = 300, warmup: int = 20,
            host_only: bool = False) -> float:
    """Microseconds per call of ``n`` back-to-back calls after a synchronized warm-up: until
    the GPU has finished them, or (``host_only``) until the host has queued them. For
    host-bound work, where ``do_bench``'s per-call events would hide the host's share."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if not host_only:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def profile_steps(step: Callable[[], object], warmup: int, steps: int,
                  activities: Iterable[ProfilerActivity] = (ProfilerActivity.CUDA,)) -> profile:
    """``warmup`` untimed calls of ``step``, then torch.profiler over ``steps`` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=list(activities)) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_times(step: Callable[[], object], warmup: int = 3, steps: int = 5
                 ) -> dict[str, tuple[float, float]]:
    """GPU time per step of each kernel ``step`` launches: ``{name: (µs per step, launches per
    step)}``, from torch.profiler over ``steps`` calls after ``warmup``."""
    prof = profile_steps(step, warmup, steps)
    return {e.key: (e.device_time_total / steps, e.count / steps) for e in prof.key_averages()
            if e.device_time_total > 0}


# --------------------------------------------------------------------------- the small step
def small_step_case() -> SimpleNamespace:
    """The small problem: 8 groups x 128 rows, 1024 -> 1024, bf16, CUDA splits.

    Fields: ``G, M, K, N, dtype``; ``sizes`` (host list), ``splits`` (CUDA int64) and ``ends``
    (int32 cumulative ends, for raw ``grouped_mm``'s ``offs``); leaves ``x`` ``(M, K)``, ``w``
    ``(G, N, K)``, ``b`` ``(G, N)`` for the raw cases; ``grad`` ``(M, N)``; ``layer`` and
    ``layer_nb``: :class:`grouped_linear.GroupedLinear` with and without bias.
    """
    torch.manual_seed(0)
    G, m, K, N = 8, 128, 1024, 1024
    M, dt = G * m, torch.bfloat16
    splits, ends = device_groups([m] * G)
    return SimpleNamespace(
        G=G, M=M, K=K, N=N, dtype=dt, sizes=[m] * G, splits=splits, ends=ends,
        x=randn(M, K, device=CUDA, dtype=dt, requires_grad=True),
        w=randn(G, N, K, device=CUDA, dtype=dt, scale=K ** -0.5, requires_grad=True),
        b=randn(G, N, device=CUDA, dtype=dt, requires_grad=True),
        grad=randn(M, N, device=CUDA, dtype=dt),
        layer=gl.GroupedLinear(G, K, N, params_dtype=dt, device=CUDA),
        layer_nb=gl.GroupedLinear(G, K, N, bias=False, params_dtype=dt, device=CUDA),
    )


class Bare(torch.autograd.Function):
    """A Python autograd node that only allocates its outputs: ``(x, w, b, sizes)`` ->
    ``(M, N)`` forward, gradients of ``x``, ``w`` and ``b`` backward. The least a Python
    node of the layer's shape costs (the autograd engine's hand-off included)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                sizes: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, sizes)
        return torch.empty(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, _ = ctx.saved_tensors
        bias_grad = torch.empty(w.shape[0], w.shape[1], device=w.device, dtype=w.dtype)
        return torch.empty_like(x), torch.empty_like(w), bias_grad, None


# --------------------------------------------------------------------------- several processes
def distributed_arguments(doc: str, world: int) -> argparse.ArgumentParser:
    """A parser with ``--world`` (default ``world``), ``--cpu`` (gloo on CPU instead of NCCL)
    and ``--tiny`` (a small problem, the smoke test); the script adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--world", type=int, default=world)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL")
    parser.add_argument("--tiny", action="store_true", help="a small problem (smoke test)")
    return parser


def spawn(worker: Callable, args) -> None:
    """``worker(rank, world, port, args)`` in ``args.world`` processes, NCCL's NVLink
    multicast off."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(args.world, port, args), nprocs=args.world,
                                join=True)


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int, cpu: bool) -> Iterator[torch.device]:
    """This rank's device (its GPU, or the CPU with ``cpu``) inside an initialised process
    group (NCCL, or gloo), destroyed on the way out. Run the body as a function call: its
    reference cycles (fully_shard's modules hold the group) are collected before the group
    is destroyed, not at interpreter exit, where freeing them aborts the process."""
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        yield device
        gc.collect()
    finally:
        dist.destroy_process_group()
