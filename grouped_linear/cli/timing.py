"""Timing, GPU warm-up, random-input, progress-bar and table helpers shared by the command
line tools (and the scripts in benchmarks/).

Nothing here is imported by the library itself; tqdm and Triton are optional
and imported only when used.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

import torch

__all__ = [
    "Progress",
    "progress",
    "median_seconds",
    "warm_gpu",
    "peak_memory_bytes",
    "randn",
    "format_table",
    "run_cases",
]


# --------------------------------------------------------------------------- progress bars
class Progress:
    """A minimal text progress bar, used when tqdm is not installed.

    Implements the small part of tqdm's interface the CLI uses:
    ``update``, ``set_postfix_str``, ``set_description``, ``write`` and ``close``.
    """

    def __init__(self, total: int, desc: str = "", width: int = 28,
                 stream: TextIO | None = None, disable: bool = False) -> None:
        self.total = max(int(total), 1)
        self.n = 0
        self.desc = desc
        self.width = width
        self.postfix = ""
        self.stream = stream if stream is not None else sys.stderr
        self.disable = disable
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._draw(force=True)

    def _draw(self, force: bool = False) -> None:
        if self.disable:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = int(self.width * self.n / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._start
        text = f"\r{self.desc}: [{bar}] {self.n}/{self.total} {elapsed:5.1f}s"
        if self.postfix:
            text += f"  {self.postfix}"
        self.stream.write(text)
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n`` steps."""
        self.n = min(self.n + n, self.total)
        self._draw(force=self.n == self.total)

    def set_postfix_str(self, text: str) -> None:
        """Show ``text`` after the bar (e.g. the running loss)."""
        self.postfix = text
        self._draw()

    def set_description(self, desc: str) -> None:
        """Replace the label in front of the bar."""
        self.desc = desc
        self._draw()

    def write(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if not self.disable:
            self.stream.write("\r" + text + "\n")
            self._draw(force=True)

    def close(self) -> None:
        """Finish the bar's line."""
        if not self.disable:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()


def progress(total: int, desc: str, disable: bool = False):
    """A tqdm progress bar when tqdm is importable, else a :class:`Progress`."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return Progress(total, desc, disable=disable)
    return tqdm(total=total, desc=desc, disable=disable, leave=True, dynamic_ncols=True)


# --------------------------------------------------------------------------- timing
def _clear_grads(tensors: Sequence[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.grad = None


def median_seconds(
    fn: Callable[[], object],
    device: torch.device,
    *,
    grad_to_none: Sequence[torch.Tensor] = (),
    reps: int = 5,
    warmup: int = 1,
    cuda_warmup_ms: int = 500,
    cuda_rep_ms: int = 100,
) -> float:
    """Median wall time of one call of ``fn``, in seconds.

    On CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between
    calls) with ``cuda_warmup_ms``/``cuda_rep_ms``. The warm-up is long on
    purpose: a GPU at its power limit lowers its clocks within a few hundred
    milliseconds of sustained load, so a short warm-up would time the first case
    after an idle gap at boost clocks and later ones throttled (the steady state a
    training run sees). On CPU: ``warmup`` untimed
    calls, then the median of ``reps`` calls timed with ``time.perf_counter``.
    ``grad_to_none`` are reset before every call so that backward passes do not
    accumulate into existing gradients.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=cuda_warmup_ms, rep=cuda_rep_ms,
                      grad_to_none=list(grad_to_none) or None, return_mode="median")
        return float(ms) / 1e3
    for _ in range(warmup):
        _clear_grads(grad_to_none)
        fn()
    times = []
    for _ in range(reps):
        _clear_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, numel: int = 2**29, dtype: torch.dtype = torch.bfloat16,
                   reps: int = 5) -> float:
    """Bytes per second read plus written by ``dst.copy_(src)`` over ``numel`` random elements
    of ``dtype`` (1 GiB by default; the byte floors and "of copy" fractions of the benches
    divide by it); NaN where the copy took no measurable time."""
    src = randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, reps=reps)
    return 2 * src.numel() * src.element_size() / seconds if seconds > 0 else float("nan")


def warm_gpu(ms: float = 300.0, device: torch.device | str | None = None) -> None:
    """Keep the GPU busy with bf16 matmuls for about ``ms`` milliseconds; nothing off CUDA.

    Call it before a round of measurements that follows an idle moment (a model built, a
    table printed): an idle GPU starts at boost clocks and reaches its power limit, and the
    lower sustained clocks a training run sees, within a few hundred milliseconds of load.
    """
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(8):  # about 0.2 ms each on an H200
            torch.matmul(a, a, out=out)
        torch.cuda.synchronize(dev)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device,
                      grad_to_none: Sequence[torch.Tensor] = ()) -> int | None:
    """Peak CUDA memory allocated while ``fn`` runs once (inputs included); ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    _clear_grads(grad_to_none)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    _clear_grads(grad_to_none)
    return int(peak)


# --------------------------------------------------------------------------- inputs
def randn(*size: int, device: torch.device | str, dtype: torch.dtype, scale: float = 1.0,
          requires_grad: bool = False) -> torch.Tensor:
    """Normal random values times ``scale``, drawn in float32 and cast to ``dtype`` (the same
    values whatever the dtype, for one seed), a leaf with ``requires_grad`` as asked."""
    t = torch.randn(*size, device=device, dtype=torch.float32).mul_(scale).to(dtype)
    return t.requires_grad_(requires_grad)


# --------------------------------------------------------------------------- tables
def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 align: str | None = None, title: str | None = None) -> str:
    """Render rows as an aligned plain-text table.

    Args:
        headers: column names.
        rows: one sequence of cells per row; cells are turned into ``str``.
        align: one character per column, ``"l"`` or ``"r"`` (default: first
            column left, the rest right).
        title: optional line printed above the table.
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    ncols = len(headers)
    if any(len(row) != ncols for row in cells):
        raise ValueError(f"every row must have {ncols} cells")
    align = align or "l" + "r" * (ncols - 1)
    widths = [max(len(row[i]) for row in cells) for i in range(ncols)]

    def line(row: Sequence[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(cells[0]), rule] + [line(row) for row in cells[1:]]
    if title:
        out.insert(0, title)
    return "\n".join(out)


def run_cases(cases: Sequence, measure: Callable[[object], dict],
              render: Callable[[dict], str], dev: torch.device, dtype: torch.dtype,
              desc: str, json_path: str | None) -> dict:
    """A bench suite's loop: ``measure(case)`` for each case under a progress bar, the report
    (device, dtype, torch version, ``cases``) printed by ``render`` and written as JSON to
    ``json_path`` when given. Returns the report."""
    import json

    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "cases": []}
    bar = progress(len(cases), desc=desc)
    for case in cases:
        report["cases"].append(measure(case))
        bar.update()
    bar.close()
    print(render(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return report
