"""FP8 quantization kernels against the copy bandwidth, per launch shape (CUDA).

``PYTHONPATH=. python benchmarks/fp8_quantize.py``: on dsv3_ep32_fc1's operands
(x 65536 x 7168, dy 65536 x 4096, W 8 x 4096 x 7168, bf16), times each kernel
(do_bench median) and prints GB/s counting one read of the input and one write of
the FP8 output (the one-pass floor) and that as a fraction of a bf16 copy's GB/s.
The transposing quantization (wgrad operands, dgrad weight copy) is timed per method
("per_group", "tiled") and launch shape, and the block-scaling quantizers per launch shape.
"""

import torch
import triton.testing

from grouped_linear.kernels import quantize as q
from grouped_linear.kernels import quantize_blocks as qb
from grouped_linear.kernels import quantize_columns_tiled as qct
from grouped_linear.kernels import quantize_folded as qf
from grouped_linear.kernels import quantize_transposed as qt
from grouped_linear.kernels.transpose import transpose_groups

E4M3 = torch.float8_e4m3fn


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    torch.manual_seed(0)
    G, M, K, N = 8, 65536, 7168, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    offsets = torch.full((G,), M // G, device="cuda").cumsum(0).to(torch.int32)
    dst = torch.empty_like(x)
    copy_gbps = 2 * x.numel() * 2 / _ms(lambda: dst.copy_(x)) / 1e6
    print(f"copy: {copy_gbps:.0f} GB/s")

    def report(name, ms, elements):
        gbps = elements * 3 / ms / 1e6  # 2 bytes read + 1 written per element
        print(f"{name:48s} {ms:8.3f} ms {gbps:8.0f} GB/s {gbps / copy_gbps:6.2f} of copy")

    for rows in ((4, 1024, 4), (8, 1024, 8), (2, 2048, 4), (1, 4096, 8)):
        q.ROWS_CONFIG = rows
        report(f"rows x {rows}", _ms(lambda: q.quantize_rows(x, E4M3, False)), x.numel())
    q.ROWS_CONFIG = (1, 4096, 8)
    report("weight rows (forward copy)", _ms(lambda: q.quantize_weight_rows(w, E4M3, False)),
           w.numel())
    default_method, default_tiled = qt.GROUP_COLUMNS_METHOD, qct.TILED_CONFIG
    w_data, _ = q.quantize_weight_rows(w, E4M3, False)
    ms = _ms(lambda: transpose_groups(w_data))
    print(f"{'weight FP8 transpose (dgrad copy)':48s} {ms:8.3f} ms "
          f"{w.numel() * 2 / ms / 1e6:8.0f} GB/s {w.numel() * 2 / ms / 1e6 / copy_gbps:6.2f} of copy")
    folded = qf.ColumnFactors.of_groups(torch.rand(offsets.shape[0], dy.shape[1], device="cuda"),
                                        offsets, dy.shape[0])
    report("rows dy", _ms(lambda: q.quantize_rows(dy, E4M3, False)), dy.numel())
    for config in ((8, 512), (16, 512), (16, 1024), (32, 1024)):
        qf.FOLDED_CONFIG = config
        report(f"rows dy, weight factors folded in {config}",
               _ms(lambda: qf.quantize_rows_folded(dy, folded, E4M3, False)), dy.numel())
    qf.FOLDED_CONFIG = (16, 1024)
    qt.GROUP_COLUMNS_METHOD = "per_group"
    for config in ((32, 64, 4), (64, 64, 4), (64, 128, 8)):
        qt.GROUP_COLUMNS_CONFIG = config
        for name, t in (("x", x), ("dy", dy)):
            report(f"group columns {name} per_group {config}",
                   _ms(lambda t=t: qt.quantize_group_columns_t(t, offsets, E4M3, False, align=16)),
                   t.numel())
    qt.GROUP_COLUMNS_METHOD = "tiled"
    for config in ((64, 64, 4), (128, 64, 4), (64, 128, 8), (128, 128, 8)):
        qct.TILED_CONFIG = config
        for name, t in (("x", x), ("dy", dy)):
            report(f"group columns {name} tiled {config}",
                   _ms(lambda t=t: qt.quantize_group_columns_t(t, offsets, E4M3, False, align=16)),
                   t.numel())
    qt.GROUP_COLUMNS_METHOD, qct.TILED_CONFIG = default_method, default_tiled
    for sub_tiles in (1, 2, 4, 8):
        qct.AMAX_SUB_TILES = sub_tiles
        for name, t in (("x", x), ("dy", dy)):
            report(f"group columns {name} tiled, amax sub-tiles {sub_tiles}",
                   _ms(lambda t=t: qt.quantize_group_columns_t(t, offsets, E4M3, False, align=16)),
                   t.numel())
    qct.AMAX_SUB_TILES = 2
    x_narrow = x[:, :1024].contiguous()
    report("rows x[:, :1024] (several rows per program)",
           _ms(lambda: q.quantize_rows(x_narrow, E4M3, False)), x_narrow.numel())
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    for config in ((32, 4), (64, 4), (16, 4)):
        qb.ROW_TILES_CONFIG = config
        report(f"blockwise row tiles x {config}",
               _ms(lambda: qb.quantize_row_tiles(x, E4M3, False)), x.numel())
    for config in ((4,), (8,)):
        qb.WEIGHT_BLOCKS_CONFIG = config
        report(f"blockwise weight blocks {config}",
               _ms(lambda: qb.quantize_weight_blocks(w, E4M3, False)), w.numel())
    for config in ((64, 4), (32, 4), (128, 8)):
        qb.TOKEN_BLOCKS_CONFIG = config
        for name, t in (("x", x), ("dy", dy)):
            report(f"blockwise token blocks {name} transposed {config}",
                   _ms(lambda t=t: qb.quantize_token_blocks(t, sizes, E4M3, False,
                                                            transpose=True)), t.numel())

if __name__ == "__main__":
    main()
