"""What ``backend="auto"`` picks: the ``loop`` and ``grouped`` backends per dtype, and the
rows up to which the Triton kernels beat torch's grouped GEMM (CUDA).

From the repository root, ``PYTHONPATH=. python benchmarks/backend_choice.py [--part
dtypes|rows|fine|fp8-small|fine-backward]`` (default: every part):

* ``dtypes``: ``gl.grouped_linear`` (no bias, CUDA splits) with ``backend="loop"`` and
  ``"grouped"`` in bf16, fp16 and fp32 on four cases; forward and forward+backward
  TFLOP/s (medians), and for fp32 the relative error against float64 (does the grouped
  GEMM use TF32?).
* ``rows``: ``GroupedLinear`` with bias, CUDA splits, bf16, with ``backend="grouped"`` and
  ``"triton"`` from 1024 to 65536 rows; forward and forward+backward medians in µs and
  the Triton kernels' TFLOP/s. Where Triton stops winning sets the rows threshold of
  ``auto``.
* ``fine``: the fine-grained bench's balanced cells (64-256 groups of 8-128 rows, four
  K x N), µs of forward and forward+backward (no bias, CUDA splits, bf16) of raw
  ``F.grouped_mm``, this library's ``triton`` and ``grouped`` backends, and
  ``Float8Rowwise`` / ``Float8Blockwise`` layers with a warm weight cache on the
  ``fp8_fused`` route and on the FP8 GEMM routes (the fused route's bounds moved to either
  side): where each wins sets ``triton_auto_max_rows`` and the ``fp8_fused_max_*`` bounds.
* ``fp8-small``: the same FP8 columns (and raw ``F.grouped_mm``) on 8-64 groups of 8-128
  rows at 1024 x 1024, 2048 x 768 and 4096 x 2048, in three alternating rounds: where the
  ``fp8_fused`` route stops paying as groups and weights grow.
* ``fine-backward``: the backward alone (input and weight gradients, bf16, no bias) of the
  fine cells the ``triton`` route takes (at most ``triton_auto_max_rows`` rows; balanced
  and skewed splits): torch's two grouped GEMMs, the Gluon dgrad and weight gradient of the
  ``grouped`` route, the Triton kernels in one launch and as two launches at each weight
  gradient launch shape of :data:`WGRAD_TILES`, and the floor of writing the two gradients
  (``zero_`` of both): which launch shape, and whether one launch or two, the ``triton``
  route's backward takes (``triton_gemm.wgrad_tile``, ``ONE_LAUNCH_MAX_WEIGHTS``).
"""

import contextlib
import statistics

import torch
import torch.nn.functional as F
from _common import CUDA, device_groups, median_ms, part_arguments, randn, tflops, warm_gpu

import grouped_linear as gl
from grouped_linear import _tuning
from grouped_linear.cli.bench_fine import skewed_sizes
from grouped_linear.kernels.gemm import gluon_gemm, gluon_wgrad, triton_gemm

DTYPE_CASES = {  # label: (sizes, K, N); None: 128 skewed groups of 131072 rows
    "8x8192 K2048 N2048": ([8192] * 8, 2048, 2048),
    "16 unaligned K2048 N2048": ([1000 + 37 * i for i in range(16)], 2048, 2048),
    "128 skewed K2048 N1536": (None, 2048, 1536),
    "8x128 K1024 N1024 (small)": ([128] * 8, 1024, 1024),
}
ROWS_CASES = [  # (label, sizes, K, N)
    ("8x128 1024->1024", [128] * 8, 1024, 1024),
    ("8x256 2048->2048", [256] * 8, 2048, 2048),
    ("8x512 2048->2048", [512] * 8, 2048, 2048),
    ("8x1024 4096->2048", [1024] * 8, 4096, 2048),
    ("8x2048 2048->2048", [2048] * 8, 2048, 2048),
    ("8x8192 2048->2048", [8192] * 8, 2048, 2048),
    ("16 unaligned 4096->2048", [1000 + 37 * i for i in range(16)], 4096, 2048),
    ("64x32 decode 2048->1536", [32] * 64, 2048, 1536),
]


