"""Float8Blockwise's forward+backward with its kernel choices switched (CUDA).

``PYTHONPATH=. python benchmarks/blockwise_variants.py [shape ...]``: the bench's
``fp8_block`` column (``GroupedLinear`` without bias, CUDA splits) under each setting below,
with bf16 ``F.grouped_mm`` beside it, in three alternating rounds in one process (runs on
the same machine differ by up to 20%; alternation keeps the comparison fair). TFLOP/s
(3 x 2 M K N per step) per round, then the median ratio to ``grouped_mm``.

* ``default``: the library's choices;
* ``two_reads``: each operand's layouts quantized apart (``ONE_READ_QUANTIZATION`` off).
"""

import statistics
import sys

import torch

from grouped_linear.cli import bench
from grouped_linear.cli.timing import median_seconds
from grouped_linear.ops import fp8_blockwise

SETTINGS = {"default": {},
            "two_reads": {(fp8_blockwise, "ONE_READ_QUANTIZATION"): False}}
SWITCHES = sorted({key for setting in SETTINGS.values() for key in setting}, key=str)
DEFAULT_SHAPES = ("dsv3_ep32_fc1", "te_jagged_8", "qwen35_397b_ep64_fc1", "qwen35_397b_ep64_fc2",
                  "qwen3_30b_g128_skew")


def _set(setting, defaults):
    for (module, name), default in defaults.items():
        setattr(module, name, setting.get((module, name), default))


def main(names):
    defaults = {(module, name): getattr(module, name) for module, name in SWITCHES}
    shapes = bench.load_shapes()
    device = torch.device("cuda")
    print(f"{'shape':22s} {'setting':17s} {'TFLOP/s per round':>26s} {'/torch':>7s}")
    for name in names or DEFAULT_SHAPES:
        shape = shapes[name]
        flops = 3 * 2 * sum(shape.splits) * shape.K * shape.N
        grad = torch.randn(sum(shape.splits), shape.N, device=device, dtype=torch.bfloat16)
        cases = {"torch": bench._build_case("torch", shape, device, torch.bfloat16, grad),
                 "block": bench._build_case("fp8_block", shape, device, torch.bfloat16, grad)}
        rounds = {label: [] for label in ("torch", *SETTINGS)}
        for _ in range(3):
            for label in rounds:
                _set(SETTINGS.get(label, {}), defaults)
                case = cases["torch" if label == "torch" else "block"]
                seconds = median_seconds(case.forward_backward, device,
                                         grad_to_none=case.leaves)
                rounds[label].append(flops / seconds / 1e12)
        torch_median = statistics.median(rounds["torch"])
        for label, values in rounds.items():
            ratio = statistics.median(values) / torch_median
            print(f"{name:22s} {label:17s} {' / '.join(f'{v:6.0f}' for v in values):>26s} "
                  f"{ratio:7.2f}")
        del cases, grad
    _set({}, defaults)


if __name__ == "__main__":
    main(sys.argv[1:])
