"""``python -m grouped_linear bench --suite fine``: one grouped linear layer in the
fine-grained regime (many small groups) against raw ``torch.nn.functional.grouped_mm`` on
the same splits.

The cells (:data:`GRID`, 72 on CUDA): ``G`` in {64, 128, 256} groups, {8, 32, 128} rows per
group on average, two split kinds and four ``(K, N)`` = (in, out) features. ``balanced``
gives every group the same rows; ``skewed`` (:func:`skewed_sizes`) keeps the same total
``M = G * rows`` but, drawn with the fixed seed :data:`SEED`, empties a quarter of the
groups (at least one), gives an eighth of them (at least one) three times the mean each and
spreads the remaining rows uniformly at random over the other groups. Splits are int64
tensors on the device (on CUDA: no host sync in the layer); x, the weight ``(G, N, K)`` and
the output gradient are normal random values (the weight scaled by ``K ** -0.5``) drawn
with a fixed seed.

Columns, timed one after the other within a round, each cell's round after :func:`warm_gpu`
(which brings the GPU to its sustained clocks, so each column's ``do_bench`` warm-up is
:data:`CUDA_WARMUP_MS`, shorter than the harness default, and the 72 cells take minutes):

* ``torch``: ``F.grouped_mm(x, w.transpose(-2, -1), offs=ends)`` as the gemm suite calls
  it, forward + backward (x and weight gradients);
* ``gl``: ``gl.grouped_linear(x, w, None, splits)`` (backend ``auto``; the route it takes is
  shown per cell), forward + backward;
* ``row`` / ``block``: the same call with ``recipe=Float8Rowwise()`` / ``Float8Blockwise()``,
  the weight quantized in every call (CUDA with compute capability >= 8.9, bf16);
* ``row_cached`` / ``block_cached``: a ``gl.GroupedLinear`` of that recipe and weight called
  with ``is_first_microbatch=False`` after one ``is_first_microbatch=True`` call, its FP8
  weight cache warm (the microbatches after the first of a step);
* ``torch_fwd`` / ``gl_fwd``: ``torch`` / ``gl`` forward only, under ``torch.no_grad()``.

Per cell and column: the median time (of ``do_bench`` medians over ``rounds``), TFLOP/s
(``3 * 2*M*K*N`` forward + backward, ``2*M*K*N`` forward), the ratio ``torch ms / column ms``
(forward-only columns against ``torch_fwd``), the peak CUDA memory the call adds to what is
allocated before it, the relative error (Frobenius norm) of the output and of the weight
gradient against a float64 per-group loop on the same device, whether it is within the
column's tolerance (bf16 1e-2, FP8 6e-2, float32 1e-5), and whether every empty group's
weight gradient is exactly zero (true where a cell has none). The summary gives, per
``(K, N)`` and over all cells, each column's min, median and max ratio with the cell of the
min, next to the targets: bf16 forward + backward >= 1.0x everywhere and >= 1.3x median,
forward-only >= 1.0x, FP8 cached >= 1.0x in cells of >= 64 rows per group, >= 0.9x below.
On CUDA it also gives the ceiling the bytes set on any bf16 column's ratio (``floor``
rows): torch's time over the time to read and write what forward and backward must
(:func:`byte_floor_ms`) at the device's measured copy bandwidth.

On CPU (a smoke test, said so in the title line) the suite runs :data:`CPU_GRID` in float32
without the FP8 columns and without peak memory; ``grouped_mm``'s columns run wherever a
probe call succeeds on the device and dtype (torch 2.13 has a CPU float32 ``grouped_mm``)
and are left out elsewhere, with no ratios then.
"""

from __future__ import annotations

import gc
import json
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import grouped_linear as gl

from ..ops.checks import check_int
from ..ops.dispatch import fp8_route, resolve_backend
from .demo import resolve_device
from .timing import (
    copy_bandwidth,
    format_table,
    median_seconds,
    peak_memory_bytes,
    progress,
    warm_gpu,
)

__all__ = ["CPU_GRID", "GRID", "CellInputs", "Grid", "cell_columns", "render_fine_tables",
           "run_fine_bench", "skewed_sizes"]

