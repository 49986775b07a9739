"""FP8 grouped GEMMs alone, on already-quantized operands, against bf16 ``F.grouped_mm``:
torch's ``_scaled_grouped_mm`` (rowwise) and the blockwise Triton and Gluon kernels (CUDA,
the Gluon kernels on sm90).

From the repository root, ``PYTHONPATH=. python benchmarks/fp8_gemms.py [--part
gemms|wgrad-configs] [SHAPE ...]`` (SHAPE: the bench's, or ``uniform:G:M:K:N``; default
all). Per shape, TFLOP/s (median, ``2 M K N`` per GEMM); ``wgrad-configs``: the group-scaled
weight gradient at each launch shape of ``WGRAD_CONFIGS``; ``gemms``:

* forward: bf16 ``grouped_mm``, torch's FP8 GEMM and the Gluon rowwise kernel on rowwise
  operands (also the rowwise dgrad on both), the blockwise Triton and Gluon kernels;
* dgrad (``dy @ W``, as the blockwise recipe runs it: the transposed weight copy) and wgrad
  (token-block operands): the blockwise Triton and Gluon kernels;
* the rowwise recipes' wgrad: torch's FP8 GEMM (16-token group alignment) against the
  group-scaled Triton and Gluon kernels (128-token group blocks), on the same values;
* torch's rowwise forward without fast accumulation (the forward and dgrad use it), and the
  relative error of each against the dequantized operands' float64 product (times 1e4), on
  random and on all-positive operands;

with, for each Gluon kernel, whether its bf16 output is identical to the Triton kernel's.
(The Triton kernels' launch shapes are settled; ``fp8_triton_gemm`` records the figures.)
"""

import torch
import torch.nn.functional as F
from _common import (
    CUDA,
    E4M3,
    bench_shapes,
    device_groups,
    median_ms,
    part_arguments,
    randn,
    tflops,
    warm_gpu,
)

from grouped_linear.kernels.gemm import fp8_gluon_gemm as gg
from grouped_linear.kernels.gemm import fp8_gluon_wgrad as gw
from grouped_linear.kernels.gemm import fp8_torch_gemm
from grouped_linear.kernels.gemm import fp8_triton_gemm as fg
from grouped_linear.kernels.quantize import blocks as qb
from grouped_linear.kernels.quantize import folded as qf
from grouped_linear.kernels.quantize import rows as qr
from grouped_linear.kernels.quantize import transposed as qt
from grouped_linear.kernels.quantize.transpose import transpose_groups

DT = torch.bfloat16


def _pair(row: dict, gemm: str, flops: int, triton_fn, gluon_fn, gluon_ok: bool) -> None:
    """The Triton kernel's TFLOP/s and, where it runs, the Gluon kernel's and whether their
    outputs are identical."""
    row[f"triton blockwise {gemm}"] = tflops(flops, median_ms(triton_fn))
    if gluon_ok:
        same = torch.equal(triton_fn(), gluon_fn())
        row[f"gluon blockwise {gemm} (identical: {same})"] = tflops(flops, median_ms(gluon_fn))


def _fast_accumulation(x, x_inv, w, w_inv, ends, flops) -> dict:
    """torch's rowwise FP8 GEMM without fast accumulation (the forward and dgrad run with
    it), and both errors against the dequantized operands' product, on these operands and on
    all-positive ones (no cancellation: the worst case for a truncated accumulator)."""
    def exact(a=x, a_inv=x_inv, b=w, b_inv=w_inv):
        return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_inv, b_inv, offs=ends,
                                        out_dtype=DT, use_fast_accum=False)

    row = {"torch scaled rowwise fwd exact accumulation": tflops(flops, median_ms(exact))}
    for name, a, b in (("random", x, w), ("positive", x.view(torch.uint8).bitwise_and(0x7F)
                                          .view(x.dtype), w.view(torch.uint8)
                                          .bitwise_and(0x7F).view(w.dtype))):
        want = fp8_torch_gemm.dequantized_reference(a, x_inv, b, w_inv, ends).double()
        for mode, fn in (("fast", fp8_torch_gemm.forward), ("exact", None)):
            got = (fn(a, x_inv, b, w_inv, ends, DT) if fn else exact(a, x_inv, b, w_inv))
            error = ((got.double() - want).norm() / want.norm()).item()
            row[f"rel. error x 1e4, {mode} accumulation, {name} operands"] = error * 1e4
    return row


