"""permute's routing inputs on CUDA: the loop reference's layout, and no host sync (run by
``make test-gpu``)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from grouped_linear.ops.permutation import permute, unpermute
from tests.gpu.test_grouped_linear_cuda import no_host_sync
from tests.ops.test_routing_inputs import ref_route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _routing(form: str, tokens: int, k: int, num_experts: int, gen: torch.Generator
             ) -> torch.Tensor:
    if form == "map":
        return torch.rand(tokens, num_experts, generator=gen) < min(1.0, k / num_experts)
    routing = torch.randint(-1, num_experts, (tokens, k), generator=gen)
    return routing[:, 0] if form == "top1" else routing


def _run(x, routing, num_experts, multiple, probs, options, grad_perm, grad_probs, grad_out):
    """permute, unpermute and both backwards, with any host sync an error."""
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    with no_host_sync():
        x_perm, m_splits, row_map, permuted = permute(x, routing, num_experts, multiple,
                                                      probs=probs, **options)
        out = unpermute(x_perm * 2, row_map, probs)
        total = ((x_perm * grad_perm[:x_perm.shape[0]]).sum()
                 + (permuted * grad_probs[:x_perm.shape[0]]).sum() + (out * grad_out).sum())
        total.backward()
    torch.cuda.synchronize()
    return x_perm, m_splits, row_map, permuted, out, x.grad, probs.grad


CASES = [
    ("indices", 1, {}),
    ("map", 1, {}),
    ("map", 16, {}),
    ("top1", 4, {}),
    ("indices", 1, {"capacity": 5}),
    ("indices", 8, {"capacity": 1.25, "drop_policy": "position"}),
    ("indices", 4, {"capacity": 8, "pad_to_capacity": True}),
    ("map", 1, {"capacity": 6, "drop_policy": "position", "pad_to_capacity": True}),
    ("top1", 1, {"capacity": 0.5}),
    ("indices", 1, {"num_out_tokens": 40}),
    ("map", 1, {"num_out_tokens": 55, "capacity": 7}),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: Triton kernels
@pytest.mark.parametrize("num_experts", [6, 40])
@pytest.mark.parametrize("form, multiple, options", CASES)
def test_cuda_matches_reference_without_sync(form, multiple, options, num_experts, dtype):
    gen = torch.Generator().manual_seed(len(str(options)) + multiple)
    tokens, k = 37, 3
    routing = _routing(form, tokens, k, num_experts, gen)
    probs = torch.rand(routing.shape, generator=gen, dtype=dtype)
    probs[::5] = 0.5  # ties for the probability drop policy
    x = torch.randn(tokens, 8, generator=gen, dtype=dtype)
    slots = routing.numel()
    width = routing.shape[1] if routing.dim() == 2 else 1
    capacity = options.get("capacity")
    if isinstance(capacity, float):
        capacity = math.ceil(Fraction(capacity) * tokens * width / num_experts)
    pad = options.get("pad_to_capacity", False)
    want = ref_route(x, routing, num_experts, multiple, probs, capacity,
                     options.get("drop_policy", "probs"), options.get("num_out_tokens"), pad)
    rows = len(want.x_perm)
    bound = slots
    if capacity is not None:
        bound = min(bound, num_experts * capacity)
    if "num_out_tokens" in options:
        bound = min(bound, options["num_out_tokens"])
    bound = num_experts * capacity if pad else bound + num_experts * (multiple - 1)

    grad_perm = torch.randn(bound, 8, generator=gen, dtype=dtype)
    grad_probs = torch.randn(bound, generator=gen, dtype=dtype)
    grad_out = torch.randn(tokens, 8, generator=gen, dtype=dtype)
    got = _run(*(t.cuda() for t in (x, routing)), num_experts, multiple, probs.cuda(), options,
               grad_perm.cuda(), grad_probs.cuda(), grad_out.cuda())
    x_perm, m_splits, row_map, permuted, out, x_grad, probs_grad = (t.cpu() for t in got)
    assert x_perm.shape == (bound, 8) and permuted.shape == (bound,)
    assert m_splits.tolist() == want.m_splits and row_map.tolist() == want.row_map
    assert torch.equal(x_perm[:rows].double(), want.x_perm) and not x_perm[rows:].any()
    assert permuted[:rows].tolist() == want.row_probs and not permuted[rows:].any()

    # the same steps on CPU (checked against the reference by tests/ops) give the gradients
    x_cpu, p_cpu = x.clone().requires_grad_(), probs.clone().requires_grad_()
    c_perm, _, c_map, c_probs = permute(x_cpu, routing, num_experts, multiple, probs=p_cpu,
                                        **options)
    c_out = unpermute(c_perm * 2, c_map, p_cpu)
    cpu_rows = c_perm.shape[0]  # exact on CPU: sum(m_splits)
    ((c_perm * grad_perm[:cpu_rows]).sum() + (c_probs * grad_probs[:cpu_rows]).sum()
     + (c_out * grad_out).sum()).backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5  # float32: summation order may differ
    torch.testing.assert_close(out, c_out.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(x_grad, x_cpu.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(probs_grad, p_cpu.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dense_probs_without_sync(dtype):
    """unpermute gathers dense (T, E) probs at topk_indices on the device, as on CPU."""
    gen = torch.Generator().manual_seed(3)
    topk = torch.randint(-1, 8, (50, 2), generator=gen)
    dense = torch.rand(50, 8, generator=gen)
    x = torch.randn(50, 16, generator=gen).to(dtype)
    dense_cpu = dense.clone().requires_grad_()
    x_perm, _, row_map = permute(x, topk, 8)
    want = unpermute(x_perm, row_map, dense_cpu, topk_indices=topk)
    want.float().sum().backward()
    dense_dev = dense.cuda().requires_grad_()
    x_dev, topk_dev = x.cuda(), topk.cuda()  # the copies to the device synchronize
    with no_host_sync():
        d_perm, _, d_map = permute(x_dev, topk_dev, 8)
        out = unpermute(d_perm, d_map, dense_dev, topk_indices=topk_dev)
        out.float().sum().backward()
    torch.cuda.synchronize()
    tol = {} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}
    torch.testing.assert_close(out.cpu(), want.detach(), **tol)
    torch.testing.assert_close(dense_dev.grad.cpu(), dense_cpu.grad, rtol=1e-5, atol=1e-5)
    routed = torch.zeros(50, 9).scatter_(1, torch.where(topk >= 0, topk, 8), 1.0)[:, :8]
    assert not dense_dev.grad.cpu()[routed == 0].any()  # experts no slot named: no gradient
