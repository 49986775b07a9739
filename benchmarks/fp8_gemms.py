"""FP8 grouped GEMMs alone, per launch shape, against bf16 ``F.grouped_mm`` (CUDA).

``PYTHONPATH=. python benchmarks/fp8_gemm.py [shape ...]``: on the bench shapes (or
``uniform:G:M:K:N``), the
forward GEMM of bf16 ``F.grouped_mm``, of ``torch._scaled_grouped_mm`` (rowwise), of the
Triton FP8 kernel (rowwise and blockwise, per ``MM_CONFIG``), the blockwise dgrad and
wgrad (per ``WGRAD_CONFIG``), and the rowwise wgrad in torch's GEMM and in the group-scaled
Triton kernel, on already-quantized operands. do_bench medians, TFLOP/s
counting ``2 M K N`` per GEMM.
"""

import sys

import torch
import torch.nn.functional as F
import triton.testing

import grouped_linear as gl
from grouped_linear.cli.bench import Shape, load_shapes
from grouped_linear.kernels import fp8_gemm
from grouped_linear.kernels import fp8_triton_gemm as fg
from grouped_linear.kernels import quantize as q
from grouped_linear.kernels import quantize_blocks as qb
from grouped_linear.kernels import quantize_transposed as qt
from grouped_linear.ops.fp8 import quantize_weight

E4M3 = torch.float8_e4m3fn
MM_CONFIGS = [(128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 4, 4), (256, 8, 3)]
# (warps, stages, tokens per step, N tile, K tile) of the blockwise and group-scaled wgrads
WGRAD_CONFIGS = [(8, 3, 64, 128, 128), (4, 3, 64, 128, 128), (8, 3, 128, 128, 128),
                 (8, 3, 128, 128, 256), (8, 3, 64, 128, 256), (8, 3, 128, 256, 128)]
GROUP_SCALED_CONFIGS = [(4, 3, 64, 128, 128), (8, 3, 64, 128, 128), (4, 3, 128, 128, 128),
                        (4, 4, 128, 128, 128), (8, 3, 128, 128, 256), (8, 4, 64, 128, 256),
                        (8, 3, 128, 256, 128)]


def _tflops(fn, flops):
    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    return flops / ms / 1e9


def _sweep(name, attr, configs, fn, flops, row):
    best = None
    for config in configs:
        setattr(fg, attr, config)
        try:
            value = _tflops(fn, flops)
        except Exception as error:  # a launch shape that does not fit (shared memory)
            print(f"  {name} {config}: {type(error).__name__}")
            continue
        row[f"{name} {config}"] = value
        best = max(best or 0.0, value)
    row[f"{name} best"] = best


