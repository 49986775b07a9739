"""``python -m grouped_linear bench``: this library against the baselines, side by side.

Columns, measured in one process on random inputs of each shape's sizes (the same gradient):

* ``dense``: one ``torch.matmul`` ``(M, K) @ (K, N)`` of the same FLOPs (the ceiling);
* ``loop``: a separate weight tensor per expert and one ``torch.matmul`` per group
  (the legacy per-expert path);
* ``torch``: ``torch.nn.functional.grouped_mm`` on a ``(G, N, K)`` weight (CUDA only);
* ``torchao``: torchao's FP8 rowwise MoE grouped GEMM, when importable on CUDA; it
  needs 16-aligned groups, so it runs on the splits rounded up to multiples of 16
  (and its TFLOP/s count that rounded work);
* ``gl_nobias``: :class:`grouped_linear.GroupedLinear` without bias;
* ``grouped_linear``: :class:`grouped_linear.GroupedLinear` (with its bias, the
  default layer); both called with the splits as a device int64 tensor;
* ``fp8_row`` / ``fp8_tensor`` / ``fp8_block``: ``GroupedLinear`` without bias under
  ``Float8Rowwise()`` / ``Float8Tensorwise()`` / ``Float8Blockwise()`` (CUDA, bf16), the
  weight quantized on every call (no cache across microbatches), on the exact splits;
* ``fp8_row_cached``: ``fp8_row`` with the weight's FP8 copies reused from the cache
  (``is_first_microbatch=False``: the microbatches after the first of a step, under
  gradient accumulation).

A latency row (``small_8x128``: 8 groups of 128 rows, 1024 -> 1024) follows the
packaged shapes on CUDA.

Figures are TFLOP/s from median times, forward (``2*M*K*N`` FLOPs) and
forward+backward (3x that). On CPU the packaged shapes are scaled down. The tables and
the chart are drawn by :mod:`grouped_linear.cli.report`.
"""

from __future__ import annotations

import json
import platform
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources

import torch
import torch.nn.functional as F

import grouped_linear as gl
from grouped_linear.kernels.gemm import fp8_torch_gemm

from .demo import resolve_device
from .report import RATIOS, SMALL_SHAPE_NAME, ratio, render_table, write_plot
from .timing import median_seconds, peak_memory_bytes, progress, randn

__all__ = ["COLUMNS", "Shape", "load_shapes", "uniform_shape", "scale_for_cpu", "run_bench",
           "render_table"]

COLUMNS = ("dense", "loop", "torch", "torchao", "gl_nobias", "grouped_linear", "fp8_row",
           "fp8_row_cached", "fp8_tensor", "fp8_block")
_FP8_COLUMNS = {"fp8_row": gl.recipes.Float8Rowwise, "fp8_row_cached": gl.recipes.Float8Rowwise,
                "fp8_tensor": gl.recipes.Float8Tensorwise,
                "fp8_block": gl.recipes.Float8Blockwise}
