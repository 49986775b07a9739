"""Float8Blockwise's activation quantization: both block layouts from one read (Gluon, sm90)
against the two Triton passes the layer runs without it (CUDA).

``PYTHONPATH=. python benchmarks/fp8_block_quantize.py [shape ...]``: for each bench shape,
``x`` ``(M, K)`` and ``dy`` ``(M, N)`` in bf16 with the shape's splits; do_bench medians in
µs, bandwidth counting the bytes each must move (two passes: 2 + 1 bytes per element each;
one read: 2 + 1 + 1), the speedup, and whether the outputs are identical to the reference
(:func:`~grouped_linear.kernels.quantize_blocks_gluon.two_passes`, which also zeroes the
row tiles of the rows past the groups; the timed passes skip that, as the layer does).
"""

import sys

import torch
import triton.testing

from grouped_linear.cli.bench import load_shapes
from grouped_linear.kernels import quantize_blocks as qb
from grouped_linear.kernels import quantize_blocks_gluon as qbg

E4M3 = torch.float8_e4m3fn


def _same(got, want) -> bool:
    return all(torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b)
               for pair, want_pair in zip(got, want) for a, b in zip(pair, want_pair))


def main(names):
    shapes = load_shapes()
    print(f"{'shape':22s} {'operand':8s} {'two passes us':>14s} {'TB/s':>6s} "
          f"{'one read us':>12s} {'TB/s':>6s} {'speedup':>8s}  identical")
    for name in names or [n for n in shapes if not n.startswith("small")]:
        shape = shapes[name]
        M = sum(shape.splits)
        sizes = torch.tensor(list(shape.splits), device="cuda")
        for operand, C in (("x", shape.K), ("dy", shape.N)):
            t = torch.randn(M, C, device="cuda", dtype=torch.bfloat16)
            two = lambda t=t, sizes=sizes: (  # noqa: E731
                qb.quantize_row_tiles(t, E4M3, True, qbg.TILE),
                qb.quantize_token_blocks(t, sizes, E4M3, True, qbg.TILE, transpose=True))
            one = lambda t=t, sizes=sizes: qbg.quantize_row_tiles_and_token_blocks(  # noqa: E731
                t, sizes, E4M3, True)
            same = _same(one(), qbg.two_passes(t, sizes, E4M3, True))
            two_ms = triton.testing.do_bench(two)
            one_ms = triton.testing.do_bench(one)
            print(f"{name:22s} {operand:8s} {two_ms * 1e3:14.0f} {6 * M * C / two_ms / 1e9:6.2f} "
                  f"{one_ms * 1e3:12.0f} {4 * M * C / one_ms / 1e9:6.2f} {two_ms / one_ms:8.2f}  "
                  f"{same}")


if __name__ == "__main__":
    main(sys.argv[1:])