def _rowwise_pairs(x, x_inv, w, w_inv, dy, ends, flops) -> dict:
    """The rowwise recipes' forward and dgrad (``dy`` times the weight's channel factors
    against the transposed weight copy) on torch's FP8 GEMM and on the Gluon kernel, with
    the relative difference of their outputs (times 1e4)."""
    G, K = w.shape[0], w.shape[2]
    dy_data, dy_inv = qf.quantize_rows_folded(
        dy, qf.ColumnFactors.of_groups(w_inv, ends, dy.shape[0]), E4M3, False)
    wt, wt_inv = transpose_groups(w), torch.ones(G, K, device=CUDA)
    row = {}
    for gemm, a, a_inv, b, b_inv in (("fwd", x, x_inv, w, w_inv),
                                      ("dgrad", dy_data, dy_inv, wt, wt_inv)):
        def theirs(a=a, a_inv=a_inv, b=b, b_inv=b_inv):
            return fp8_torch_gemm.forward(a, a_inv, b, b_inv, ends, DT)

        row[f"torch scaled rowwise {gemm}"] = tflops(flops, median_ms(theirs))
        if gg.rowwise_supported(a, b):
            def ours(a=a, a_inv=a_inv, b=b, b_inv=b_inv):
                return gg.rowwise_mm(a, a_inv, b, b_inv, ends, DT)

            rows = int(ends[-1])
            diff = ((ours()[:rows].double() - theirs()[:rows].double()).norm()
                    / theirs()[:rows].double().norm()).item()
            row[f"gluon rowwise {gemm} (diff to torch x 1e4: {diff * 1e4:.1f})"] = tflops(
                flops, median_ms(ours))
    return row


def shape_row(shape) -> dict:
    """TFLOP/s of every GEMM form on one shape."""
    G, M, K, N = shape.G, shape.M, shape.K, shape.N
    flops = 2 * M * K * N
    x = randn(M, K, device=CUDA, dtype=DT)
    dy = randn(M, N, device=CUDA, dtype=DT)
    w = randn(G, N, K, device=CUDA, dtype=DT, scale=K ** -0.5)
    sizes, ends = device_groups(shape.splits)
    row = {"bf16 grouped_mm fwd": tflops(flops, median_ms(
        lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=ends)))}
    if fp8_torch_gemm.shapes_supported(K, N):
        x_row, x_row_inv = qr.quantize_rows(x, E4M3, False)
        w_row, w_row_inv = qr.quantize_weight_rows(w, E4M3, False)
        row.update(_rowwise_pairs(x_row, x_row_inv, w_row, w_row_inv, dy, ends, flops))
        row.update(_fast_accumulation(x_row, x_row_inv, w_row, w_row_inv, ends, flops))

    # Blockwise forward and dgrad: 1x128 activation tiles, 128x128 weight blocks.
    x_blk, dy_blk = qb.quantize_row_tiles(x, E4M3, True), qb.quantize_row_tiles(dy, E4M3, True)
    w_fwd = qb.quantize_weight_blocks(w, E4M3, True)
    w_dgrad = qb.quantize_weight_blocks(w.transpose(-2, -1).contiguous(), E4M3, True)
    for gemm, a, b in (("fwd", x_blk, w_fwd), ("dgrad", dy_blk, w_dgrad)):
        def triton_fn(a=a, b=b):
            return fg.grouped_mm(*a, *b, sizes, transpose_weight=True)

        _pair(row, gemm, flops, triton_fn, lambda a=a, b=b: gg.grouped_mm(*a, *b, sizes),
              gg.supported(a[0], b[0]))

    # Blockwise wgrad: token-block operands, transposed.
    dy_t = qb.quantize_token_blocks(dy, sizes, E4M3, True, transpose=True)
    x_t = qb.quantize_token_blocks(x, sizes, E4M3, True, transpose=True)

    def wgrad_fn():
        return fg.blockwise_wgrad(*dy_t, *x_t, sizes, M)

    _pair(row, "wgrad", flops, wgrad_fn, lambda: gw.blockwise_wgrad(*dy_t, *x_t, sizes, M),
          gw.wgrad_supported(*dy_t, *x_t, sizes.shape[0]))

    # The rowwise recipes' wgrad: per (group, column) factors, on this library's GEMM and on
    # torch's 2-D x 2-D FP8 grouped GEMM (exact accumulation; groups on 16-token boundaries).
    for align in (16, fg.BLOCK):
        dy_c, dy_c_inv, aligned = qt.quantize_group_columns_t(dy, ends, E4M3, False, align=align)
        x_c, x_c_inv, _ = qt.quantize_group_columns_t(x, ends, E4M3, False, align=align)
        if align == fg.BLOCK:
            def group_scaled(dy_c=dy_c, dy_c_inv=dy_c_inv, x_c=x_c, x_c_inv=x_c_inv):
                return fg.blockwise_wgrad(dy_c, dy_c_inv, x_c, x_c_inv, sizes, M,
                                          group_scales=True)

            row["triton group-scaled wgrad"] = tflops(flops, median_ms(group_scaled))
            if gw.wgrad_supported(dy_c, dy_c_inv, x_c, x_c_inv, sizes.shape[0]):
                def gluon_scaled(dy_c=dy_c, dy_c_inv=dy_c_inv, x_c=x_c, x_c_inv=x_c_inv):
                    return gw.blockwise_wgrad(dy_c, dy_c_inv, x_c, x_c_inv, sizes, M,
                                              group_scales=True)

                diff = ((gluon_scaled().double() - group_scaled().double()).norm()
                        / group_scaled().double().norm()).item()
                row[f"gluon group-scaled wgrad (diff to triton x 1e4: {diff * 1e4:.2f})"] = \
                    tflops(flops, median_ms(gluon_scaled))
        else:
            row["torch scaled rowwise wgrad"] = tflops(flops, median_ms(
                lambda dy_c=dy_c, dy_c_inv=dy_c_inv, x_c=x_c, x_c_inv=x_c_inv, aligned=aligned:
                torch._scaled_grouped_mm(dy_c, x_c.t(), dy_c_inv.reshape(-1),
                                         x_c_inv.reshape(-1), offs=aligned, out_dtype=DT,
                                         use_fast_accum=False)))
    return row