COPY_BANDWIDTH = 4.25e12  # bytes/s read + written, device-to-device copy measured on the H200
CPU_SPLIT_DIVISOR = 64
CPU_FEATURE_DIVISOR = 8
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: rows per group, ``K`` = in_features, ``N`` = out_features."""

    name: str
    splits: tuple[int, ...]
    K: int
    N: int
    note: str = ""

    @property
    def G(self) -> int:
        return len(self.splits)

    @property
    def M(self) -> int:
        return sum(self.splits)

    @property
    def flops(self) -> int:
        """Forward FLOPs, ``2 * M * K * N``."""
        return 2 * self.M * self.K * self.N


def load_shapes() -> dict[str, Shape]:
    """The shapes packaged in ``grouped_linear/cli/shapes.json``, by name."""
    text = resources.files("grouped_linear.cli").joinpath("shapes.json").read_text()
    raw = json.loads(text)
    return {
        name: Shape(name, tuple(int(s) for s in entry["splits"]), int(entry["K"]),
                    int(entry["N"]), entry.get("note", ""))
        for name, entry in raw.items()
        if not name.startswith("_")
    }


def uniform_shape(name: str) -> Shape:
    """``uniform:G:M:K:N``: ``G`` groups of ``M // G`` rows each, ``K`` -> ``N``."""
    parts = name.split(":")
    try:
        G, M, K, N = (int(v) for v in parts[1:])
    except ValueError:
        raise ValueError(f"shape {name!r}: expected uniform:G:M:K:N with four integers") \
            from None
    if parts[0] != "uniform" or min(G, M, K, N) < 1 or M < G:
        raise ValueError(f"shape {name!r}: expected uniform:G:M:K:N, all positive, M >= G")
    return Shape(name, (M // G,) * G, K, N)


def scale_for_cpu(shape: Shape) -> Shape:
    """A smaller problem of the same kind: group sizes ``// 64``, ``K`` and ``N`` ``// 8``.

    Empty groups stay empty and non-empty groups keep at least one row, so the
    zeros and the unaligned sizes of the original survive.
    """
    splits = tuple(0 if s == 0 else max(1, s // CPU_SPLIT_DIVISOR) for s in shape.splits)
    return Shape(shape.name, splits, max(1, shape.K // CPU_FEATURE_DIVISOR),
                 max(1, shape.N // CPU_FEATURE_DIVISOR), shape.note)


# --------------------------------------------------------------------------- one case
@dataclass
class _Case:
    """What a column needs to be timed: forward, forward+backward, grads to reset."""

    forward: Callable[[], object]
    forward_backward: Callable[[], object]
    leaves: list[torch.Tensor] = field(default_factory=list)
    flops: int | None = None  # forward FLOPs when the column runs other work than the shape


def _build_case(column: str, shape: Shape, device: torch.device, dtype: torch.dtype,
                grad_out: torch.Tensor) -> _Case:
    M, K, N, G = shape.M, shape.K, shape.N, shape.G
    w_scale = K ** -0.5
    x = randn(M, K, device=device, dtype=dtype, requires_grad=True)

    if column == "dense":
        w = randn(K, N, device=device, dtype=dtype, scale=w_scale, requires_grad=True)

        def fwd():
            return torch.matmul(x, w)

        leaves = [x, w]
    elif column == "loop":
        weights = [randn(N, K, device=device, dtype=dtype, scale=w_scale, requires_grad=True)
                   for _ in range(G)]
        sizes = list(shape.splits)

        def fwd():
            pieces = x.split(sizes)
            return torch.cat([torch.matmul(p, w.t()) for p, w in zip(pieces, weights)])

        leaves = [x, *weights]
    elif column == "torch":
        w = randn(G, N, K, device=device, dtype=dtype, scale=w_scale, requires_grad=True)
        offs = torch.tensor(shape.splits, dtype=torch.int64).cumsum(0).to(device, torch.int32)

        def fwd():
            return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)

        leaves = [x, w]
    elif column == "torchao":
        return _torchao_case(shape, device, dtype)
    elif column in ("grouped_linear", "gl_nobias", *_FP8_COLUMNS):
        recipe = _FP8_COLUMNS[column]() if column in _FP8_COLUMNS else None
        layer = gl.GroupedLinear(G, K, N, bias=column == "grouped_linear", params_dtype=dtype,
                                 device=device, recipe=recipe)
        with torch.no_grad():
            layer.weight.copy_(randn(G, N, K, device=device, dtype=dtype, scale=w_scale))
            if layer.bias is not None:
                layer.bias.copy_(randn(G, N, device=device, dtype=dtype, scale=0.1))
        splits = torch.tensor(shape.splits, dtype=torch.int64, device=device)
        cached = False if column == "fp8_row_cached" else None  # is_first_microbatch

        def fwd():
            return layer(x, splits, is_first_microbatch=cached)

        leaves = [x, *layer.parameters()]
    else:
        raise ValueError(f"column={column!r} is not one of {COLUMNS}")

    def fwd_bwd():
        fwd().backward(grad_out)

    return _Case(fwd, fwd_bwd, leaves)


def _small_shape() -> Shape:
    return Shape(SMALL_SHAPE_NAME, (128,) * 8, 1024, 1024,
                 "small problem: latency matters more than TFLOP/s")


def torchao_available() -> bool:
    """Whether torchao's FP8 rowwise grouped GEMM can be imported."""
    try:
        from torchao.prototype.moe_training import (  # noqa: F401
            _to_fp8_rowwise_then_scaled_grouped_mm,
        )
    except Exception:  # noqa: BLE001 (any import failure means: not available)
        return False
    return True


def _torchao_case(shape: Shape, device: torch.device, dtype: torch.dtype) -> _Case:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    sizes = [-(-s // 16) * 16 for s in shape.splits]
    M, K, N, G = sum(sizes), shape.K, shape.N, shape.G
    x = randn(M, K, device=device, dtype=dtype, requires_grad=True)
    w = randn(G, N, K, device=device, dtype=dtype, scale=K ** -0.5, requires_grad=True)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device, torch.int32)
    grad_out = randn(M, N, device=device, dtype=dtype)

    def fwd():
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            x, w.transpose(-2, -1), offs, out_dtype=dtype, pad_token_groups_for_grouped_mm=False
        )

    def fwd_bwd():
        fwd().backward(grad_out)

    return _Case(fwd, fwd_bwd, [x, w], flops=2 * M * K * N)


def _tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 else float("nan")


def _measure(column: str, shape: Shape, device: torch.device, dtype: torch.dtype,
             grad_out: torch.Tensor, reps: int) -> dict:
    """One round of one column: forward and forward+backward seconds, peak memory."""
    case = _build_case(column, shape, device, dtype, grad_out)
    return {
        "fwd_s": median_seconds(case.forward, device, grad_to_none=case.leaves, reps=reps),
        "fwd_bwd_s": median_seconds(case.forward_backward, device, grad_to_none=case.leaves,
                                    reps=reps),
        "peak_mem_bytes": peak_memory_bytes(case.forward_backward, device,
                                            grad_to_none=case.leaves),
        "flops": case.flops or shape.flops,
    }


def _summarize(rounds: list[dict]) -> dict:
    """A column's figures: the median over its rounds (each round's times kept too)."""
    fwd_s = statistics.median(r["fwd_s"] for r in rounds)
    fb_s = statistics.median(r["fwd_bwd_s"] for r in rounds)
    flops = rounds[0]["flops"]
    return {
        "fwd_ms": fwd_s * 1e3,
        "fwd_bwd_ms": fb_s * 1e3,
        "fwd_tflops": _tflops(flops, fwd_s),
        "fwd_bwd_tflops": _tflops(3 * flops, fb_s),
        "peak_mem_bytes": rounds[0]["peak_mem_bytes"],
        "rounds_fwd_ms": [r["fwd_s"] * 1e3 for r in rounds],
        "rounds_fwd_bwd_ms": [r["fwd_bwd_s"] * 1e3 for r in rounds],
    }


# --------------------------------------------------------------------------- driver
def _run_cases(selected: list[Shape], columns: list[str], dev: torch.device,
               torch_dtype: torch.dtype, reps: int, quiet: bool, rounds: int = 1) -> list[dict]:
    """Measure every column on every shape, ``rounds`` times in alternation (all columns of
    a shape, then all again), with a progress bar."""
    results = []
    bar = progress(len(selected) * len(columns) * rounds, desc="bench", disable=quiet)
    for shape in selected:
        torch.manual_seed(0)
        grad_out = randn(shape.M, shape.N, device=dev, dtype=torch_dtype)
        entry = {"shape": shape.name, "G": shape.G, "M": shape.M, "K": shape.K, "N": shape.N,
                 "splits": list(shape.splits), "note": shape.note, "fwd_flops": shape.flops,
                 "columns": {}}
        measured: dict[str, list[dict]] = {column: [] for column in columns}
        for index in range(rounds):
            for column in columns:
                bar.set_description(f"bench {shape.name}: {column}"
                                    + (f" (round {index + 1}/{rounds})" if rounds > 1 else ""))
                measured[column].append(_measure(column, shape, dev, torch_dtype, grad_out, reps))
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                bar.update(1)
        entry["columns"] = {column: _summarize(runs) for column, runs in measured.items()}
        cols = entry["columns"]
        entry["ratios"] = {
            label: {key: ratio(cols.get(name), cols.get(base), key)
                    for key in ("fwd_tflops", "fwd_bwd_tflops")}
            for label, name, base in RATIOS if name in cols and base in cols
        }
        if "grouped_linear" in cols and "gl_nobias" in cols:
            entry["bias_overhead"] = _bias_overhead(shape, cols, torch_dtype)
        results.append(entry)
        del grad_out
    bar.close()
    return results


def _bias_overhead(shape: Shape, cols: dict, dtype: torch.dtype) -> dict:
    """Time the bias adds (with bias minus without) against one pass over the output
    forward and one over its gradient backward at the measured copy bandwidth."""
    element = torch.finfo(dtype).bits // 8
    out_bytes = shape.M * shape.N * element
    bound_fwd_ms = 2 * out_bytes / COPY_BANDWIDTH * 1e3        # read + write the output
    bound_fwd_bwd_ms = bound_fwd_ms + out_bytes / COPY_BANDWIDTH * 1e3  # + read the gradient
    with_bias, without = cols["grouped_linear"], cols["gl_nobias"]
    return {
        "fwd_ms": with_bias["fwd_ms"] - without["fwd_ms"],
        "fwd_bwd_ms": with_bias["fwd_bwd_ms"] - without["fwd_bwd_ms"],
        "bound_fwd_ms": bound_fwd_ms,
        "bound_fwd_bwd_ms": bound_fwd_bwd_ms,
    }


def run_bench(
    shapes: Sequence[str] | dict[str, Shape] | None = None,
    device: str | torch.device = "auto",
    dtype: str | None = None,
    json_path: str | None = None,
    plot_path: str | None = None,
    reps: int = 5,
    quiet: bool = False,
    scale: bool | None = None,
    columns: Sequence[str] | None = None,
    rounds: int = 1,
) -> dict:
    """Measure every column on every shape, print the table and return all numbers.

    Args:
        shapes: names from ``shapes.json`` (default: all of them) or ``uniform:G:M:K:N``
            (:func:`uniform_shape`), or a dict of :class:`Shape` to measure as given.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        dtype: ``"bf16"`` or ``"fp32"`` (default: bf16 on CUDA, fp32 on CPU).
        json_path: write the returned dict there as JSON.
        plot_path: write a PNG bar chart there (matplotlib).
        reps: timed repetitions per case on CPU (CUDA uses ``do_bench``'s budget).
        quiet: no progress bar and no table.
        scale: scale the shapes down (default: on CPU, for packaged shapes only; not the
            ``uniform`` ones).
        columns: the columns to measure (default: every one available here; the
            FP8 columns need an sm90 GPU and bf16, ``torchao`` needs torchao).
        rounds: measure each shape's columns this many times in alternation and report
            the median per column (a shared GPU or host drifts between cases; rounds
            spread that drift over every column).

    Returns:
        ``{"device", "dtype", "scaled", "columns", "results": [...], "table"}``;
        each result holds the shape and, per column, ``fwd_ms``, ``fwd_bwd_ms``,
        ``fwd_tflops``, ``fwd_bwd_tflops`` and ``peak_mem_bytes`` (CUDA only),
        plus the ``gl/torch`` and ``gl/loop`` ratios.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: expected a positive int")
    dev = resolve_device(device)
    dtype_name = dtype or ("bf16" if dev.type == "cuda" else "fp32")
    if dtype_name not in _DTYPES:
        raise ValueError(f"dtype={dtype_name!r} is not one of {tuple(_DTYPES)}")
    torch_dtype = _DTYPES[dtype_name]
    scale_given = scale is not None
    if scale is None:
        scale = dev.type == "cpu" and not isinstance(shapes, dict)

    if isinstance(shapes, dict):
        selected = list(shapes.values())
    else:
        available = load_shapes()
        names = list(shapes) if shapes else list(available)
        if dev.type == "cuda":
            available[SMALL_SHAPE_NAME] = _small_shape()
            if not shapes:
                names.append(SMALL_SHAPE_NAME)
        for name in names:
            if name.startswith("uniform:"):
                available[name] = uniform_shape(name)
        unknown = [n for n in names if n not in available]
        if unknown:
            raise ValueError(f"unknown shape(s) {unknown}; available: {sorted(available)} or "
                             "uniform:G:M:K:N")
        selected = [available[n] for n in names]
    if scale:  # by default the packaged shapes only: a uniform one is measured as asked
        selected = [scale_for_cpu(s) if scale_given or not s.name.startswith("uniform:")
                    else s for s in selected]
    if columns is not None:
        unknown = [c for c in columns if c not in COLUMNS]
        if unknown:
            raise ValueError(f"unknown column(s) {unknown}; available: {list(COLUMNS)}")
    fp8_here = dev.type == "cuda" and torch_dtype == torch.bfloat16 and fp8_torch_gemm.available(dev)
    asked = columns
    columns = [c for c in COLUMNS
               if (columns is None or c in columns)
               and (c != "torch" or dev.type == "cuda")
               and (c != "torchao" or (dev.type == "cuda" and torch_dtype == torch.bfloat16
                                       and torchao_available()))
               and (c not in _FP8_COLUMNS or fp8_here)]
    if not columns:
        raise ValueError(f"none of the columns {asked} runs on {dev.type} in {dtype_name} "
                         "(torch, torchao and the FP8 columns need CUDA, bf16 and, for FP8, sm90)")

    with warnings.catch_warnings():
        # torch warns once when autograd's CUDA thread first creates its cuBLAS handle.
        warnings.filterwarnings("ignore", message=".*no current CUDA context.*")
        results = _run_cases(selected, columns, dev, torch_dtype, reps, quiet, rounds)

    report = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
        else (platform.processor() or platform.machine()),
        "dtype": dtype_name,
        "torch_version": torch.__version__,
        "grouped_linear_version": gl.__version__,
        "scaled": bool(scale),
        "scale": {"split_divisor": CPU_SPLIT_DIVISOR, "feature_divisor": CPU_FEATURE_DIVISOR}
        if scale else None,
        "columns": columns,
        "rounds": rounds,
        "results": results,
    }
    report["table"] = render_table(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1, allow_nan=True)
    if plot_path:
        write_plot(report, plot_path)
    if not quiet:
        print(report["table"])
    return report