SEED = 0
KINDS = ("balanced", "skewed")
BASELINES = {"fwd_bwd": "torch", "fwd": "torch_fwd"}
RECIPES = {"row": gl.recipes.Float8Rowwise, "block": gl.recipes.Float8Blockwise}
CACHED = {"row_cached": "row", "block_cached": "block"}
FORWARD_ONLY = ("torch_fwd", "gl_fwd")
HOT_FACTOR = 3  # a skewed split's hot groups get this many times the mean rows
ROWS_THRESHOLD = 64  # the FP8 cached targets differ below this many rows per group
# Per column: the smallest min ratio and median ratio asked, by rows-per-group subset.
TARGETS = {"gl": {"all": (1.0, 1.3)}, "gl_fwd": {"all": (1.0, None)},
           **{name: {f"rows>={ROWS_THRESHOLD}": (1.0, None), f"rows<{ROWS_THRESHOLD}": (0.9, None)}
              for name in CACHED}}
_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
FP8_TOLERANCE = 6e-2
CUDA_WARMUP_MS = 100  # per column; warm_gpu before each cell's round does the clock warm-up


@dataclass(frozen=True)
class Grid:
    """The cells: every combination of ``groups`` (G), ``rows`` (mean rows per group),
    ``kinds`` (``"balanced"``, ``"skewed"``) and ``features`` (``(K, N)`` pairs)."""

    groups: tuple[int, ...]
    rows: tuple[int, ...]
    kinds: tuple[str, ...] = KINDS
    features: tuple[tuple[int, int], ...] = ((2048, 768), (768, 2048), (4096, 2048),
                                             (7168, 2048))

    def __post_init__(self) -> None:
        for name in ("groups", "rows", "kinds", "features"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not value:
                raise TypeError(f"Grid {name}={value!r}: expected a non-empty tuple")
        for G in self.groups:
            check_int("Grid groups", G, minimum=4)
        for rows in self.rows:
            check_int("Grid rows", rows)
        for kind in self.kinds:
            if kind not in KINDS:
                raise ValueError(f"Grid kinds has {kind!r}: expected one of {KINDS}")
        for pair in self.features:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"Grid features has {pair!r}: expected a (K, N) tuple")
            for value in pair:  # grouped_mm needs 16-byte rows in every dtype measured
                if check_int("Grid features", value) % 8:
                    raise ValueError(f"Grid features has {pair!r}: K and N must be multiples of 8")

    def cells(self) -> list[dict]:
        """Each cell's name, ``G``, rows per group, kind, ``K``, ``N`` and group sizes, by
        ``(K, N)`` first."""
        return [{"name": f"G{G}_r{rows}_{kind}_{K}x{N}", "G": G, "rows_per_group": rows,
                 "split": kind, "K": K, "N": N,
                 "sizes": [rows] * G if kind == "balanced" else skewed_sizes(G, rows)}
                for K, N in self.features for G in self.groups for rows in self.rows
                for kind in self.kinds]


GRID = Grid(groups=(64, 128, 256), rows=(8, 32, 128))
CPU_GRID = Grid(groups=(4, 8), rows=(2, 8), features=((64, 32),))


