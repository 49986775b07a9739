"""Launch shapes of the permute/unpermute row kernels against the copy bandwidth (CUDA).

From the repository root, ``PYTHONPATH=. python benchmarks/layout_kernels.py``: 8192
tokens, top-8 of 64 experts, hidden 4096 and 7168, bf16. ``scatter_rows`` (permute
forward) moves ``(T + M) * H`` elements, ``combine_rows`` (permute backward, unpermute
forward) ``(M + T) * H``; GB/s count 2 bytes each, as a fraction of a bf16 copy's GB/s
(medians); ``spread_rows`` with weights (unpermute backward) moves what ``scatter_rows``
does. Each launch shape of the list goes to all three as their ``config=`` (defaults
``SCATTER_CONFIG``, ``COMBINE_CONFIG``). First, per hidden size, the gather by token that
permute ran before.
"""

import torch
from _common import CUDA, median_ms, randn, warm_gpu

from grouped_linear.kernels.routing import combine as combine_kernels
from grouped_linear.kernels.routing import routing_map
from grouped_linear.kernels.routing import rows as row_kernels

CONFIGS = [(16, 256, 4), (32, 256, 4), (16, 512, 8), (8, 1024, 8), (4, 1024, 4), (4, 2048, 8),
           (2, 2048, 4)]  # (rows, columns, warps) per program


def main() -> None:
    torch.manual_seed(0)
    tokens, k, experts = 8192, 8, 64
    topk = torch.randn(tokens, experts, device=CUDA).topk(k, dim=-1).indices
    num_rows = tokens * k
    _, row_map, token_of_row, _ = routing_map.routing_map(topk, experts, 1, num_rows)
    for hidden in (4096, 7168):
        x = randn(tokens, hidden, device=CUDA, dtype=torch.bfloat16)
        y = randn(num_rows, hidden, device=CUDA, dtype=torch.bfloat16)
        probs = torch.rand(tokens, k, device=CUDA)
        dst = torch.empty_like(y)
        warm_gpu()
        copy = 2 * y.numel() * 2 / median_ms(lambda y=y, dst=dst: dst.copy_(y)) / 1e6
        moved = (tokens + num_rows) * hidden * 2
        ms = median_ms(lambda x=x: row_kernels.gather_rows(x, token_of_row))
        print(f"H={hidden} copy {copy:.0f} GB/s; gather by token (before): "
              f"{moved / ms / 1e6 / copy:.2f} of copy")
        for config in CONFIGS:
            scatter = median_ms(lambda x=x, c=config: row_kernels.scatter_rows(
                x, row_map, token_of_row, config=c))
            combine = median_ms(lambda y=y, c=config: combine_kernels.combine_rows(
                y, row_map, None, config=c))
            spread = median_ms(lambda x=x, p=probs, c=config: row_kernels.spread_rows(
                x, row_map, num_rows, p, config=c))
            print(f"  {config}: scatter {moved / scatter / 1e6 / copy:.2f}, "
                  f"combine {moved / combine / 1e6 / copy:.2f}, "
                  f"weighted spread {moved / spread / 1e6 / copy:.2f} of copy", flush=True)


if __name__ == "__main__":
    main()
