"""torch.compile(fullgraph=True) against eager for GroupedLinear and GroupedMLP (bf16, CUDA).

From the repository root, on a CUDA machine: ``PYTHONPATH=. python
benchmarks/compile_vs_eager.py``. Prints forward+backward milliseconds (median) eager,
compiled with the default mode and compiled with ``mode="reduce-overhead"`` (CUDA graphs),
and the speed ratios against eager. Each compiled variant wraps its own copy of the module,
after ``torch._dynamo.reset()``, so no variant reuses another's compiled code. The last case
is no layer of ours: raw ``F.grouped_mm`` in a module, to show what compiling costs torch's
own operator at the small size.
"""

import copy

import torch
import torch.nn.functional as F
from _common import CUDA, device_groups, median_ms, randn, warm_gpu

import grouped_linear as gl


class RawGroupedMM(torch.nn.Module):
    """``F.grouped_mm`` on a ``(G, out, in)`` weight, group ends from the split tensor."""

    def __init__(self, groups: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(groups, out_features, in_features)
                                         / in_features**0.5)

    def forward(self, x: torch.Tensor, splits: torch.Tensor) -> torch.Tensor:
        ends = splits.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, self.weight.transpose(-2, -1), offs=ends)


CASES = [  # (label, build, rows, in features)
    ("GroupedLinear 8x8192 2048->2048", lambda: gl.GroupedLinear(8, 2048, 2048), [8192] * 8, 2048),
    ("GroupedLinear 8x128 1024->1024", lambda: gl.GroupedLinear(8, 1024, 1024), [128] * 8, 1024),
    ("GroupedMLP 8x4096 2048/1024 swiglu", lambda: gl.GroupedMLP(8, 2048, 1024), [4096] * 8, 2048),
    ("raw F.grouped_mm 8x128 1024->1024", lambda: RawGroupedMM(8, 1024, 1024), [128] * 8, 1024),
]
MODES = ("default", "reduce-overhead")


def _time_step(module, x, splits, grad) -> float:
    leaves = [x, *module.parameters()]

    def step():
        # A training step starts here: gradients from the last step are dropped (as
        # zero_grad(set_to_none=True) does; do_bench's warm-up calls do not reset them) and
        # reduce-overhead may reuse its CUDA-graph memory (a no-op for the other modes).
        for leaf in leaves:
            leaf.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        module(x, splits).backward(grad)

    return median_ms(step, leaves, cuda_rep_ms=200)


def main():
    torch.manual_seed(0)
    print(f"{'case':36s} {'eager ms':>9s} {'compiled ms':>12s} {'reduce-overhead ms':>19s} "
          f"{'compiled/eager':>15s} {'reduce-overhead/eager':>22s}  (speed ratios)")
    for label, build, sizes, features in CASES:
        module = build().to(CUDA, torch.bfloat16)
        x = randn(sum(sizes), features, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        splits, _ = device_groups(sizes)
        # a random output gradient (a loss's ``.sum()`` would hand backward an expanded
        # zero-stride tensor, which raw ``grouped_mm``'s backward rejects on torch 2.11)
        grad = torch.randn_like(module(x, splits))
        warm_gpu()
        eager_ms = _time_step(module, x, splits, grad)
        compiled_ms = []
        for mode in MODES:
            torch._dynamo.reset()
            compiled = torch.compile(copy.deepcopy(module), fullgraph=True, mode=mode)
            compiled_ms.append(_time_step(compiled, x, splits, grad))
        print(f"{label:36s} {eager_ms:9.3f} {compiled_ms[0]:12.3f} {compiled_ms[1]:19.3f} "
              f"{eager_ms / compiled_ms[0]:15.2f} {eager_ms / compiled_ms[1]:22.2f}")


if __name__ == "__main__":
    main()
