"""torch.compile(fullgraph=True) against eager for GroupedLinear and GroupedMLP (bf16, CUDA).

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/compile_vs_eager.py``. Prints
forward+backward milliseconds (do_bench median) and the compiled/eager speed ratio.
"""

import torch
import triton.testing

import grouped_linear as gl

CASES = [  # (label, build, rows, in features)
    ("GroupedLinear 8x8192 2048->2048", lambda: gl.GroupedLinear(8, 2048, 2048), [8192] * 8, 2048),
    ("GroupedLinear 8x128 1024->1024", lambda: gl.GroupedLinear(8, 1024, 1024), [128] * 8, 1024),
    ("GroupedMLP 8x4096 2048/1024 swiglu", lambda: gl.GroupedMLP(8, 2048, 1024), [4096] * 8, 2048),
]


def _time_step(fn, leaves) -> float:
    return triton.testing.do_bench(lambda: fn().sum().backward(), warmup=50, rep=200,
                                   return_mode="median", grad_to_none=leaves)


def main():
    torch.manual_seed(0)
    print(f"{'case':36s} {'eager ms':>9s} {'compiled ms':>12s} {'compiled/eager speed':>21s}")
    for label, build, sizes, features in CASES:
        module = build().to("cuda", torch.bfloat16)
        x = torch.randn(sum(sizes), features, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        splits = torch.tensor(sizes, device="cuda")
        compiled = torch.compile(module, fullgraph=True)
        leaves = [x, *module.parameters()]
        eager_ms = _time_step(lambda m=module, x=x, s=splits: m(x, s), leaves)
        compiled_ms = _time_step(lambda m=compiled, x=x, s=splits: m(x, s), leaves)
        print(f"{label:36s} {eager_ms:9.3f} {compiled_ms:12.3f} {eager_ms / compiled_ms:21.2f}")


if __name__ == "__main__":
    main()
