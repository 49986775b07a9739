"""FP8 primary weights on CUDA (each recipe's device route): a GroupedMLP with its weights
stored in FP8 against the same block holding the stored values in bf16, and float32 masters
training in step with that block; one step in a CUDA graph."""

import pytest
import torch

import grouped_linear as gl
from tests.gpu.test_cuda_graphs import _capture
from tests.reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]
SIZES = [100, 0, 300, 112]


def _pair(recipe):
    torch.manual_seed(0)
    kwargs = dict(bias=False, params_dtype=torch.bfloat16, device="cuda", recipe=recipe)
    stored = gl.to_fp8_weights(gl.GroupedMLP(4, 256, 128, **kwargs))
    plain = gl.GroupedMLP(4, 256, 128, **kwargs)
    with torch.no_grad():
        plain.fc1.weight.copy_(stored.fc1.weight.dequantize())
        plain.fc2.weight.copy_(stored.fc2.weight.dequantize())
    return stored, plain


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_stored_block_matches_the_plain_block_and_trains_in_step(recipe):
    stored, plain = _pair(recipe)
    masters = gl.MasterWeights(stored.parameters())
    opt = torch.optim.SGD(masters.params + masters.others, lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    splits = torch.tensor(SIZES, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        x = torch.randn(sum(SIZES), 256, device="cuda", generator=gen).bfloat16()
        y = stored(x, splits)
        y.float().square().mean().backward()
        y_plain = plain(x, splits)
        y_plain.float().square().mean().backward()
        if step == 0:
            assert rel_err(y, y_plain) < 1e-2
            assert rel_err(stored.fc1.weight.grad, plain.fc1.weight.grad) < 2e-2
        masters.step(opt)
        opt.zero_grad()
        plain_opt.step()
        plain_opt.zero_grad()
    for master, p in zip(masters.params, (plain.fc1.weight, plain.fc2.weight)):
        assert rel_err(master, p) < 2e-2


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_stored_block_in_a_cuda_graph(recipe):
    stored, _ = _pair(recipe)
    x = torch.randn(sum(SIZES), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(SIZES, device="cuda")

    def step():
        stored.zero_grad(set_to_none=True)
        x.grad = None
        y = stored(x, splits)
        y.float().square().sum().backward()
        return y, x.grad, stored.fc1.weight.grad

    graph, captured = _capture(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        stored.fc1.weight.mul_(0.5)  # quantized in place: the graph reads the same buffers
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in captured]
    for a, b in zip(got, step()):
        assert torch.equal(a, b)
