"""A list of per-expert tensors against one tensor as ``GroupedLinear`` input (CUDA).

``PYTHONPATH=. python benchmarks/list_input.py``: forward+backward do_bench medians on two
bench shapes, bf16 and Float8Rowwise, bias on, host splits; the ratio list/tensor time
(1.0 = a list costs nothing extra). FP8 lists run twice: concatenated, and quantized piece by
piece (``FP8_LIST_WITHOUT_CAT``): the pieces read where they lie.
"""

import importlib

import torch
import triton.testing

import grouped_linear as gl
from grouped_linear.cli.bench import load_shapes

# the module (grouped_linear.ops re-exports a function of the same name)
gl_ops = importlib.import_module("grouped_linear.ops.grouped_linear")


def _ms(layer, inp, splits, grad, leaves):
    return triton.testing.do_bench(lambda: layer(inp, splits).backward(grad), warmup=10, rep=60,
                                   return_mode="median", grad_to_none=leaves)


def main():
    torch.manual_seed(0)
    shapes = load_shapes()
    for name in ("dsv3_ep32_fc1", "qwen35_397b_ep64_fc2"):
        shape = shapes[name]
        splits = list(shape.splits)
        x = torch.randn(shape.M, shape.K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        pieces = [p.detach().clone().requires_grad_() for p in x.split(splits)]
        grad = torch.randn(shape.M, shape.N, device="cuda", dtype=torch.bfloat16)
        for label, recipe in (("bf16", None), ("fp8 rowwise", gl.recipes.Float8Rowwise())):
            layer = gl.GroupedLinear(shape.G, shape.K, shape.N, params_dtype=torch.bfloat16,
                                     device="cuda", recipe=recipe)
            params = list(layer.parameters())
            tensor_ms = _ms(layer, x, splits, grad, [x, *params])
            default = gl_ops.FP8_LIST_WITHOUT_CAT
            for without_cat in (False, True) if recipe is not None else (False,):
                gl_ops.FP8_LIST_WITHOUT_CAT = without_cat
                list_ms = _ms(layer, pieces, None, grad, [*pieces, *params])
                how = "pieces" if without_cat else "cat"
                print(f"{name:22s} {label:12s} tensor {tensor_ms:7.3f} ms  list ({how:6s}) "
                      f"{list_ms:7.3f} ms  list/tensor {list_ms / tensor_ms:5.3f}")
            gl_ops.FP8_LIST_WITHOUT_CAT = default


if __name__ == "__main__":
    main()