def _skewed(num_groups: int, total: int) -> list[int]:
    weights = torch.distributions.Dirichlet(torch.full((num_groups,), 0.5)).sample()
    sizes = (weights * total).floor().long().tolist()
    sizes[0] += total - sum(sizes)
    return sizes


def dtypes() -> None:
    """TFLOP/s of the loop and grouped backends per dtype, fp32's error against float64."""
    rows = []
    for name, (sizes, K, N) in DTYPE_CASES.items():
        sizes = sizes or _skewed(128, 131072)
        M, G = sum(sizes), len(sizes)
        flops = 2 * M * K * N
        splits, _ = device_groups(sizes)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = randn(M, K, device=CUDA, dtype=dtype, requires_grad=True)
            w = randn(G, N, K, device=CUDA, dtype=dtype, scale=K ** -0.5, requires_grad=True)
            grad = randn(M, N, device=CUDA, dtype=dtype)
            line = [name, str(dtype).replace("torch.", "")]
            warm_gpu()
            for backend in ("loop", "grouped"):
                def fwd(x=x, w=w, splits=splits, backend=backend):
                    return gl.grouped_linear(x, w, None, splits, backend=backend)

                t_f = median_ms(fwd)
                t_s = median_ms(lambda fwd=fwd, grad=grad: fwd().backward(grad), [x, w])
                line += [f"{tflops(flops, t_f):.0f}", f"{tflops(3 * flops, t_s):.0f}"]
                if dtype == torch.float32:
                    ref = gl.grouped_linear(x.double(), w.double(), None, sizes, backend="loop")
                    err = (fwd().double() - ref).norm() / ref.norm()
                    line.append(f"err={err:.1e}")
            rows.append(line)
    print("case | dtype | loop fwd | loop fwd+bwd | grouped fwd | grouped fwd+bwd (TFLOP/s)")
    for line in rows:
        print(" | ".join(line))


def _layer_us(layer, x, splits, grad) -> tuple[float, float]:
    """Median µs of the layer's forward and of its forward+backward."""
    leaves = [x, *layer.parameters()]
    fwd = median_ms(lambda: layer(x, splits), leaves)
    step = median_ms(lambda: layer(x, splits).backward(grad), leaves)
    return fwd * 1e3, step * 1e3


def rows() -> None:
    """µs of the grouped and triton backends from small to large row counts."""
    print(f"{'case':26s} {'rows':>6s} | {'grouped fwd':>11s} {'fwd+bwd':>8s} | "
          f"{'triton fwd':>10s} {'fwd+bwd':>8s} | triton TFLOP/s fwd, fwd+bwd")
    for label, sizes, K, N in ROWS_CASES:
        M, G = sum(sizes), len(sizes)
        x = randn(M, K, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        grad = randn(M, N, device=CUDA, dtype=torch.bfloat16)
        splits, _ = device_groups(sizes)
        times = {}
        warm_gpu()
        for backend in ("grouped", "triton"):
            layer = gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device=CUDA,
                                     backend=backend)
            times[backend] = _layer_us(layer, x, splits, grad)
        flops = 2 * M * K * N
        g, t = times["grouped"], times["triton"]
        print(f"{label:26s} {M:6d} | {g[0]:11.1f} {g[1]:8.1f} | {t[0]:10.1f} {t[1]:8.1f} | "
              f"{tflops(flops, t[0] / 1e3):.0f}, {tflops(3 * flops, t[1] / 1e3):.0f}")


FINE_FEATURES = [(2048, 768), (768, 2048), (4096, 2048), (7168, 2048)]


def _step_us(fn, grad, leaves, rep_ms: int = 100) -> tuple[float, float]:
    """Median µs of ``fn()`` and of ``fn().backward(grad)`` (short warm-ups: the caller warms
    the GPU once per cell)."""
    options = {"cuda_warmup_ms": rep_ms, "cuda_rep_ms": rep_ms}
    fwd = median_ms(fn, leaves, **options)
    step = median_ms(lambda: fn().backward(grad), leaves, **options)
    return fwd * 1e3, step * 1e3


FP8_COLUMNS = {"row": gl.recipes.Float8Rowwise, "block": gl.recipes.Float8Blockwise}


def _fused_limits(limit: int) -> dict:
    """Every bound of the ``fp8_fused`` route at ``limit`` (0: never, 2**62: always)."""
    return dict(fp8_fused_max_work=limit, fp8_fused_max_weights=limit,
                fp8_fused_max_block_weights=limit)