def _shape_row(shape) -> dict:
    """TFLOP/s of every GEMM form on one shape."""
    block_recipe = gl.recipes.Float8Blockwise()
    sizes_list = list(shape.splits)
    G, M, K, N = len(sizes_list), sum(sizes_list), shape.K, shape.N
    flops = 2 * M * K * N
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    sizes = torch.tensor(sizes_list, device="cuda", dtype=torch.int32)
    offsets = sizes.cumsum(0).to(torch.int32)
    row = {"bf16 grouped_mm": _tflops(lambda: F.grouped_mm(x, w.transpose(-2, -1),
                                                           offs=offsets), flops)}
    x_row, x_row_inv = q.quantize_rows(x, E4M3, False)
    w_row, w_row_inv = q.quantize_weight_rows(w, E4M3, False)
    if fp8_gemm.shapes_supported(K, N):
        row["torch scaled rowwise"] = _tflops(
            lambda: fp8_gemm.forward(x_row, x_row_inv, w_row, w_row_inv, offsets,
                                     torch.bfloat16), flops)
    _sweep("triton rowwise fwd", "MM_CONFIG", MM_CONFIGS,
           lambda: fg.grouped_mm(x_row, x_row_inv, w_row, w_row_inv, sizes,
                                 transpose_weight=True, scaling="rowwise"), flops, row)
    x_blk, x_blk_inv = qb.quantize_row_tiles(x, E4M3, False)
    dy_blk, dy_blk_inv = qb.quantize_row_tiles(dy, E4M3, False)
    w_blk = quantize_weight(w, block_recipe, "triton")
    default_block_k = fg.MM_BLOCK_K
    for block_k in (64, 128):  # one or two dots per 128-deep scale block
        fg.MM_BLOCK_K = block_k
        _sweep(f"triton blockwise fwd k{block_k}", "MM_CONFIG", MM_CONFIGS,
               lambda: fg.grouped_mm(x_blk, x_blk_inv, w_blk.forward_data, w_blk.forward_inv,
                                     sizes, transpose_weight=True, scaling="blockwise"),
               flops, row)
        _sweep(f"triton blockwise dgrad k{block_k}", "MM_CONFIG", MM_CONFIGS[:3],
               lambda: fg.grouped_mm(dy_blk, dy_blk_inv, w_blk.dgrad_data, w_blk.dgrad_inv,
                                     sizes, transpose_weight=True, scaling="blockwise"),
               flops, row)
    fg.MM_BLOCK_K = default_block_k
    fg.MM_CONFIG = MM_CONFIGS[0]
    default_group_scaled = fg.GROUP_SCALED_WGRAD_CONFIG
    dy_t, dy_t_inv = qb.quantize_token_blocks(dy, sizes, E4M3, False, transpose=True)
    x_t, x_t_inv = qb.quantize_token_blocks(x, sizes, E4M3, False, transpose=True)
    _sweep("triton blockwise wgrad", "WGRAD_CONFIG", WGRAD_CONFIGS,
           lambda: fg.blockwise_wgrad(dy_t, dy_t_inv, x_t, x_t_inv, sizes, M), flops, row)
    fg.WGRAD_CONFIG = WGRAD_CONFIGS[0]
    # Rowwise wgrad: torch's FP8 grouped GEMM (16-token group alignment) against the
    # group-scaled Triton kernel (128-token group blocks), same quantized values.
    for align, name in ((fp8_gemm.WGRAD_GROUP_ALIGN, "torch scaled rowwise wgrad"),
                        (fg.BLOCK, "triton group-scaled wgrad")):
        dy_c, dy_c_inv, aligned = qt.quantize_group_columns_t(dy, offsets, E4M3, False,
                                                              align=align)
        x_c, x_c_inv, _ = qt.quantize_group_columns_t(x, offsets, E4M3, False, align=align)
        if align == fg.BLOCK:
            _sweep(name, "GROUP_SCALED_WGRAD_CONFIG", GROUP_SCALED_CONFIGS,
                   lambda dy_c=dy_c, dy_c_inv=dy_c_inv, x_c=x_c, x_c_inv=x_c_inv:
                   fg.blockwise_wgrad(dy_c, dy_c_inv, x_c, x_c_inv, sizes, M,
                                      group_scales=True), flops, row)
        else:
            row[name] = _tflops(
                lambda dy_c=dy_c, dy_c_inv=dy_c_inv, x_c=x_c, x_c_inv=x_c_inv, aligned=aligned:
                fp8_gemm.wgrad(dy_c, dy_c_inv, x_c, x_c_inv, aligned, torch.bfloat16), flops)
    fg.GROUP_SCALED_WGRAD_CONFIG = default_group_scaled
    return row


def _shape(name: str, shapes: dict) -> Shape:
    """A bench shape by name, or ``uniform:G:M:K:N`` (``G`` equal groups of ``M / G`` rows)."""
    if not name.startswith("uniform:"):
        return shapes[name]
    G, M, K, N = (int(v) for v in name.split(":")[1:])
    return Shape(name, (M // G,) * G, K, N, "")


def main(names):
    torch.manual_seed(0)
    shapes = load_shapes()
    for name in names or list(shapes):
        shape = _shape(name, shapes)
        row = _shape_row(shape)
        print(f"{name} (G={shape.G}, M={shape.M}, K={shape.K}, N={shape.N}) TFLOP/s:")
        for key, value in row.items():
            print(f"  {key:42s} {value:7.0f}" if value else f"  {key:42s}       -")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
