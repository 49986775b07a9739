"""Launch shapes of the permute/unpermute row kernels against the copy bandwidth (CUDA).

``PYTHONPATH=. python benchmarks/layout_kernels.py``: 8192 tokens, top-8 of 64 experts,
hidden 4096 and 7168, bf16. ``scatter_rows`` (permute forward) moves ``(T + M) * H``
elements, ``combine_rows`` (permute backward, unpermute forward) ``(M + T) * H``; GB/s
count 2 bytes each, as a fraction of a bf16 copy's GB/s; ``spread_rows`` with weights
(unpermute backward) moves what ``scatter_rows`` does.
"""

import torch
import triton.testing

from grouped_linear.kernels import layout, routing


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    torch.manual_seed(0)
    tokens, k, experts = 8192, 8, 64
    topk = torch.randn(tokens, experts, device="cuda").topk(k, dim=-1).indices
    num_rows = tokens * k
    _, row_map, token_of_row, _ = routing.routing_map(topk, experts, 1, num_rows)
    for hidden in (4096, 7168):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(y)
        copy = 2 * y.numel() * 2 / _ms(lambda y=y, dst=dst: dst.copy_(y)) / 1e6
        moved = (tokens + num_rows) * hidden * 2
        ms = _ms(lambda x=x: layout.gather_rows(x, token_of_row))
        probs = torch.rand(tokens, k, device="cuda")
        print(f"H={hidden} copy {copy:.0f} GB/s; gather by token (before): "
              f"{moved / ms / 1e6 / copy:.2f} of copy")
        for config in ((16, 256, 4), (32, 256, 4), (16, 512, 8), (8, 1024, 8), (4, 1024, 4),
                       (4, 2048, 8), (2, 2048, 4)):
            layout.SCATTER_CONFIG = layout.COMBINE_CONFIG = config
            scatter = _ms(lambda x=x: layout.scatter_rows(x, row_map, token_of_row))
            combine = _ms(lambda y=y: layout.combine_rows(y, row_map, None))
            spread = _ms(lambda x=x, p=probs: layout.spread_rows(x, row_map, num_rows, p))
            print(f"  {config}: scatter {moved / scatter / 1e6 / copy:.2f}, "
                  f"combine {moved / combine / 1e6 / copy:.2f}, "
                  f"weighted spread {moved / spread / 1e6 / copy:.2f} of copy")


if __name__ == "__main__":
    main()