def _fine_cell(groups: int, per_group: int, K: int, N: int, bf16: bool = True,
               rounds: int = 1, rep_ms: int = 100) -> dict:
    """µs (forward, forward+backward) of every column on one balanced cell: medians over
    ``rounds`` rounds, the columns alternating within each round. ``bf16``: the triton and
    grouped backends too. FP8 columns: a warm weight cache on the ``fp8_fused`` route and on
    the FP8 GEMM routes (the fused route's bounds moved to either side while each is timed)."""
    sizes = [per_group] * groups
    M = sum(sizes)
    splits, ends = device_groups(sizes)
    x = randn(M, K, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    w = randn(groups, N, K, device=CUDA, dtype=torch.bfloat16, scale=K ** -0.5,
              requires_grad=True)
    grad = randn(M, N, device=CUDA, dtype=torch.bfloat16)
    columns = {"torch": (None, lambda: torch.nn.functional.grouped_mm(
        x, w.transpose(-2, -1), offs=ends), [x, w])}
    for backend in ("triton", "grouped") if bf16 else ():
        columns[backend] = (None, lambda b=backend: gl.grouped_linear(x, w, None, splits,
                                                                      backend=b), [x, w])
    for name, recipe in FP8_COLUMNS.items():
        for route, limit in (("fused", 2**62), ("gemm", 0)):
            with _tuning.override(**_fused_limits(limit)):
                layer = gl.GroupedLinear(groups, K, N, bias=False, params_dtype=torch.bfloat16,
                                         device=CUDA, recipe=recipe())
                layer(x, splits, is_first_microbatch=True)  # fills the weight cache
            columns[f"{name} {route}"] = (
                limit, lambda layer=layer: layer(x, splits, is_first_microbatch=False),
                [x, layer.weight])
    warm_gpu()
    runs: dict = {name: [] for name in columns}
    for _ in range(rounds):
        for name, (limit, fn, leaves) in columns.items():
            with (_tuning.override(**_fused_limits(limit)) if limit is not None
                  else contextlib.nullcontext()):
                runs[name].append(_step_us(fn, grad, leaves, rep_ms))
    return {name: tuple(statistics.median(run[i] for run in times) for i in (0, 1))
            for name, times in runs.items()}


def _print_cells(cells, bf16: bool = True, rounds: int = 1, rep_ms: int = 100) -> None:
    """One line per ``(groups, rows per group, K, N)`` cell: each column's µs and its
    forward+backward against torch's."""
    header = None
    for groups, per_group, K, N in cells:
        times = _fine_cell(groups, per_group, K, N, bf16, rounds, rep_ms)
        if header is None:
            header = list(times)
            print("cell | " + " | ".join(f"{c} fwd, fwd+bwd" for c in header)
                  + f" (µs, median of {rounds} alternating rounds; each column's "
                  "forward+backward against torch's in brackets)")
        base = times["torch"][1]
        line = [f"{times[c][0]:.0f}, {times[c][1]:.0f} ({base / times[c][1]:.2f}x)"
                for c in header]
        print(f"G{groups} r{per_group} {K}x{N} | " + " | ".join(line), flush=True)


def fine() -> None:
    """µs per cell of raw grouped_mm, the bf16 backends and the FP8 routes (module doc)."""
    _print_cells([(groups, per_group, K, N) for K, N in FINE_FEATURES
                  for groups in (64, 128, 256) for per_group in (8, 32, 128)])


def fp8_small() -> None:
    """The FP8 routes on small calls of few to many groups (module doc), alternating rounds."""
    _print_cells([(groups, per_group, K, N) for K, N in ((1024, 1024), (2048, 768),
                                                          (4096, 2048))
                  for groups in (8, 16, 32, 64) for per_group in (8, 32, 128)],
                 bf16=False, rounds=3, rep_ms=40)


WGRAD_TILES = [  # (rows per step, N, K, warps, stages, K tiles per program); programs per
    # SM on sm90 alone (ptxas registers, shared memory) in the comments
    triton_gemm.ONE_LAUNCH_TILE,                           # 72 registers, 48 KB: 4
    triton_gemm.WgradTile(64, 64, 64, 4, 2),               # 72, 32 KB: 7
    triton_gemm.WGRAD_TILE,                                # 101, 32 KB: 4
    triton_gemm.SMALL_GROUPS_TILE,                         # 92, 8 KB: 5 (not pipelined)
    triton_gemm.WgradTile(64, 128, 128, 8, 3),             # 102 at 8 warps, 96 KB: 2
]
FUSED_TILES = (0, 4)  # the one-launch backward runs at the dgrad's 255 registers whatever


def _backward_columns(x, w, dy, sizes, ends) -> dict:
    """Per column, a callable computing (grad_x, grad_w) of one fine cell."""
    dx_buffer, dw_buffer = torch.empty_like(x), torch.empty_like(w)
    columns = {
        "write floor": lambda: (dx_buffer.zero_(), dw_buffer.zero_()),
        "torch": lambda: (F.grouped_mm(dy, w, offs=ends),
                          F.grouped_mm(dy.transpose(0, 1), x, offs=ends)),
    }
    if (gluon_gemm.supported(dy, w, transposed_weight=True)
            and gluon_wgrad.supported(dy, x, w.shape[0])):
        columns["gluon"] = lambda: (gluon_gemm.grouped_mm(dy, w, ends, transposed_weight=True),
                                    gluon_wgrad.wgrad(dy, x, ends, False))

    def triton_with(tile, fused):
        def run():
            if fused:
                return triton_gemm.backward(dy, x, w, sizes, False, one_launch=True, tile=tile)
            return (triton_gemm.dgrad(dy, w, sizes),
                    triton_gemm.wgrad(dy, x, sizes, False, tile=tile))
        return run

    for index, tile in enumerate(WGRAD_TILES):
        if index in FUSED_TILES:
            columns[f"fused t{index}"] = triton_with(tile, True)
        columns[f"split t{index}"] = triton_with(tile, False)
    return columns


def fine_backward() -> None:
    """µs of the backward of the triton route's fine cells, per implementation (module doc)."""
    print("tiles: " + "; ".join(f"t{i} {tuple(tile)}" for i, tile in enumerate(WGRAD_TILES)))
    header = None
    options = {"cuda_warmup_ms": 50, "cuda_rep_ms": 50}
    for K, N in FINE_FEATURES:
        for groups in (64, 128, 256):
            for per_group in (8, 32, 128):
                if groups * per_group > _tuning.current().triton_auto_max_rows:
                    continue
                for kind in ("balanced", "skewed"):
                    sizes_list = ([per_group] * groups if kind == "balanced"
                                  else skewed_sizes(groups, per_group))
                    M = sum(sizes_list)
                    sizes, ends = device_groups(sizes_list)
                    x = randn(M, K, device=CUDA, dtype=torch.bfloat16)
                    w = randn(groups, N, K, device=CUDA, dtype=torch.bfloat16, scale=K ** -0.5)
                    dy = randn(M, N, device=CUDA, dtype=torch.bfloat16)
                    columns = _backward_columns(x, w, dy, sizes, ends)
                    if header is None:
                        header = list(columns)
                        print("cell | " + " | ".join(header)
                              + " (µs; best Triton column and its ratio to torch last)")
                    warm_gpu()
                    times = {name: median_ms(fn, **options) * 1e3 for name, fn in columns.items()}
                    triton_times = {k: v for k, v in times.items() if k.startswith(("fused", "split"))}
                    best = min(triton_times, key=triton_times.get)
                    print(f"G{groups} r{per_group} {kind} {K}x{N} | "
                          + " | ".join(f"{times.get(name, float('nan')):.0f}" for name in header)
                          + f" | {best} {times['torch'] / times[best]:.2f}x", flush=True)
                    del x, w, dy, columns


def main() -> None:
    args = part_arguments(__doc__, ("dtypes", "rows", "fine", "fp8-small", "fine-backward"))
    torch.manual_seed(0)
    if "dtypes" in args.parts:
        dtypes()
    if "rows" in args.parts:
        rows()
    if "fine" in args.parts:
        fine()
    if "fp8-small" in args.parts:
        fp8_small()
    if "fine-backward" in args.parts:
        fine_backward()


if __name__ == "__main__":
    main()
