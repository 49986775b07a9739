"""Where the Triton kernels beat torch's grouped GEMM: sets ``TRITON_AUTO_MAX_ROWS``.

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/triton_vs_grouped.py``.
``GroupedLinear`` with bias and CUDA splits, bf16, do_bench medians in µs.
"""

import torch
import triton.testing

import grouped_linear as gl

CASES = [  # (label, sizes, K, N)
    ("8x128 1024->1024", [128] * 8, 1024, 1024),
    ("8x256 2048->2048", [256] * 8, 2048, 2048),
    ("8x512 2048->2048", [512] * 8, 2048, 2048),
    ("8x1024 4096->2048", [1024] * 8, 4096, 2048),
    ("8x2048 2048->2048", [2048] * 8, 2048, 2048),
    ("8x8192 2048->2048", [8192] * 8, 2048, 2048),
    ("16 unaligned 4096->2048", [1000 + 37 * i for i in range(16)], 4096, 2048),
    ("64x32 decode 2048->1536", [32] * 64, 2048, 1536),
]


def main():
    torch.manual_seed(0)
    print(f"{'case':26s} {'rows':>6s} | {'grouped fwd':>11s} {'fwd+bwd':>8s} | "
          f"{'triton fwd':>10s} {'fwd+bwd':>8s} | triton TFLOP/s fwd, fwd+bwd")
    for label, sizes, K, N in CASES:
        M, G = sum(sizes), len(sizes)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        splits = torch.tensor(sizes, device="cuda")
        times = {}
        for backend in ("grouped", "triton"):
            layer = gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device="cuda",
                                     backend=backend)
            leaves = [x, *layer.parameters()]
            fwd = triton.testing.do_bench(lambda lay=layer, x=x, s=splits: lay(x, s), warmup=25, rep=100,
                                          return_mode="median", grad_to_none=leaves)
            step = triton.testing.do_bench(lambda lay=layer, x=x, s=splits, g=grad: lay(x, s).backward(g),
                                           warmup=25, rep=100, return_mode="median",
                                           grad_to_none=leaves)
            times[backend] = (fwd * 1e3, step * 1e3)
        flops = 2 * M * K * N
        g, t = times["grouped"], times["triton"]
        print(f"{label:26s} {M:6d} | {g[0]:11.1f} {g[1]:8.1f} | {t[0]:10.1f} {t[1]:8.1f} | "
              f"{flops / t[0] / 1e6:.0f}, {3 * flops / t[1] / 1e6:.0f}")


if __name__ == "__main__":
    main()
