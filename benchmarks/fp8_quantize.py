"""FP8 quantization kernels against the copy bandwidth, per launch shape, and the blockwise
recipe's one-read activation quantization against its two passes, and the weight
gradient's transposed operand written by the Gluon and the Triton kernel (CUDA).

From the repository root, ``PYTHONPATH=. python benchmarks/fp8_quantize.py [--part
kernels|blocks|columns] [SHAPE ...]`` (default: all parts):

* ``kernels``: on dsv3_ep32_fc1's operands (x 65536 x 7168, dy 65536 x 4096, W 8 x 4096 x
  7168, bf16), each quantization kernel (median) at each launch shape of a list: GB/s
  counting one read of the input and one write of the FP8 output (the one-pass floor),
  and that as a fraction of a bf16 copy's GB/s. Rows (activations, weights, with weight
  factors folded in), the FP8 weight transpose (the dgrad copy), the transposing
  per-(group, column) quantization (wgrad operands; tile shapes and amax sub-tiles) and
  the block-scaling quantizers. Each launch shape goes in as the kernel's ``config=``;
  the folded rows run at their one setting (``FOLDED_CONFIG``, chosen by an earlier sweep).
* ``blocks`` (SHAPE: the bench's, default all): ``x`` ``(M, K)`` and ``dy`` ``(M, N)`` with
  the shape's splits, quantized to both block layouts (1x128 row tiles and transposed
  128-token blocks) from one read (Gluon, sm90) and by the two Triton passes; µs
  (median), bandwidth counting the bytes each must move (two passes: 2 + 1 bytes per
  element each; one read: 2 + 1 + 1), the speedup, and whether the outputs are identical
  to the reference (the two passes on the operand with its rows past the groups zeroed,
  as the one-read kernel writes their row tiles; the timed passes skip that, as the layer
  does).
* ``columns`` (SHAPE as above): the rowwise weight gradient's operands as the layer makes
  them, groups on 128-column boundaries: ``dy`` quantized per (group, column) with ``x``'s
  row factors folded in (the column-amax pass, then the transposing pass) and ``x``'s FP8
  codes moved into the layout, each with the transposing pass on sm90's Gluon kernel and
  on the Triton one; µs (median), GB/s (the bytes of both passes: dy read twice, the codes
  written once), the speedup and whether the outputs are identical.
"""

import torch
from _common import CUDA, E4M3, bench_shapes, device_groups, median_ms, part_arguments, randn, warm_gpu

from grouped_linear.kernels.quantize import blocks as qb
from grouped_linear.kernels.quantize import blocks_gluon as qbg
from grouped_linear.kernels.quantize import folded as qf
from grouped_linear.kernels.quantize import rows as qr
from grouped_linear.kernels.quantize import transposed as qt
from grouped_linear.kernels.quantize.transpose import transpose_groups

DT = torch.bfloat16


