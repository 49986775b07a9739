"""Measure the ``loop`` and ``grouped`` backends per dtype, to set what ``auto`` picks.

Run on a CUDA machine: ``python benchmarks/backend_choice.py``. Prints forward
and forward+backward TFLOP/s of ``gl.grouped_linear`` for each backend, and
the relative error of fp32 against float64 (does the grouped GEMM use TF32?).
"""

from __future__ import annotations

import torch
import triton.testing

import grouped_linear as gl

CASES = {
    "8x8192 K2048 N2048": [8192] * 8,
    "16 unaligned K2048 N2048": [1000 + 37 * i for i in range(16)],
    "128 skewed K2048 N1536": None,
    "8x128 K1024 N1024 (small)": [128] * 8,
}


def _skewed(num_groups: int, total: int) -> list[int]:
    weights = torch.distributions.Dirichlet(torch.full((num_groups,), 0.5)).sample()
    sizes = (weights * total).floor().long().tolist()
    sizes[0] += total - sum(sizes)
    return sizes


def _shape(name: str) -> tuple[int, int]:
    k = int(name.split(" K")[1].split(" ")[0])
    n = int(name.split(" N")[1].split(" ")[0])
    return k, n


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, sizes in CASES.items():
        K, N = _shape(name)
        if sizes is None:
            sizes = _skewed(128, 131072)
        M, G = sum(sizes), len(sizes)
        flops = 2 * M * K * N
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=True)
            w = (torch.randn(G, N, K, device="cuda", dtype=dtype) / K**0.5).requires_grad_()
            splits = torch.tensor(sizes, device="cuda")
            grad = torch.randn(M, N, device="cuda", dtype=dtype)
            line = [name, str(dtype).replace("torch.", "")]
            for backend in ("loop", "grouped"):
                def fwd(x=x, w=w, splits=splits, backend=backend):
                    return gl.grouped_linear(x, w, None, splits, backend=backend)

                def step(fwd=fwd, grad=grad):
                    fwd().backward(grad)

                t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                t_s = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median",
                                              grad_to_none=[x, w])
                line += [f"{flops / t_f / 1e9:.0f}", f"{3 * flops / t_s / 1e9:.0f}"]
                if dtype == torch.float32:
                    ref = gl.grouped_linear(x.double(), w.double(), None, sizes, backend="loop")
                    err = (fwd().double() - ref).norm() / ref.norm()
                    line.append(f"err={err:.1e}")
            rows.append(line)
    print("case | dtype | loop fwd | loop fwd+bwd | grouped fwd | grouped fwd+bwd (TFLOP/s)")
    for line in rows:
        print(" | ".join(line))


if __name__ == "__main__":
    main()
