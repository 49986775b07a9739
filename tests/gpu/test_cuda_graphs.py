"""A whole forward+backward step captured in a CUDA graph, replayed with new split values;
permute and unpermute replayed with new routings in every routing form."""

from collections.abc import Callable

import pytest
import torch

import grouped_linear as gl
from tests.ops.test_routing_inputs import ref_route
from tests.reference import reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

G, K, N, M = 6, 128, 256, 900
NEW_SPLITS = [[150] * 6, [0, 899, 0, 0, 1, 0], [13, 0, 401, 7, 0, 300], [0] * 6]


def _capture(step):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def check_layer_step_replays(layer, tolerance, refresh, forward_kwargs=None,
                             zeros_when_empty=False):
    """Capture one forward+backward of ``layer`` on CUDA splits, then replay it on each of
    ``NEW_SPLITS`` written into the same split tensor, with a new input and whatever
    ``refresh(layer, grad_out)`` changes in place, against float64 (``zeros_when_empty``:
    with no rows at all every result must be exactly zero)."""
    groups = layer.weight.shape[0]
    x = torch.randn(M, layer.in_features, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    grad_out = torch.randn(M, layer.out_features, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor([M // groups] * groups, device="cuda")

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x, splits, **(forward_kwargs or {}))
        y.backward(grad_out)
        return y

    graph, y = _capture(step)
    for sizes in NEW_SPLITS:
        splits.copy_(torch.tensor(sizes))
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            refresh(layer, grad_out)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_grads(x, layer.weight, layer.bias, sizes, grad_out)
        got = (y, x.grad, layer.weight.grad, layer.bias.grad)
        for name, a, b in zip(("y", "dx", "dW", "db"), got, ref):
            if zeros_when_empty and not sum(sizes):
                assert torch.all(a == 0), (sizes, name)
            else:
                assert rel_err(a, b) < tolerance, (sizes, name, rel_err(a, b))


@pytest.mark.parametrize("backend", ["grouped", "triton"])
def test_grouped_linear_step_in_cuda_graph(backend):
    layer = gl.GroupedLinear(G, K, N, params_dtype=torch.bfloat16, device="cuda", backend=backend)
    check_layer_step_replays(layer, 1e-2,
                             lambda _, grad_out: grad_out.copy_(torch.randn_like(grad_out)))


def test_grouped_mlp_step_in_cuda_graph():
    mlp = gl.GroupedMLP(G, K, 64, params_dtype=torch.bfloat16, device="cuda")
    eager = gl.GroupedMLP(G, K, 64, params_dtype=torch.bfloat16, device="cuda")
    eager.load_state_dict(mlp.state_dict())
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor([M // G] * G, device="cuda")

    def step():
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        y = mlp(x, splits)
        y.float().square().sum().backward()
        return y

    graph, y = _capture(step)
    for sizes in NEW_SPLITS:
        splits.copy_(torch.tensor(sizes))
        graph.replay()
        torch.cuda.synchronize()
        eager.zero_grad(set_to_none=True)
        x_ref = x.detach().clone().requires_grad_()
        y_ref = eager(x_ref, torch.tensor(sizes, device="cuda"))
        y_ref.float().square().sum().backward()
        assert torch.equal(y, y_ref), sizes
        assert torch.equal(x.grad, x_ref.grad), sizes
        for a, b in zip(mlp.parameters(), eager.parameters()):
            assert torch.equal(a.grad, b.grad), sizes


def test_permute_and_unpermute_in_cuda_graph():
    """Routing map, scatter (launched as a programmatic dependent on Hopper), weighted
    combine and their backward captured once, replayed on new routings written into the
    same index tensor: the same results as the eager calls."""
    tokens, k, experts, hidden = 600, 4, 8, 256
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    indices = torch.randn(tokens, experts, device="cuda").topk(k, dim=-1).indices
    probs = torch.rand(tokens, k, device="cuda")
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def step(inp):
        inp.grad = None
        x_perm, m_splits, row_map = gl.permute(inp, indices, experts, multiple=16)
        y = gl.unpermute(x_perm * 2, row_map, probs)
        y.backward(grad)
        return x_perm, m_splits, row_map, y, inp.grad

    graph, captured = _capture(lambda: step(x))
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        scores = torch.randn(tokens, experts, device="cuda", generator=generator)
        scores[: tokens // 2, 0] += 10  # a crowded expert
        indices.copy_(scores.topk(k, dim=-1).indices)
        if seed == 2:
            indices[::7, 1] = -1  # dropped slots
        probs.copy_(torch.rand(tokens, k, device="cuda", generator=generator))
        with torch.no_grad():
            x.copy_(torch.randn(tokens, hidden, device="cuda", generator=generator))
        graph.replay()
        torch.cuda.synchronize()
        eager = step(x.detach().clone().requires_grad_())
        for name, got, want in zip(("x_perm", "m_splits", "row_map", "y", "dx"), captured,
                                   eager):
            assert torch.equal(got, want), (seed, name)
        # and against float64: every kept slot carries its token's row, weighted by its prob
        kept = (indices >= 0).double()
        counts = torch.stack([(indices == e).sum() for e in range(experts)])
        assert torch.equal(captured[1].cpu(), ((counts + 15) // 16 * 16).cpu())
        row_map = captured[2]
        assert torch.equal(row_map >= 0, indices >= 0)
        held = row_map[indices >= 0]
        assert torch.equal(captured[0][held].double(),
                           x.double()[torch.nonzero(indices >= 0)[:, 0]])
        weight = (probs.double() * kept).sum(dim=1, keepdim=True)
        assert rel_err(captured[3], 2 * x.double() * weight) < 1e-2, seed
        assert rel_err(captured[4], 2 * grad.double() * weight) < 1e-2, seed


ROUTING_CASES = {  # form, multiple, permute's options
    "map": ("map", 1, {"num_out_tokens": 2400}),
    "map-capacity": ("map", 1, {"capacity": 256, "num_out_tokens": 2000}),
    "capacity": ("indices", 16, {"capacity": 256}),
    "capacity-position-padded": ("indices", 16, {"capacity": 320, "drop_policy": "position",
                                                 "pad_to_capacity": True}),
    "num_out_tokens": ("indices", 1, {"num_out_tokens": 1800}),
}


def new_routing(form: str, seed: int, tokens: int, k: int, experts: int, device: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k routing with a crowded expert (and dropped slots for seed 2): ``(T, k)``
    indices with ``(T, k)`` probs, or the same as a bool ``(T, E)`` map with dense probs."""
    generator = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(tokens, experts, device=device, generator=generator)
    scores[: tokens // 2, 0] += 10
    indices = scores.topk(k, dim=-1).indices
    if seed == 2:
        indices[::7, 1] = -1
    if form == "indices":
        return indices, torch.rand(tokens, k, device=device, generator=generator)
    # the dropped slots set a spare last column, cut off
    routing_map = torch.zeros(tokens, experts + 1, dtype=torch.bool, device=device).scatter_(
        1, torch.where(indices >= 0, indices, experts), True)[:, :experts].contiguous()
    return routing_map, torch.rand(tokens, experts, device=device, generator=generator)


def check_routing_replays(case: str, device: str = "cuda", capture: Callable = _capture
                          ) -> None:
    """``case`` of :data:`ROUTING_CASES`: permute, a scaling, unpermute and their backward
    (through the permuted probabilities too) captured once, replayed on new routings and
    probabilities written into the captured tensors: the eager call's results on the same
    inputs, and the layout of the loop reference. (``device`` and ``capture`` let the same
    checks run without a GPU, with a capture whose replay reruns the step.)"""
    form, multiple, options = ROUTING_CASES[case]
    tokens, k, experts, hidden = 600, 4, 8, 256
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    routing, probs = new_routing(form, 0, tokens, k, experts, device)
    probs.requires_grad_()
    grad = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)

    def step(inp, p):
        inp.grad = p.grad = None
        x_perm, m_splits, row_map, permuted = gl.permute(inp, routing, experts, multiple,
                                                         probs=p, **options)
        y = gl.unpermute(x_perm * 2, row_map, p)
        torch.autograd.backward([y, permuted], [grad, torch.ones_like(permuted)])
        return x_perm, m_splits, row_map, permuted, y, inp.grad, p.grad

    graph, captured = capture(lambda: step(x, probs))
    for seed in range(1, 4):
        new, new_probs = new_routing(form, seed, tokens, k, experts, device)
        with torch.no_grad():
            routing.copy_(new)
            probs.copy_(new_probs)
            x.copy_(torch.randn(tokens, hidden, device=device,
                                generator=torch.Generator(device=device).manual_seed(seed)))
        graph.replay()
        if device == "cuda":
            torch.cuda.synchronize()
        eager = step(x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_())
        names = ("x_perm", "m_splits", "row_map", "permuted_probs", "y", "dx", "dprobs")
        for name, got, want in zip(names, captured, eager, strict=True):
            assert torch.equal(got, want), (case, seed, name)
        want = ref_route(x.detach().cpu(), routing.cpu(), experts, multiple,
                         probs.detach().cpu(), options.get("capacity"),
                         options.get("drop_policy", "probs"), options.get("num_out_tokens"),
                         options.get("pad_to_capacity", False))
        rows = sum(want.m_splits)
        assert captured[1].tolist() == want.m_splits, (case, seed)
        assert captured[2].tolist() == want.row_map, (case, seed)
        assert torch.equal(captured[0][:rows].cpu().double(), want.x_perm), (case, seed)
        assert not captured[0][rows:].any(), (case, seed)
        assert captured[3][:rows].double().tolist() == want.row_probs, (case, seed)


@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_routing_forms_in_cuda_graph(case):
    """A bool routing map, a capacity (by probability; by position with padded groups) and
    num_out_tokens: each replays new routings written into the captured tensors."""
    check_routing_replays(case)
