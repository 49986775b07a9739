"""FP8 recipes on CUDA (emulated numerics; the fast FP8 GEMMs come on top of these)."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.recipes import Float8Rowwise, Float8Tensorwise
from tests.reference import reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise()], ids=repr)
@pytest.mark.parametrize("split_kind", ["list", "cuda"])
def test_fp8_matches_float64_on_cuda(recipe, split_kind):
    sizes = [100, 0, 333, 79, 512]
    G, K, N, M = len(sizes), 256, 128, sum(sizes) + 11
    x = torch.randn(M if split_kind == "cuda" else sum(sizes), K, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    splits = sizes if split_kind == "list" else torch.tensor(sizes, device="cuda")
    y = gl.grouped_linear(x, w, None, splits, recipe=recipe)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = reference_grads(x, w, None, sizes, grad_out)
    for got, want in zip((y, x.grad, w.grad), ref):
        assert rel_err(got, want) < 6e-2
    assert torch.all(y[sum(sizes):] == 0)
