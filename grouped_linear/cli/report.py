"""The output of ``python -m grouped_linear bench``: text tables and a bar chart of a report.

A report is the dict :func:`grouped_linear.cli.bench.run_bench` returns: the device, the
dtype, the columns measured and, per shape, each column's times and TFLOP/s, the ratios
of :data:`RATIOS` and (with and without bias measured) the bias overhead.
"""

from __future__ import annotations

import math

from .timing import format_table

__all__ = ["RATIOS", "SMALL_SHAPE_NAME", "ratio", "render_table", "write_plot"]

# (label, column, baseline): the ratios of TFLOP/s the report computes per shape.
RATIOS = (("gl/torch", "grouped_linear", "torch"), ("gl/loop", "grouped_linear", "loop"),
          ("nobias/torch", "gl_nobias", "torch"), ("row/torch", "fp8_row", "torch"),
          ("tensor/torch", "fp8_tensor", "torch"), ("block/torch", "fp8_block", "torch"),
          ("row/torchao", "fp8_row", "torchao"), ("rowc/torch", "fp8_row_cached", "torch"))
SMALL_SHAPE_NAME = "small_8x128"
# Column names as the tables print them.
_SHORT = {"grouped_linear": "gl", "gl_nobias": "nobias", "fp8_row": "row",
          "fp8_row_cached": "rowc", "fp8_tensor": "tensor", "fp8_block": "block"}


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """``a[key] / b[key]``, or ``None`` when either is missing or ``b[key]`` is 0."""
    if not a or not b or not b.get(key):
        return None
    return a[key] / b[key]


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if digits == 1 and abs(value) < 1:
        return f"{value:.3f}"
    return f"{value:.{digits}f}"


def _pair(a: float | None, b: float | None, digits: int = 1) -> str:
    return f"{_num(a, digits)} / {_num(b, digits)}"


def render_table(report: dict) -> str:
    """The text tables of a :func:`~grouped_linear.cli.bench.run_bench` report: TFLOP/s and
    ratios, then (CUDA) peak memory, bias overhead against its one-pass bound, and
    latencies in µs."""
    columns = report["columns"]
    on_cuda = report["device"].startswith("cuda")
    ratios = [(label, base) for label, name, base in RATIOS if name in columns and base in columns]
    headers = ["shape", "G", "M", "K", "N", *(_SHORT.get(c, c) for c in columns),
               *(name for name, _ in ratios)]
    rows = []
    for entry in report["results"]:
        cols = entry["columns"]
        row = [entry["shape"], entry["G"], entry["M"], entry["K"], entry["N"]]
        row += [_pair(cols[c]["fwd_tflops"], cols[c]["fwd_bwd_tflops"]) for c in columns]
        for name, _ in ratios:
            r = entry["ratios"][name]
            row.append(_pair(r["fwd_tflops"], r["fwd_bwd_tflops"], digits=2))
        rows.append(row)
    title = (f"grouped_linear bench on {report['device']} ({report['device_name']}), "
             f"{report['dtype']}, torch {report['torch_version']}: TFLOP/s forward / "
             "forward+backward (median"
             + (f" of {report['rounds']} alternating rounds" if report.get("rounds", 1) > 1 else "")
             + "); gl = GroupedLinear with bias, nobias = without")
    parts = [format_table(headers, rows, title=title)]
    if on_cuda and all("bias_overhead" in e for e in report["results"]):
        mem_headers = ["shape", *(f"peak GiB {_SHORT.get(c, c)}" for c in columns),
                       "gl/torch mem", "bias ms fwd (bound)", "bias ms fwd+bwd (bound)"]
        mem_rows = []
        for entry in report["results"]:
            cols, bias = entry["columns"], entry["bias_overhead"]
            peaks = [(cols[c]["peak_mem_bytes"] or 0) / 2**30 for c in columns]
            mem_ratio = ratio(cols.get("grouped_linear"), cols.get("torch"), "peak_mem_bytes")
            mem_rows.append([
                entry["shape"], *(_num(p, 2) for p in peaks), _num(mem_ratio, 3),
                f"{bias['fwd_ms']:.3f} ({bias['bound_fwd_ms']:.3f})",
                f"{bias['fwd_bwd_ms']:.3f} ({bias['bound_fwd_bwd_ms']:.3f})",
            ])
        parts.append(format_table(mem_headers, mem_rows,
                                  title="peak memory of forward+backward; bias cost vs one pass"))
        small = [e for e in report["results"] if e["shape"] == SMALL_SHAPE_NAME]
        if small:
            cols = small[0]["columns"]
            lat_rows = [[_SHORT.get(c, c), f"{cols[c]['fwd_ms'] * 1e3:.1f}",
                         f"{cols[c]['fwd_bwd_ms'] * 1e3:.1f}"] for c in columns]
            parts.append(format_table(["column", "fwd µs", "fwd+bwd µs"], lat_rows,
                                      title=f"{SMALL_SHAPE_NAME}: 8 groups x 128 rows, 1024 -> 1024"))
    notes = []
    if report["scaled"]:
        sc = report["scale"]
        notes.append(f"shapes scaled down for CPU: group sizes // {sc['split_divisor']} "
                     f"(zeros kept, others >= 1), K and N // {sc['feature_divisor']}")
    if "torch" not in columns:
        notes.append("torch (F.grouped_mm) is measured on CUDA only")
    if "torchao" in columns:
        notes.append("torchao (FP8 rowwise) runs each shape's splits rounded up to multiples of "
                     "16; its TFLOP/s count that rounded work")
    notes.append("the baselines have no bias; bias bound = one read+write of the output forward "
                 "and one read of its gradient backward at 4.25 TB/s")
    return "\n".join(parts) + "\n" + "\n".join("note: " + n for n in notes)


def write_plot(report: dict, path: str) -> None:
    """A PNG bar chart: TFLOP/s per shape and column, forward and forward+backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = report["columns"]
    names = [e["shape"] for e in report["results"]]
    width = 0.8 / len(columns)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.4 * len(names) + 2), 7), sharex=True)
    for ax, key, label in zip(axes, ("fwd_tflops", "fwd_bwd_tflops"),
                              ("forward", "forward+backward")):
        for i, column in enumerate(columns):
            values = [e["columns"][column][key] for e in report["results"]]
            xs = [j + (i - (len(columns) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, values, width, label=column)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(columns), fontsize="small")
    axes[-1].set_xticks(range(len(names)))
    axes[-1].set_xticklabels(names, rotation=30, ha="right", fontsize="small")
    scaled = " (shapes scaled down)" if report["scaled"] else ""
    fig.suptitle(f"grouped_linear bench, {report['device']} {report['dtype']}{scaled}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