def kernels() -> None:
    """GB/s of each quantization kernel per launch shape, against a bf16 copy."""
    G, M, K, N = 8, 65536, 7168, 4096
    x = randn(M, K, device=CUDA, dtype=DT)
    dy = randn(M, N, device=CUDA, dtype=DT)
    w = randn(G, N, K, device=CUDA, dtype=DT)
    sizes, ends = device_groups([M // G] * G)
    dst = torch.empty_like(x)
    warm_gpu()
    copy_gbps = 2 * x.numel() * 2 / median_ms(lambda: dst.copy_(x)) / 1e6
    print(f"copy: {copy_gbps:.0f} GB/s")

    def report(name, ms, elements, bytes_per_element=3):  # 2 bytes read + 1 written
        gbps = elements * bytes_per_element / ms / 1e6
        print(f"{name:52s} {ms:8.3f} ms {gbps:8.0f} GB/s {gbps / copy_gbps:6.2f} of copy",
              flush=True)

    for c in [(4, 1024, 4), (8, 1024, 8), (2, 2048, 4), (1, 4096, 8)]:
        report(f"rows x {c}", median_ms(lambda c=c: qr.quantize_rows(x, E4M3, False, config=c)),
               x.numel())
    report("weight rows (forward copy)",
           median_ms(lambda: qr.quantize_weight_rows(w, E4M3, False)), w.numel())
    w_data, _ = qr.quantize_weight_rows(w, E4M3, False)
    report("weight FP8 transpose (dgrad copy)", median_ms(lambda: transpose_groups(w_data)),
           w.numel(), bytes_per_element=2)
    report("rows dy", median_ms(lambda: qr.quantize_rows(dy, E4M3, False)), dy.numel())
    folded = qf.ColumnFactors.of_groups(torch.rand(G, N, device=CUDA), ends, M)
    report(f"rows dy, weight factors folded in {qf.FOLDED_CONFIG}",
           median_ms(lambda: qf.quantize_rows_folded(dy, folded, E4M3, False)), dy.numel())
    x_narrow = x[:, :1024].contiguous()
    report("rows x[:, :1024] (several rows per program)",
           median_ms(lambda: qr.quantize_rows(x_narrow, E4M3, False)), x_narrow.numel())

    tiled = [qt.TiledConfig(*c) for c in [(64, 64, 4), (128, 64, 4), (64, 128, 8), (128, 128, 8)]]
    sub_tiles = [qt.TILED_CONFIG._replace(amax_sub_tiles=n) for n in [1, 2, 4, 8]]
    for c in tiled + sub_tiles:
        for name, t in (("x", x), ("dy", dy)):
            report(f"group columns {name} {tuple(c)}", median_ms(
                lambda t=t, c=c: qt.quantize_group_columns_t(t, ends, E4M3, False, align=16,
                                                             config=c)),
                t.numel())

    for c in [(32, 4), (64, 4), (16, 4)]:
        report(f"blockwise row tiles x {c}",
               median_ms(lambda c=c: qb.quantize_row_tiles(x, E4M3, False, config=c)), x.numel())
    for c in [(4,), (8,)]:
        report(f"blockwise weight blocks {c}",
               median_ms(lambda c=c: qb.quantize_weight_blocks(w, E4M3, False, config=c)),
               w.numel())
    for c in [(64, 4), (32, 4), (128, 8)]:
        for name, t in (("x", x), ("dy", dy)):
            report(f"blockwise token blocks {name} transposed {c}", median_ms(
                lambda t=t, c=c: qb.quantize_token_blocks(t, sizes, E4M3, False, transpose=True,
                                                          config=c)),
                t.numel())


def _same(got, want) -> bool:
    return all(torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b)
               for pair, want_pair in zip(got, want) for a, b in zip(pair, want_pair))


def blocks(names: list[str]) -> None:
    """The blockwise recipe's activation quantization: one read against two passes."""
    print(f"{'shape':22s} {'operand':8s} {'two passes us':>14s} {'TB/s':>6s} "
          f"{'one read us':>12s} {'TB/s':>6s} {'speedup':>8s}  identical")
    for shape in bench_shapes(names):
        M = shape.M
        sizes, _ = device_groups(shape.splits)
        warm_gpu()
        for operand, C in (("x", shape.K), ("dy", shape.N)):
            t = randn(M, C, device=CUDA, dtype=DT)
            if not qbg.supported(t, sizes.shape[0]):
                print(f"{shape.name:22s} {operand:8s} (the one-read kernel does not run here)")
                continue

            def two(t=t, sizes=sizes):
                return (qb.quantize_row_tiles(t, E4M3, True, qbg.TILE),
                        qb.quantize_token_blocks(t, sizes, E4M3, True, qbg.TILE, transpose=True))

            def one(t=t, sizes=sizes):
                return qbg.quantize_row_tiles_and_token_blocks(t, sizes, E4M3, True)

            in_groups = t.clone()
            in_groups[int(sizes.clamp(min=0).sum()):] = 0  # rows past the groups
            same = _same(one(), two(in_groups))
            two_ms, one_ms = median_ms(two), median_ms(one)
            print(f"{shape.name:22s} {operand:8s} {two_ms * 1e3:14.0f} "
                  f"{6 * M * C / two_ms / 1e9:6.2f} {one_ms * 1e3:12.0f} "
                  f"{4 * M * C / one_ms / 1e9:6.2f} {two_ms / one_ms:8.2f}  {same}", flush=True)


def columns(names: list[str]) -> None:
    """The wgrad's transposed operands: the Gluon transposing pass against the Triton one."""
    from grouped_linear.kernels.quantize import transposed_gluon as qtg

    gluon_supported = qtg.supported
    print(f"{'shape':22s} {'operand':16s} {'Triton us':>10s} {'GB/s':>6s} {'Gluon us':>9s} "
          f"{'GB/s':>6s} {'speedup':>8s}  identical")
    for shape in bench_shapes(names):
        M = shape.M
        _, ends = device_groups(shape.splits)
        warm_gpu()
        dy = randn(M, shape.N, device=CUDA, dtype=DT)
        x_codes, x_inv = qr.quantize_rows(randn(M, shape.K, device=CUDA, dtype=DT), E4M3, False)
        cases = {  # bytes: the amax pass reads dy, the transposing pass reads it and writes
            "dy (amax, fold)": (lambda dy=dy, ends=ends, x_inv=x_inv: qt.quantize_group_columns_t(
                dy, ends, E4M3, False, align=qtg.TILE, row_factors=x_inv)[:2], 5 * dy.numel()),
            "x codes (move)": (lambda codes=x_codes, ends=ends: (
                qt.transpose_group_columns(codes, ends, qtg.TILE),), 2 * x_codes.numel()),
        }
        for operand, (run, moved) in cases.items():
            if not gluon_supported(dy, torch.empty(16, 16, device=CUDA, dtype=E4M3), qtg.TILE,
                                   len(shape.splits)):
                print(f"{shape.name:22s} {operand:16s} (the Gluon kernel does not run here)")
                continue
            gluon_out = run()
            gluon_ms = median_ms(run)
            qtg.supported = lambda t, data, align, groups: False
            try:
                triton_out = run()
                triton_ms = median_ms(run)
            finally:
                qtg.supported = gluon_supported
            same = _same((gluon_out,), (triton_out,))
            print(f"{shape.name:22s} {operand:16s} {triton_ms * 1e3:10.0f} "
                  f"{moved / triton_ms / 1e6:6.0f} {gluon_ms * 1e3:9.0f} "
                  f"{moved / gluon_ms / 1e6:6.0f} {triton_ms / gluon_ms:8.2f}  {same}",
                  flush=True)


def main() -> None:
    args = part_arguments(__doc__, ("kernels", "blocks", "columns"), "bench shapes for the "
                          "blocks and columns parts")
    torch.manual_seed(0)
    if "kernels" in args.parts:
        kernels()
    if "blocks" in args.parts:
        blocks(args.shapes)
    if "columns" in args.parts:
        columns(args.shapes)


if __name__ == "__main__":
    main()
