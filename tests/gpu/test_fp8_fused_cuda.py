"""The ``fp8_fused`` route on CUDA, as the default rule picks it for small calls: each
recipe against float64 with CUDA splits (rows past them zero), no host sync, up to the
kernels' 4095 groups, a step captured in a CUDA graph and replayed on new splits, and the
route's three launches."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels.gemm import fp8_fused_gemm
from grouped_linear.ops.dispatch import TORCH_GROUPED_MAX_GROUPS, fp8_route
from tests.gpu.test_cuda_graphs import check_layer_step_replays
from tests.gpu.test_grouped_linear_cuda import _spread, no_host_sync
from tests.ops.test_fp8_fused import count_fused_calls
from tests.reference import gathered_reference, reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fp8_fused,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Blockwise(),
           gl.recipes.Float8Tensorwise(), gl.recipes.Float8Rowwise(fp8_format="hybrid"),
           gl.recipes.Float8Blockwise(power_of_two_scales=True)]
IDS = ["rowwise", "blockwise", "tensorwise", "rowwise-hybrid", "blockwise-pow2"]
SIZES = [37, 0, 130, 3, 64]
G, K, N, TAIL = len(SIZES), 320, 200, 6


@pytest.fixture
def counted(monkeypatch):
    return count_fused_calls(monkeypatch)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_small_calls_take_the_route_and_match_float64(recipe, counted):
    torch.manual_seed(0)
    rows = sum(SIZES) + TAIL
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, N, K, device="cuda") / K ** 0.5).bfloat16().requires_grad_()
    b = torch.randn(G, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(SIZES, device="cuda")
    with no_host_sync():
        y = gl.grouped_linear(x, w, b, splits, recipe=recipe)
        y.backward(grad)
    assert counted == [1]
    ref = reference_grads(x, w, b, SIZES, grad)
    for name, got, want in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 6e-2, (name, rel_err(got, want))
    assert torch.all(y[sum(SIZES):] == 0) and torch.all(x.grad[sum(SIZES):] == 0)
    assert torch.all(w.grad[1] == 0)


@pytest.mark.parametrize("groups", [TORCH_GROUPED_MAX_GROUPS + 2, fp8_fused_gemm.MAX_GROUPS])
@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
def test_fine_grained_calls_take_the_route_and_match_float64(recipe, groups, counted):
    """1025 groups (past torch's grouped GEMMs) and 4095 (the fused kernels' most, a group
    table of 4096 slots), few rows: the default rule's route, no host sync, within the
    recipe's tolerance of float64, rows past the splits zero, every empty group's weight
    and bias gradients exactly zero."""
    Kc, Nc, rows, tail = 128, 64, 2000, 5
    sizes = [0] * groups  # every other group empty
    sizes[1::2] = _spread(rows, groups // 2)
    assert fp8_route(recipe, torch.device("cuda"), torch.bfloat16, Kc, Nc, groups,
                     rows + tail) == "fp8_fused"
    x = torch.randn(rows + tail, Kc, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(groups, Nc, Kc, device="cuda") / Kc ** 0.5).bfloat16().requires_grad_()
    b = torch.randn(groups, Nc, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows + tail, Nc, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(sizes, device="cuda")
    with no_host_sync():
        y = gl.grouped_linear(x, w, b, splits, recipe=recipe)
        y.backward(grad)
    assert counted == [1]
    ref = gathered_reference(x[:rows], w, b, sizes, grad[:rows])
    for name, got, want in zip(("y", "dx", "dW", "db"),
                               (y[:rows], x.grad[:rows], w.grad, b.grad), ref):
        assert rel_err(got, want) < 6e-2, (name, rel_err(got, want))
    assert torch.all(y[rows:] == 0) and torch.all(x.grad[rows:] == 0)
    empty = splits == 0
    assert int(empty.sum()) >= groups // 2
    assert torch.all(w.grad[empty] == 0) and torch.all(b.grad[empty] == 0)


@pytest.mark.parametrize("recipe", RECIPES[:3], ids=IDS[:3])
def test_step_in_a_cuda_graph(recipe, counted):
    layer = gl.GroupedLinear(6, K, N, params_dtype=torch.bfloat16, device="cuda",
                             recipe=recipe)
    check_layer_step_replays(layer, 6e-2, lambda lay, _: lay.weight.mul_(1.1),
                             forward_kwargs={"is_first_microbatch": True},
                             zeros_when_empty=True)
    assert counted


def test_three_launches_per_step(counted):
    """Forward, dgrad and weight gradient: one kernel each, the weight quantized by the
    module's cache beforehand."""
    layer = gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device="cuda",
                             recipe=gl.recipes.Float8Rowwise())
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(SIZES, device="cuda")
    layer(x, splits, is_first_microbatch=True).float().sum().backward()  # compile, cache
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layer(x, splits, is_first_microbatch=False).float().sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fused = [n for n in names if n.startswith(("_forward_kernel", "_dgrad_kernel",
                                               "_wgrad_kernel"))]
    assert sorted(fused) == ["_dgrad_kernel", "_forward_kernel", "_wgrad_kernel"], names
