"""bf16 grouped GEMMs alone: torch's ``grouped_mm`` (plus the bias pass) against
:mod:`grouped_linear.kernels.gemm.gluon_gemm` (bias in the epilogue). CUDA, Hopper.

From the repository root, ``PYTHONPATH=. python benchmarks/bf16_gemms.py [--rounds R]
[--config BMxBNxBKxWxSxGROUP_MxTMA ...] [SHAPE ...]``: on the bench shapes (or
``uniform:G:M:K:N``), forward without and with bias, the dgrad (``dy @ W``) and the weight
gradient without and with the bias gradient (:mod:`grouped_linear.kernels.gemm.gluon_wgrad`,
in the first Gluon column; ``/b8``: its tile order in bands of 8 ``N`` tiles; ``wgrad>main``:
added into an fp32 ``main_grad``, rounded to bf16 first in the torch column, stored in
float32 in the Gluon one); medians in
TFLOP/s (``2 M K N`` per GEMM), torch and each Gluon configuration alternating within a
shape, the best of ``R`` rounds; and the relative difference ``|gluon - torch| / |torch|``
of the outputs (both accumulate in float32).
"""

import argparse

import torch
import torch.nn.functional as F
from _common import CUDA, bench_shapes, device_groups, median_ms, randn, tflops, warm_gpu

from grouped_linear.kernels import bias as bias_kernels
from grouped_linear.kernels.gemm import gluon_gemm, gluon_wgrad


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _cases(M, K, N, splits, configs):
    G = len(splits)
    x = randn(M, K, device=CUDA, dtype=torch.bfloat16)
    dy = randn(M, N, device=CUDA, dtype=torch.bfloat16)
    w = randn(G, N, K, device=CUDA, dtype=torch.bfloat16, scale=K ** -0.5)
    bias = randn(G, N, device=CUDA, dtype=torch.bfloat16)
    _, ends = device_groups(splits)

    def torch_bias():
        out = F.grouped_mm(x, w.transpose(-2, -1), offs=ends)
        return bias_kernels.bias_epilogue_(out, bias, ends, False)

    cases = {
        "fwd": (2 * M * K * N, lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=ends), {}),
        "fwd+bias": (2 * M * K * N, torch_bias, {"bias": bias}),
        "dgrad": (2 * M * K * N, lambda: F.grouped_mm(dy, w, offs=ends),
                  {"transposed_weight": True}),
    }
    yield from _wgrad_cases(M, K, N, x, dy, ends)
    for gemm, (flops, torch_fn, options) in cases.items():
        a = dy if options.get("transposed_weight") else x
        gluon_fns = {}
        for config in configs:
            if gluon_gemm.supported(a, w, options.get("transposed_weight", False), config):
                gluon_fns[config] = (lambda c=config, a=a, o=options: gluon_gemm.grouped_mm(
                    a, w, ends, config=c, **o))
        yield gemm, flops, torch_fn, gluon_fns


def _wgrad_cases(M, K, N, x, dy, ends):
    """The weight gradient (``grouped_mm(dy^T, x)``), and with the bias gradient (torch
    plus the bias reduction pass; the Gluon kernel sums ``dy`` from its own tiles)."""
    if not gluon_wgrad.supported(dy, x, ends.shape[0]):
        return
    flops = 2 * M * K * N
    for with_bias in (False, True):
        def torch_fn(with_bias=with_bias):
            grad_w = F.grouped_mm(dy.t(), x, offs=ends)
            if with_bias:
                bias_kernels.bias_grad(dy, ends, torch.bfloat16)
            return grad_w

        for band_n in (1, 8):  # tile order: each N tile's K tiles in a row, or bands of 8
            def gluon_fn(with_bias=with_bias, band_n=band_n):
                config = gluon_wgrad.WGRAD_CONFIG._replace(band_n=band_n)
                return gluon_wgrad.wgrad(dy, x, ends, with_bias, config=config)[0]

            name = ("wgrad+bias" if with_bias else "wgrad") + (f"/b{band_n}" if band_n > 1 else "")
            yield name, flops, torch_fn, {"wgrad": gluon_fn}

    # Into an fp32 main_grad: the Gluon gradient rounded to bf16 and added (the torch
    # column) against the same kernel storing float32 tiles (128 x 128) and added.
    main_grads = torch.zeros(2, ends.shape[0], N, K, device=x.device, dtype=torch.float32)

    def rounded():
        return main_grads[0].add_(gluon_wgrad.wgrad(dy, x, ends, False)[0])

    def float32():
        return main_grads[1].add_(
            gluon_wgrad.wgrad(dy, x, ends, False, out_dtype=torch.float32)[0])

    yield "wgrad>main", flops, rounded, {"float32": float32}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", help="bench shapes or uniform:G:M:K:N (default: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", action="append", default=[],
                        help="a Gluon launch shape BMxBNxBKxWxSxGROUP_MxTMA (repeatable; "
                        "default: the kernel's)")
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.config] or [gluon_gemm.MM_CONFIG]
    header = "  ".join(f"{'x'.join(map(str, c)):>16s}" for c in configs)
    print(f"{'shape':22s} {'GEMM':9s} {'torch':>7s}  {header}  rel. diff")
    for shape in bench_shapes(args.shapes):
        name, M, K, N = shape.name, shape.M, shape.K, shape.N
        warm_gpu()
        for gemm, flops, torch_fn, gluon_fns in _cases(M, K, N, list(shape.splits), configs):
            ref = torch_fn()
            diffs = [_relative(fn(), ref) for fn in gluon_fns.values()]
            rounds = []
            for _ in range(args.rounds):
                rounds.append([tflops(flops, median_ms(torch_fn))]
                              + [tflops(flops, median_ms(fn)) for fn in gluon_fns.values()])
            best = [max(r[i] for r in rounds) for i in range(len(rounds[0]))]
            cells = "  ".join(f"{v:16.1f}" for v in best[1:])
            print(f"{name:22s} {gemm:9s} {best[0]:7.1f}  {cells}  "
                  + " ".join(f"{d:.1e}" for d in diffs), flush=True)


if __name__ == "__main__":
    main()
