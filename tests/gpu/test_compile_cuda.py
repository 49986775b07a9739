"""torch.compile(fullgraph=True) on CUDA with device splits: equal to eager, no recompiles."""

import pytest
import torch
import torch._dynamo

import grouped_linear as gl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["grouped", "triton"])
def test_compiled_mlp_matches_eager_on_cuda(backend):
    torch._dynamo.reset()
    mlp = gl.GroupedMLP(4, 64, 32, params_dtype=torch.bfloat16, device="cuda", backend=backend)
    compiled = torch.compile(lambda x, s: mlp(x, s), fullgraph=True)
    for i, sizes in enumerate([[10, 0, 30, 24], [64, 0, 0, 0]]):
        x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        splits = torch.tensor(sizes, device="cuda")
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            y = compiled(x, splits)
        y.float().square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        x_ref = x.detach().clone().requires_grad_()
        y_ref = mlp(x_ref, splits)
        y_ref.float().square().sum().backward()
        torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
        for a, b in zip(grads, [x_ref.grad] + [p.grad for p in mlp.parameters()]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        mlp.zero_grad(set_to_none=True)