def skewed_sizes(num_groups: int, rows: int) -> list[int]:
    """``num_groups`` sizes summing to ``num_groups * rows``, drawn with :data:`SEED`: a
    random quarter of the groups (at least one) empty, an eighth (at least one)
    :data:`HOT_FACTOR` times ``rows`` each, the remaining rows spread uniformly at random
    over the other groups (``num_groups >= 4``)."""
    generator = torch.Generator().manual_seed(SEED)
    order = torch.randperm(num_groups, generator=generator).tolist()
    empty, hot = max(1, num_groups // 4), max(1, num_groups // 8)
    sizes = [0] * num_groups
    for g in order[empty:empty + hot]:
        sizes[g] = HOT_FACTOR * rows
    rest = order[empty + hot:]
    picks = torch.randint(len(rest), (num_groups * rows - hot * HOT_FACTOR * rows,),
                          generator=generator)
    for g, count in zip(rest, torch.bincount(picks, minlength=len(rest)).tolist()):
        sizes[g] = count
    return sizes


def _grouped_mm_available(dev: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs forward and backward on ``dev`` in ``dtype``."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=dev, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 8, device=dev, dtype=dtype, requires_grad=True)
        out = F.grouped_mm(x, w.transpose(-2, -1),
                           offs=torch.tensor([1, 4], device=dev, dtype=torch.int32))
        out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _columns(dev: torch.device, dtype: torch.dtype) -> list[str]:
    raw = _grouped_mm_available(dev, dtype)
    fp8 = (dev.type == "cuda" and dtype == torch.bfloat16
           and torch.cuda.get_device_capability(dev) >= (8, 9))
    return ([*(["torch"] if raw else []), "gl", *((*RECIPES, *CACHED) if fp8 else ()),
             *(["torch_fwd"] if raw else []), "gl_fwd"])


@dataclass
class _Column:
    """One column of a cell: ``call`` runs it once (returns the output), ``weight`` is the
    leaf that receives its weight gradient, ``leaves`` the gradients to reset."""

    call: Callable[[], torch.Tensor]
    weight: torch.Tensor
    leaves: list[torch.Tensor]
    backward: bool
    tolerance: float


def _column(name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
            splits: torch.Tensor, ends: torch.Tensor,
            layers: dict[str, gl.GroupedLinear]) -> _Column:
    weight = w
    if name in ("torch", "torch_fwd"):
        def forward() -> torch.Tensor:
            return F.grouped_mm(x, w.transpose(-2, -1), offs=ends)
    elif name in CACHED:
        layer = layers[name]
        weight = layer.weight

        def forward() -> torch.Tensor:
            return layer(x, splits, is_first_microbatch=False)
    else:
        recipe = RECIPES[name]() if name in RECIPES else None

        def forward() -> torch.Tensor:
            return gl.grouped_linear(x, w, None, splits, recipe=recipe)

    backward = name not in FORWARD_ONLY
    if backward:
        def call() -> torch.Tensor:
            out = forward()
            out.backward(dy)
            return out
    else:
        def call() -> torch.Tensor:
            with torch.no_grad():
                return forward()
    fp8 = name in RECIPES or name in CACHED
    return _Column(call, weight, [x, weight], backward,
                   FP8_TOLERANCE if fp8 else _TOLERANCE[x.dtype])


def _clear(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.grad = None


def _relative_errors(out: torch.Tensor, dw: torch.Tensor | None, x: torch.Tensor,
                     w: torch.Tensor, dy: torch.Tensor, sizes: list[int]
                     ) -> tuple[float, float | None]:
    """Relative errors of ``out`` and ``dw`` against a float64 loop over the groups."""
    sums = torch.zeros(4, dtype=torch.float64, device=x.device)  # out diff, out ref, dw ...
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        start += size
        xg = x[rows].double()
        ref = xg @ w[g].double().T
        sums[0] += (out[rows].double() - ref).square().sum()
        sums[1] += ref.square().sum()
        if dw is not None:
            ref_dw = dy[rows].double().T @ xg
            sums[2] += (dw[g].double() - ref_dw).square().sum()
            sums[3] += ref_dw.square().sum()
    norms = sums.sqrt().tolist()
    return norms[0] / norms[1], None if dw is None else norms[2] / norms[3]


@dataclass
class CellInputs:
    """A cell's operands and its columns (:func:`cell_columns`)."""

    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    splits: torch.Tensor
    columns: dict[str, _Column]


def cell_columns(cell: dict, names: list[str], dev: torch.device,
                 dtype: torch.dtype) -> CellInputs:
    """The operands of ``cell`` (random, seeded) and its columns ``names``, the FP8 weight
    caches of the cached columns filled."""
    G, K, N, sizes = cell["G"], cell["K"], cell["N"], cell["sizes"]
    M = sum(sizes)
    generator = torch.Generator(device=dev).manual_seed(SEED)
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=generator).requires_grad_()
    w = torch.randn(G, N, K, device=dev, dtype=dtype, generator=generator)
    w = w.mul_(K ** -0.5).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=dtype, generator=generator)
    splits = torch.tensor(sizes, dtype=torch.int64, device=dev)
    ends = splits.cumsum(0).to(torch.int32)
    layers = {}
    for name in (n for n in names if n in CACHED):
        layer = gl.GroupedLinear(G, K, N, bias=False, params_dtype=dtype, device=dev,
                                 recipe=RECIPES[CACHED[name]]())
        layer.weight = torch.nn.Parameter(w.detach())  # w's storage: no copy per layer
        layer(x, splits, is_first_microbatch=True).backward(dy)  # fills the FP8 weight cache
        _clear([x, layer.weight])
        layers[name] = layer
    columns = {name: _column(name, x, w, dy, splits, ends, layers) for name in names}
    return CellInputs(x, w, dy, splits, columns)


def byte_floor_ms(G: int, M: int, K: int, N: int, element_size: int, bandwidth: float
                  ) -> tuple[float, float]:
    """Milliseconds to move the bytes no implementation can avoid, at ``bandwidth`` (read +
    written bytes per second): forward+backward reads ``x`` and the weight, writes ``y``
    (forward), reads ``dy`` and the weight, writes ``dx`` (dgrad), reads ``dy`` and ``x``,
    writes ``dW`` (wgrad); and the forward alone."""
    weight, rows = G * N * K, M * (K + N)
    return (element_size * (3 * weight + 3 * rows) / bandwidth * 1e3,
            element_size * (weight + rows) / bandwidth * 1e3)


def _measure_cell(cell: dict, names: list[str], dev: torch.device, dtype: torch.dtype,
                  rounds: int, reps: int, bandwidth: float | None = None) -> dict:
    G, K, N, sizes = cell["G"], cell["K"], cell["N"], cell["sizes"]
    M = sum(sizes)
    inputs = cell_columns(cell, names, dev, dtype)
    x, w, dy, columns = inputs.x, inputs.w, inputs.dy, inputs.columns
    empty = inputs.splits == 0
    result = {**cell, "M": M, "empty_groups": int(empty.sum()), "columns": {},
              "gl_route": resolve_backend("auto", dev, dtype, K, N, M, G),
              "fp8_routes": "/".join(fp8_route(RECIPES[r](), dev, dtype, K, N, G, M)
                                     .removeprefix("fp8_") for r in RECIPES)}
    for name, column in columns.items():
        _clear(column.leaves)
        out = column.call()
        dw = column.weight.grad if column.backward else None
        out_err, dw_err = _relative_errors(out, dw, x, w, dy, sizes)
        result["columns"][name] = {
            "out_rel_err": out_err, "wgrad_rel_err": dw_err, "tolerance": column.tolerance,
            "within_tolerance": max(out_err, dw_err or 0.0) <= column.tolerance,
            "empty_wgrad_zero": None if dw is None else bool((dw[empty] == 0).all()),
        }
        del out, dw
        _clear(column.leaves)

    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        warm_gpu(device=dev)
        for name, column in columns.items():
            seconds[name].append(median_seconds(column.call, dev, reps=reps,
                                                grad_to_none=column.leaves,
                                                cuda_warmup_ms=CUDA_WARMUP_MS))
            _clear(column.leaves)
    for name, column in columns.items():
        entry = result["columns"][name]
        median = statistics.median(seconds[name])
        flops = (3 if column.backward else 1) * 2 * M * K * N
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        peak = peak_memory_bytes(column.call, dev, grad_to_none=column.leaves)
        entry.update({"ms": median * 1e3, "rounds_ms": [s * 1e3 for s in seconds[name]],
                      "tflops": flops / median / 1e12 if median > 0 else None,
                      "peak_bytes": None if peak is None else peak - before})
    for name, entry in result["columns"].items():
        base = result["columns"].get(BASELINES["fwd" if name in FORWARD_ONLY else "fwd_bwd"])
        entry["ratio"] = base["ms"] / entry["ms"] if base and entry["ms"] > 0 else None
    if bandwidth is not None:  # the most any column could gain on torch: its time / the floor
        floors = byte_floor_ms(G, M, K, N, x.element_size(), bandwidth)
        result["floor_ms"] = floors[0]
        for kind, floor in zip(("fwd_bwd", "fwd"), floors):
            base = result["columns"].get(BASELINES[kind])
            result[f"{kind}_ceiling"] = base["ms"] / floor if base else None
    return result


def _summary(cells: list[dict], names: list[str]) -> list[dict]:
    """Min, median and max ratio per ``(K, N)`` (and over all cells) and column, the
    cached FP8 columns split at :data:`ROWS_THRESHOLD` rows per group."""
    groups = {f"{c['K']}x{c['N']}": [] for c in cells}
    for cell in cells:
        groups[f"{cell['K']}x{cell['N']}"].append(cell)
    groups["all"] = cells
    rows = []
    for features, members in groups.items():
        for kind in ("fwd_bwd", "fwd"):  # the byte floor's ceiling on any column's ratio
            ceilings = [(c[f"{kind}_ceiling"], c["name"]) for c in members
                        if c.get(f"{kind}_ceiling") is not None]
            if ceilings:
                values = [v for v, _ in ceilings]
                rows.append({"features": features, "column": f"floor ({kind})", "cells": "all",
                             "count": len(values), "min": min(values),
                             "median": statistics.median(values), "max": max(values),
                             "worst": min(ceilings)[1], "target": None, "met": None})
        for name in names:
            if name in BASELINES.values():
                continue
            subsets = {"all": members}
            if name in CACHED:
                subsets = {f"rows>={ROWS_THRESHOLD}": [c for c in members
                                                       if c["rows_per_group"] >= ROWS_THRESHOLD],
                           f"rows<{ROWS_THRESHOLD}": [c for c in members
                                                      if c["rows_per_group"] < ROWS_THRESHOLD]}
            for subset, chosen in subsets.items():
                measured = [(c["columns"][name]["ratio"], c["name"]) for c in chosen
                            if c["columns"][name]["ratio"] is not None]
                if not measured:
                    continue
                ratios = [r for r, _ in measured]
                low, high = min(ratios), max(ratios)
                median = statistics.median(ratios)
                target = TARGETS.get(name, {}).get(subset)
                met = None if target is None else (
                    low >= target[0] and (target[1] is None or median >= target[1]))
                rows.append({"features": features, "column": name, "cells": subset,
                             "count": len(ratios), "min": low, "median": median, "max": high,
                             "worst": min(measured)[1],
                             "target": None if target is None else list(target), "met": met})
    return rows


def run_fine_bench(device: str | torch.device = "auto", json_path: str | None = None,
                   reps: int = 5, rounds: int = 1, grid: Grid | None = None) -> dict:
    """Measure every cell of ``grid`` (default :data:`GRID` on CUDA, :data:`CPU_GRID` on
    CPU); prints the tables and returns the report (also written as JSON to ``json_path``).
    ``reps``: timed calls per column on CPU (CUDA uses ``do_bench``'s budget); ``rounds``:
    alternating rounds per cell, the median reported."""
    check_int("reps", reps)
    check_int("rounds", rounds)
    if grid is not None and not isinstance(grid, Grid):
        raise TypeError(f"grid={grid!r}: expected a Grid or None")
    if json_path is not None and not isinstance(json_path, str):
        raise TypeError(f"json_path={json_path!r}: expected a str or None")
    dev = resolve_device(device)
    smoke = dev.type == "cpu"
    dtype = torch.float32 if smoke else torch.bfloat16
    grid = grid or (CPU_GRID if smoke else GRID)
    names = _columns(dev, dtype)
    cells = grid.cells()
    report = {"suite": "fine", "device": torch.cuda.get_device_name(dev) if not smoke else "cpu",
              "smoke_test": smoke, "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "grouped_linear": gl.__version__, "rounds": rounds,
              "reps": reps, "columns": names, "cells": []}
    bandwidth = copy_bandwidth(dev) if dev.type == "cuda" else None
    report["copy_bandwidth"] = bandwidth
    bar = progress(len(cells), desc="fine-grained cells")
    with warnings.catch_warnings():
        # torch warns once when autograd's CUDA thread first creates its cuBLAS handle.
        warnings.filterwarnings("ignore", message=".*no current CUDA context.*")
        for cell in cells:
            report["cells"].append(_measure_cell(cell, names, dev, dtype, rounds, reps,
                                                 bandwidth))
            if dev.type == "cuda":
                gc.collect()  # a cell's tensors go before the next, larger one allocates
                torch.cuda.empty_cache()
                report["cells"][-1]["allocated_after_bytes"] = torch.cuda.memory_allocated(dev)
            bar.update()
    bar.close()
    report["summary"] = _summary(report["cells"], names)
    print(render_fine_tables(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render_fine_tables(report: dict) -> str:
    """The per-cell table (gl's route, ratios, TFLOP/s of gl and torch, failed checks), the summary of
    ratios per ``(K, N)`` and column against the targets, and each column's worst errors
    and largest peak memory."""
    names = report["columns"]
    ratios = [n for n in names if n not in BASELINES.values()]
    rows = []
    for cell in report["cells"]:
        cols = cell["columns"]
        failed = [n for n, c in cols.items()
                  if not c["within_tolerance"] or c["empty_wgrad_zero"] is False]
        rows.append([cell["G"], cell["rows_per_group"], cell["split"], cell["K"], cell["N"],
                     cell["gl_route"], cell.get("fp8_routes", "-"),
                     *(_ratio(cols[n]["ratio"]) for n in ratios),
                     *(f"{cols[n]['tflops']:.3g}" if n in cols else "-" for n in ("gl", "torch")),
                     ", ".join(failed) or "ok"])
    rounds = report["rounds"]
    title = (f"fine-grained grouped linear, {len(report['cells'])} cells, {report['dtype']} on "
             f"{report['device']}, torch {report['torch']}"
             + (" (CPU smoke test: tiny grid, float32, no FP8, no peak memory)"
                if report["smoke_test"] else "")
             + f"; ratio = torch ms / column ms (forward-only against torch_fwd), median of "
             f"{rounds} round{'s' if rounds > 1 else ''}")
    parts = [format_table(["G", "rows/group", "split", "K", "N", "gl route",
                           "FP8 routes (row/block)", *ratios, "gl TFLOP/s", "torch TFLOP/s",
                           "checks"], rows,
                          align="rrlrrll" + "r" * len(ratios) + "rrl", title=title)]
    summary = [[s["features"], s["column"], s["cells"], s["count"], _ratio(s["min"]),
                _ratio(s["median"]), _ratio(s["max"]), s["worst"],
                "-" if s["target"] is None else f">= {s['target'][0]}x min"
                + ("" if s["target"][1] is None else f", >= {s['target'][1]}x median"),
                "-" if s["met"] is None else ("yes" if s["met"] else "NO")]
               for s in report["summary"]]
    parts.append(format_table(["K x N", "column", "cells", "n", "min", "median", "max",
                               "worst cell", "target", "met"], summary,
                              align="lllrrrrlll", title="ratios against torch, per (K, N)"))
    checks = []
    for name in names:
        entries = [c["columns"][name] for c in report["cells"]]
        dw_errs = [e["wgrad_rel_err"] for e in entries if e["wgrad_rel_err"] is not None]
        zero = [e["empty_wgrad_zero"] for e in entries if e["empty_wgrad_zero"] is not None]
        peaks = [e["peak_bytes"] for e in entries if e["peak_bytes"] is not None]
        checks.append([name, f"{max(e['out_rel_err'] for e in entries):.1e}",
                       f"{max(dw_errs):.1e}" if dw_errs else "-", f"{entries[0]['tolerance']:g}",
                       ("yes" if all(zero) else "NO") if zero else "-",
                       f"{max(peaks) / 2**30:.2f}" if peaks else "-"])
    parts.append(format_table(["column", "max out err", "max wgrad err", "tolerance",
                               "empty wgrad 0", "max peak GiB"], checks,
                              title="errors against float64 (worst cell), peak memory the "
                              "call adds"))
    return "\n\n".join(parts)
