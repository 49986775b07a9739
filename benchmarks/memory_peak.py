"""What holds the memory at a step's peak: the CUDA allocations live at the high-water mark of
one forward+backward, each named by the line of this library (or of the caller) that made it.

From the repository root, on a CUDA machine:

* ``PYTHONPATH=. python benchmarks/memory_peak.py transformers CASE COLUMN [COLUMN ...]``:
  a case of the transformers suite (``qwen3_30b_a3b``, ...; transformers importable) and its
  columns (``transformers``, ``grouped_linear``, ``fp8_rowwise``, ...);
* ``PYTHONPATH=. python benchmarks/memory_peak.py moe CASE COLUMN [COLUMN ...]``: a case of
  the moe suite and its columns (``bf16``, ``fp8_rowwise``, ...).

Per column: the peak (as the suite reports it), the allocation that reached it, and the
live allocations at that moment summed per allocating line, largest first. The history
comes from ``torch.cuda.memory._record_memory_history`` (Python stacks), replayed in order.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import torch

from grouped_linear.cli import bench_moe, bench_transformers

CUDA = torch.device("cuda")
DT = torch.bfloat16
GiB = 2 ** 30


def _where(frames: list[dict]) -> str:
    """The innermost frame in this library (or else outside torch) that made an allocation."""
    for frame in frames:
        name = frame.get("filename", "")
        if "grouped_linear" in name or ("torch" not in name and name.endswith(".py")):
            short = name.split("grouped_linear/", 1)[-1] if "grouped_linear" in name else name
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


def peak_table(step: Callable[[], object], clear: Callable[[], None]) -> None:
    """Run ``step`` once under the allocator's history and print what is live at its peak."""
    step()  # compiled kernels, caches filled: the history records a steady step
    clear()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    clear()
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    cause = ""
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _where(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak, cause = total, dict(live), live[addr][1]
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    # Allocations made before the history started are live throughout: add them.
    before = 0
    for segment in snapshot["segments"]:
        addr = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and addr not in live:
                before += block["size"]
            addr += block["size"]
    print(f"peak {(peak + before) / GiB:.2f} GiB: {before / GiB:.2f} GiB held before the step "
          f"(parameters, inputs) and {peak / GiB:.2f} GiB of the step's own; reached by "
          f"{cause}")
    by_line: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        by_line[where][0] += size
        by_line[where][1] += 1
    print(f"{'GiB':>7}  {'n':>3}  allocated at")
    for where, (size, count) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"{size / GiB:7.3f}  {count:3d}  {where}")


def transformers_steps(case_name: str, columns: list[str]) -> None:
    cases = {case.name: case for case in bench_transformers.CASES}
    case = cases[case_name]
    experts = bench_transformers._experts(case, CUDA, DT)
    bench_transformers.gl_hf.register()
    H = case.config["hidden_size"]
    hidden = torch.randn(case.tokens, H, device=CUDA).to(DT).requires_grad_()
    logits = torch.randn(case.tokens, experts.num_experts, device=CUDA)
    weights, index = logits.softmax(-1).topk(case.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(DT)
    grad_out = torch.randn(case.tokens, H, device=CUDA).to(DT)
    entries = bench_transformers._columns(CUDA)
    leaves = [hidden, *experts.parameters()]

    def clear() -> None:
        for t in leaves:
            t.grad = None

    for column in columns:
        def step(entry=entries[column]) -> None:
            experts.config._experts_implementation = entry
            experts(hidden, index, weights).backward(grad_out)

        print(f"===== transformers {case_name} {column}")
        peak_table(step, clear)


def moe_steps(case_name: str, columns: list[str]) -> None:
    cases = {case.name: case for case in bench_moe.CASES}
    inputs = bench_moe._inputs(cases[case_name], CUDA, DT)
    known = bench_moe._columns(CUDA)
    for column in columns:
        print(f"===== moe {case_name} {column}")
        peak_table(bench_moe._step(inputs, known[column]), inputs.drop_grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=("transformers", "moe"))
    parser.add_argument("case")
    parser.add_argument("columns", nargs="+")
    args = parser.parse_args()
    (transformers_steps if args.suite == "transformers" else moe_steps)(args.case, args.columns)


if __name__ == "__main__":
    main()