# Launch shapes of the group-scaled weight gradient (warps, stages, tokens per step, N tile,
# K tile) timed by ``--part wgrad-configs``: the kernel's own first (ptxas serializes its
# MMAs), one stage more, and the 128 x 128 tiles it does not serialize (without spills).
WGRAD_CONFIGS = [fg.GROUP_SCALED_WGRAD_CONFIG, (8, 4, 128, 256, 128), (8, 3, 128, 128, 128),
                 (8, 4, 128, 128, 128)]


def wgrad_configs_row(shape) -> dict:
    """TFLOP/s of the group-scaled weight gradient at each of ``WGRAD_CONFIGS``."""
    M, flops = shape.M, 2 * shape.M * shape.K * shape.N
    x = randn(M, shape.K, device=CUDA, dtype=DT)
    dy = randn(M, shape.N, device=CUDA, dtype=DT)
    sizes, ends = device_groups(shape.splits)
    dy_c, dy_inv, _ = qt.quantize_group_columns_t(dy, ends, E4M3, False, align=fg.BLOCK)
    x_c, x_inv, _ = qt.quantize_group_columns_t(x, ends, E4M3, False, align=fg.BLOCK)
    row, default = {}, fg.GROUP_SCALED_WGRAD_CONFIG
    try:
        for config in WGRAD_CONFIGS:
            fg.GROUP_SCALED_WGRAD_CONFIG = config
            row[f"group-scaled wgrad {config}"] = tflops(flops, median_ms(
                lambda: fg.blockwise_wgrad(dy_c, dy_inv, x_c, x_inv, sizes, M,
                                           group_scales=True)))
    finally:
        fg.GROUP_SCALED_WGRAD_CONFIG = default
    return row


def main() -> None:
    args = part_arguments(__doc__, ("gemms", "wgrad-configs"),
                          "bench shapes or uniform:G:M:K:N (default: all)")
    torch.manual_seed(0)
    for shape in bench_shapes(args.shapes):
        for part in args.parts:
            warm_gpu()
            row = shape_row(shape) if part == "gemms" else wgrad_configs_row(shape)
            print(f"{shape.name} (G={shape.G}, M={shape.M}, K={shape.K}, N={shape.N}) TFLOP/s:")
            for key, value in row.items():
                print(f"  {key:64s} {value:9.1f}" if value else f"  {key:64s}         -",
                      flush=True)


if __name__ == "__main__":
    main()
