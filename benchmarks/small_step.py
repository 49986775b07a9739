"""Host time of a small GroupedLinear step, piece by piece (CUDA).

``PYTHONPATH=. python benchmarks/small_step.py``: 8 groups x 128 rows, 1024 -> 1024, bf16,
CUDA splits. Each row is synchronized wall time per call over back-to-back calls (the step
is host-bound: the GPU work is ~6 µs per GEMM), from the cost of one empty Triton launch and
one empty autograd node up to the whole layer; then torch.profiler's host table of the
layer's forward+backward.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from overhead import small_step_case, wall_us  # benchmarks/overhead.py
from torch.profiler import ProfilerActivity, profile

import grouped_linear as gl
from grouped_linear.kernels import triton_gemm


@triton.jit
def _empty_kernel(a_ptr, b_ptr, c_ptr, d_ptr, M, N, K, G, s0, s1, s2, s3,
                  FLAG: tl.constexpr, BLOCK: tl.constexpr):
    pass


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def layout_host_times():
    """Host and GPU time of the layout ops at the smallest layouts-bench size (hidden 4096,
    65536 routed rows): an op whose host time exceeds its GPU time is launch-bound there."""
    tokens, k, experts, hidden = 8192, 8, 64, 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(tokens, experts, device="cuda")
    probs, indices = logits.softmax(-1).topk(k, dim=-1)
    y_perm, splits, row_map = gl.permute(x, indices, experts)
    y_perm = y_perm.detach().requires_grad_()
    out = gl.unpermute(y_perm, row_map, probs)
    grad = torch.randn_like(out)
    cases = {
        "permute fwd": lambda: gl.permute(x, indices, experts),
        "unpermute fwd": lambda: gl.unpermute(y_perm, row_map, probs),
        "unpermute bwd": lambda: torch.autograd.grad(out, y_perm, grad, retain_graph=True),
    }
    print(f"{'layout op (4096 x 65536)':30s} {'host µs':>9s} {'do_bench µs':>12s}")
    for name, fn in cases.items():
        gpu = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        host = wall_us(fn, n=40, warmup=5, host_only=True)  # the queue does not fill
        print(f"{name:30s} {host:9.1f} {gpu:12.1f}")


def profile_backward(layer, x, splits, grad, steps=300):
    """cProfile of the layer's forward+backward with the backward on the calling thread (the
    profiler sees one thread only): where the Python time of a small step goes."""
    import cProfile
    import pstats

    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(20):
            layer(x, splits).backward(grad)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            layer(x, splits).backward(grad)
        torch.cuda.synchronize()
        profiler.disable()
    print(f"===== cProfile, layer fwd+bwd with bias, {steps} steps (tottime)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def main():
    case = small_step_case()
    G, M, K, N, dt = case.G, case.M, case.K, case.N, case.dtype
    x, w, b, splits, offs, grad = case.x, case.w, case.b, case.splits, case.offs, case.grad
    layer, layer_nb = case.layer, case.layer_nb
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    args = (xd, wd, bd, grad, M, N, K, G, 1024, 1024, 1024, 1024)
    compiled = _empty_kernel[(132,)](*args, FLAG=True, BLOCK=64)
    stream = torch.cuda.current_stream().cuda_stream

    def direct_launch():
        compiled.run(132, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *args, True, 64)

    y_nb = layer_nb(x, splits)
    cases = {
        "empty Triton kernel, kernel[grid](...)": lambda: _empty_kernel[(132,)](
            *args, FLAG=True, BLOCK=64),
        "empty Triton kernel, CompiledKernel.run": direct_launch,
        "torch.empty (one op)": lambda: torch.empty(M, N, device="cuda", dtype=dt),
        "empty autograd node fwd+bwd": lambda: _Identity.apply(x).backward(grad),
        "raw grouped_mm fwd": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "raw grouped_mm fwd+bwd": lambda: F.grouped_mm(x, w.transpose(-2, -1),
                                                       offs=offs).backward(grad),
        "triton_gemm.forward (no grad)": lambda: triton_gemm.forward(xd, wd, None, splits),
        "triton_gemm.forward + bias": lambda: triton_gemm.forward(xd, wd, bd, splits),
        "triton_gemm.dgrad": lambda: triton_gemm.dgrad(grad, wd, splits),
        "triton_gemm.wgrad + bias": lambda: triton_gemm.wgrad(grad, xd, splits, True),
        "gl.grouped_linear fwd, no grad": lambda: gl.grouped_linear(xd, wd, None, splits),
        "gl.grouped_linear fwd": lambda: gl.grouped_linear(x, w, None, splits),
        "gl.grouped_linear fwd+bwd": lambda: gl.grouped_linear(x, w, None, splits).backward(grad),
        "gl.grouped_linear fwd+bwd, bias": lambda: gl.grouped_linear(x, w, b,
                                                                     splits).backward(grad),
        "layer fwd, no bias": lambda: layer_nb(x, splits),
        "layer fwd, bias": lambda: layer(x, splits),
        "layer bwd only, no bias": lambda: y_nb.backward(grad, retain_graph=True),
        "layer fwd+bwd, no bias": lambda: layer_nb(x, splits).backward(grad),
        "layer fwd+bwd, bias": lambda: layer(x, splits).backward(grad),
    }
    def on_calling_thread(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()
        return run

    for name in ("raw grouped_mm fwd+bwd", "empty autograd node fwd+bwd", "layer fwd+bwd, no bias",
                 "layer fwd+bwd, bias"):
        cases[name + ", backward on the calling thread"] = on_calling_thread(cases[name])
    print(f"{'case':60s} {'wall µs/call':>12s}")
    for name, fn in cases.items():
        print(f"{name:60s} {wall_us(fn, n=400, warmup=30):12.1f}")
    for name in ("raw grouped_mm fwd+bwd", "layer fwd+bwd, bias"):
        fn = cases[name]
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median",
                                     grad_to_none=[x, w, b, *layer.parameters()])
        print(f"{name:60s} do_bench {ms * 1e3:8.1f} µs")
    profile_backward(layer, x, splits, grad)
    layout_host_times()
    for label, module in (("no bias", layer_nb), ("bias", layer)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                module(x, splits).backward(grad)
            torch.cuda.synchronize()
        print(f"===== layer fwd+bwd, {label}: host time of 20 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                        max_name_column_width=55))


if __name__ == "__main__":
    main()
