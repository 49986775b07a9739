"""The whole MoE block (``permute`` -> ``GroupedMLP`` -> ``unpermute``) under each FP8 recipe
on CUDA, ``permute`` given the recipe too: no host sync with device routing, and one
forward+backward captured in a CUDA graph replayed on new routings written into the same
index tensor (the same results as eager calls on those routings). The numerics against
float64 are ``tests/ops/test_moe_block_fp8.py``."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear import _tuning
from grouped_linear.ops.fp8 import scaled_mm
from tests.gpu.test_cuda_graphs import _capture
from tests.gpu.test_grouped_linear_cuda import no_host_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]
E, H, FFN, TOKENS, K = 8, 256, 128, 512, 2


class _Block:
    """Module, inputs and a step that reads them, all on CUDA."""

    def __init__(self, recipe, fp8_rows: bool = True):
        torch.manual_seed(0)
        self.recipe = recipe
        self.rows_recipe = recipe if fp8_rows else None
        self.mlp = gl.GroupedMLP(E, H, FFN, activation="swiglu", bias=False,
                                 params_dtype=torch.bfloat16, device="cuda")
        self.x = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16,
                             requires_grad=True)
        self.indices = torch.randn(TOKENS, E, device="cuda").topk(K, dim=-1).indices
        self.probs = torch.rand(TOKENS, K, device="cuda", requires_grad=True)
        self.grad = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16)

    def step(self, x=None, probs=None):
        x = self.x if x is None else x
        probs = self.probs if probs is None else probs
        self.mlp.zero_grad(set_to_none=True)
        x.grad = probs.grad = None
        with gl.autocast(self.recipe):
            # given the recipe: Float8Rowwise's rows permuted as FP8 codes on the GEMM route
            rows, m_splits, row_map = gl.permute(x, self.indices, E, recipe=self.rows_recipe)
            out = gl.unpermute(self.mlp(rows, m_splits), row_map, probs)
        out.backward(self.grad)
        return (out, x.grad, probs.grad, self.mlp.fc1.weight.grad, self.mlp.fc2.weight.grad)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_block_runs_without_a_host_sync(recipe):
    block = _Block(recipe)
    block.step()  # compiles and fills what the first call fills
    with no_host_sync():
        results = block.step()
    for tensor in results:
        assert torch.isfinite(tensor).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_block_in_a_cuda_graph_replays_new_routings(recipe):
    _replays_new_routings(_Block(recipe))


def _replays_new_routings(block: _Block) -> None:
    """Capture ``block``'s step, replay it on new routings (a crowded expert, an empty one,
    dropped slots) and new tokens: the results of eager steps, bit for bit."""
    graph, captured = _capture(block.step)
    names = ("out", "dx", "dprobs", "dW1", "dW2")
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        scores = torch.randn(TOKENS, E, device="cuda", generator=generator)
        scores[: TOKENS // 2, 0] += 10  # a crowded expert
        if seed == 1:
            scores[:, 3] -= 100  # an empty one
        block.indices.copy_(scores.topk(K, dim=-1).indices)
        if seed == 2:
            block.indices[::5, 1] = -1  # dropped slots
        with torch.no_grad():
            block.x.copy_(torch.randn(TOKENS, H, device="cuda", generator=generator))
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in captured]
        eager = block.step(block.x.detach().clone().requires_grad_(),
                           block.probs.detach().clone().requires_grad_())
        for name, a, b in zip(names, got, eager):
            assert torch.equal(a, b), (seed, name)
        if seed == 1:
            assert torch.all(got[3][3] == 0) and torch.all(got[4][3] == 0)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_block_recomputing_the_activation_keeps_no_copy_of_fc2_input(recipe):
    """With ``recompute_activation`` the device route keeps nothing of fc2's input (its FP8
    codes were ``TOKENS * K * FFN`` bytes at least) and gives the results of a block whose
    fc2 keeps its input as given (``save_original_input``), bit for bit."""
    results, held = [], []
    for recompute in (False, True):
        block = _Block(recipe)
        block.mlp.recompute_activation = recompute
        block.mlp.fc2.save_original_input = True
        block.step()  # compiles; the weights' lazily made state
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with gl.autocast(recipe):
            rows, m_splits, row_map = gl.permute(block.x, block.indices, E)
            out = gl.unpermute(block.mlp(rows, m_splits), row_map, block.probs)
        del rows
        held.append(torch.cuda.memory_allocated() - before)
        block.mlp.zero_grad(set_to_none=True)
        block.x.grad = block.probs.grad = None
        out.backward(block.grad)
        results.append((out, block.x.grad, block.probs.grad, block.mlp.fc1.weight.grad,
                        block.mlp.fc2.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # fc2's input as given (bf16) was kept without recompute: 2 bytes per element
    assert held[0] - held[1] >= TOKENS * K * FFN * 2, held


def test_rowwise_block_on_the_gemm_route_reads_fp8_rows(monkeypatch):
    """On the ``fp8_scaled_mm`` route (the fused route's threshold set to 0), rows permuted in
    FP8 and fc2's input written in FP8 by the activation: nothing quantizes the layers' inputs
    again, the results equal, bit for bit, the block whose layers quantize bf16 inputs, no
    host sync, and a CUDA graph of the step replays new routings as eager steps."""
    rowwise = gl.recipes.Float8Rowwise()
    calls = []
    quantize = scaled_mm._quantize_tokens
    monkeypatch.setattr(scaled_mm, "_quantize_tokens",
                        lambda t, *args: calls.append(t.shape[1]) or quantize(t, *args))
    with _tuning.override(fp8_fused_max_work=0):
        fused = _Block(rowwise)
        fused.step()
        calls.clear()
        with no_host_sync():
            got = fused.step()
        assert calls == []
        monkeypatch.setattr(gl.GroupedLinear, "reads_fp8_rows", lambda *args: None)
        plain = _Block(rowwise, fp8_rows=False)
        want = plain.step()
        assert sorted(calls) == [FFN, H]
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        monkeypatch.undo()
        _replays_new_routings(_Block(rowwise))
