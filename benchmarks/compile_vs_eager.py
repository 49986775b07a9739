"""torch.compile(fullgraph=True) against eager for GroupedLinear and GroupedMLP (bf16, CUDA).

Run on a CUDA machine: ``PYTHONPATH=. python benchmarks/compile_vs_eager.py``. Prints
forward+backward milliseconds (do_bench median) eager, compiled with the default mode
and compiled with ``mode="reduce-overhead"`` (CUDA graphs), and the speed ratios
against eager. Each compiled variant wraps its own copy of the module, after
``torch._dynamo.reset()``, so no variant reuses another's compiled code.
"""

import copy

import torch
import triton.testing

import grouped_linear as gl

CASES = [  # (label, build, rows, in features)
    ("GroupedLinear 8x8192 2048->2048", lambda: gl.GroupedLinear(8, 2048, 2048), [8192] * 8, 2048),
    ("GroupedLinear 8x128 1024->1024", lambda: gl.GroupedLinear(8, 1024, 1024), [128] * 8, 1024),
    ("GroupedMLP 8x4096 2048/1024 swiglu", lambda: gl.GroupedMLP(8, 2048, 1024), [4096] * 8, 2048),
]
MODES = ("default", "reduce-overhead")


def _time_step(module, x, splits) -> float:
    leaves = [x, *module.parameters()]

    def step():
        # A training step starts here: gradients from the last step are dropped (as
        # zero_grad(set_to_none=True) does; do_bench's warm-up calls do not reset them) and
        # reduce-overhead may reuse its CUDA-graph memory (a no-op for the other modes).
        for leaf in leaves:
            leaf.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        module(x, splits).sum().backward()

    return triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median",
                                   grad_to_none=leaves)


def main():
    torch.manual_seed(0)
    print(f"{'case':36s} {'eager ms':>9s} {'compiled ms':>12s} {'reduce-overhead ms':>19s} "
          f"{'compiled/eager':>15s} {'reduce-overhead/eager':>22s}  (speed ratios)")
    for label, build, sizes, features in CASES:
        module = build().to("cuda", torch.bfloat16)
        x = torch.randn(sum(sizes), features, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        splits = torch.tensor(sizes, device="cuda")
        eager_ms = _time_step(module, x, splits)
        compiled_ms = []
        for mode in MODES:
            torch._dynamo.reset()
            compiled = torch.compile(copy.deepcopy(module), fullgraph=True, mode=mode)
            compiled_ms.append(_time_step(compiled, x, splits))
        print(f"{label:36s} {eager_ms:9.3f} {compiled_ms[0]:12.3f} {compiled_ms[1]:19.3f} "
              f"{eager_ms / compiled_ms[0]:15.2f} {eager_ms / compiled_ms[1]:22.2f}")


if __name__ == "__main__":
    main()
