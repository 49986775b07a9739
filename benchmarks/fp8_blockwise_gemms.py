"""The blockwise FP8 GEMMs alone: Triton kernels against the Gluon (Hopper) kernels (CUDA).

``PYTHONPATH=. python benchmarks/fp8_blockwise_gemms.py [shape ...]``: on the bench shapes,
forward (``x @ W^T``), dgrad (``dy @ W``, as the recipe runs it: the transposed weight copy)
and wgrad (token-block operands) through ``fp8_triton_gemm`` and the Gluon kernels
(``fp8_gluon_gemm``, ``fp8_gluon_wgrad``) on the same quantized operands; do_bench medians in
TFLOP/s (``2 M K N`` per GEMM), and whether the kernels' bf16 outputs are identical.
"""

import sys

import torch
import triton.testing

from grouped_linear.cli.bench import load_shapes
from grouped_linear.kernels import fp8_gluon_gemm as gg
from grouped_linear.kernels import fp8_gluon_wgrad as gw
from grouped_linear.kernels import fp8_triton_gemm as fg
from grouped_linear.kernels import quantize_blocks as qb

E4M3 = torch.float8_e4m3fn


def _tflops(flops: int, fn) -> float:
    return flops / triton.testing.do_bench(fn, rep=200) / 1e9


def _mm(M, R, W, sizes):
    a = qb.quantize_row_tiles(torch.randn(M, R, device="cuda", dtype=torch.bfloat16), E4M3, True)
    w = qb.quantize_weight_blocks(torch.randn(sizes.shape[0], W, R, device="cuda",
                                              dtype=torch.bfloat16), E4M3, True)
    triton_fn = lambda: fg.grouped_mm(*a, *w, sizes, transpose_weight=True,  # noqa: E731
                                      scaling="blockwise")
    gluon_fn = lambda: gg.grouped_mm(*a, *w, sizes)  # noqa: E731
    same = torch.equal(triton_fn(), gluon_fn())
    flops = 2 * M * R * W
    return _tflops(flops, triton_fn), _tflops(flops, gluon_fn), same


def _wgrad(M, K, N, sizes):
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy_t = qb.quantize_token_blocks(dy, sizes, E4M3, True, transpose=True)
    x_t = qb.quantize_token_blocks(x, sizes, E4M3, True, transpose=True)
    triton_fn = lambda: fg.blockwise_wgrad(*dy_t, *x_t, sizes, M)  # noqa: E731
    gluon_fn = lambda: gw.blockwise_wgrad(*dy_t, *x_t, sizes, M)  # noqa: E731
    same = torch.equal(triton_fn(), gluon_fn())
    flops = 2 * M * K * N
    return _tflops(flops, triton_fn), _tflops(flops, gluon_fn), same


def main(names):
    shapes = load_shapes()
    print(f"{'shape':22s} {'GEMM':6s} {'Triton':>7s} {'Gluon':>7s} {'ratio':>6s} "
          "  identical")
    for name in names or [n for n in shapes if not n.startswith("small")]:
        shape = shapes[name]
        M, K, N = sum(shape.splits), shape.K, shape.N
        sizes = torch.tensor(list(shape.splits), device="cuda")
        for gemm, (tri, glu, same) in (("fwd", _mm(M, K, N, sizes)),
                                       ("dgrad", _mm(M, N, K, sizes)),
                                       ("wgrad", _wgrad(M, K, N, sizes))):
            print(f"{name:22s} {gemm:6s} {tri:7.0f} {glu:7.0f} {glu / tri:6.2f}  {same}")


if __name__ == "__main__":
    main(sys.argv[1:])
