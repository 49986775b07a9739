"""torch.compile(fullgraph=True) and activation checkpointing around the layers (CPU)."""

import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import grouped_linear as gl


def _grads(module, x):
    return [x.grad] + [p.grad for p in module.parameters()]


def _eager_vs_compiled(module, sizes_list):
    compiled = torch.compile(lambda x, s: module(x, s), fullgraph=True)
    for i, sizes in enumerate(sizes_list):
        x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
        splits = torch.tensor(sizes)
        module.zero_grad(set_to_none=True)
        # New split values must reuse the graph compiled on the first call.
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            y = compiled(x, splits)
        (y * y).sum().backward()
        got = [y.detach()] + _grads(module, x)
        x_ref = x.detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        y_ref = module(x_ref, sizes)
        (y_ref * y_ref).sum().backward()
        want = [y_ref.detach()] + _grads(module, x_ref)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_compiled_grouped_linear_matches_eager_without_recompiling():
    torch._dynamo.reset()
    layer = gl.GroupedLinear(3, 16, 8, params_dtype=torch.float64)
    _eager_vs_compiled(layer, [[4, 0, 8], [1, 10, 1], [0, 0, 12]])


def test_compiled_grouped_mlp_matches_eager_without_recompiling():
    torch._dynamo.reset()
    mlp = gl.GroupedMLP(3, 16, 8, params_dtype=torch.float64)
    _eager_vs_compiled(mlp, [[4, 0, 8], [6, 6, 0]])


def test_activation_checkpointing():
    mlp = gl.GroupedMLP(3, 16, 8, params_dtype=torch.float64)
    x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
    y = checkpoint(mlp, x, [4, 0, 8], use_reentrant=False)
    y.sum().backward()
    got = _grads(mlp, x)
    x_ref = x.detach().clone().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    mlp(x_ref, [4, 0, 8]).sum().backward()
    for a, b in zip(got, _grads(mlp, x_ref)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("recipe", [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
                                    gl.recipes.Float8Blockwise()], ids=lambda r: type(r).__name__)
def test_activation_checkpointing_inside_autocast_recomputes_with_its_recipe(recipe):
    """With ``context_fn=gl.checkpoint_context`` the recomputation in backward (outside the
    ``gl.autocast`` region) runs the region's recipe: every gradient equals the unchecked
    step's bit for bit; without it, the recomputed forward runs without the recipe and the
    gradients differ (what the context is for)."""
    torch.manual_seed(0)
    mlp = gl.GroupedMLP(2, 32, 16)
    x, grad = torch.randn(12, 32), torch.randn(12, 32)

    def grads(checkpointed: bool, **checkpoint_args):
        mlp.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with gl.autocast(recipe):
            y = (checkpoint(mlp, leaf, [5, 7], use_reentrant=False, **checkpoint_args)
                 if checkpointed else mlp(leaf, [5, 7]))
        y.backward(grad)
        return _grads(mlp, leaf)

    plain = grads(False)
    for a, b in zip(grads(True, context_fn=gl.checkpoint_context), plain, strict=True):
        assert torch.equal(a, b)
    assert gl.recipes.current_recipe() is None
    assert not all(torch.equal(a, b) for a, b in zip(grads(True), plain, strict=True))


def test_compiled_with_host_list_splits_and_list_input():
    """Python-list splits and a list input compile with fullgraph (the split values are
    constants of the graph, so new values compile again) and match eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    for module in (gl.GroupedLinear(2, 16, 8, params_dtype=torch.float64),
                   gl.GroupedMLP(2, 16, 8, params_dtype=torch.float64)):
        compiled = torch.compile(module, fullgraph=True)
        x = torch.randn(5, 16, dtype=torch.float64)
        want = module(x, [2, 3])
        torch.testing.assert_close(compiled(x, [2, 3]), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(compiled([x[:2], x[2:]]), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(compiled([x[:2], x[2:]], torch.tensor([2, 3])), want,
                                   rtol=1e-12, atol=1e-12)  # a split tensor: not read


@pytest.mark.parametrize("delay, fuse", [(True, False), (False, True), (True, True)])
def test_compiled_per_expert_weights_with_a_gradient_sink_match_eager(delay, fuse):
    """Per-expert weights with ``delay_wgrad_compute`` / ``fuse_wgrad_accumulation`` under
    torch.compile: ``.grad`` stays ``None`` where eager leaves it so (an optimizer would
    otherwise step on zero gradients), ``main_grad`` and the delayed gradients as eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = gl.GroupedLinear(3, 16, 8, params_dtype=torch.float64, single_grouped_weight=False,
                             delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    compiled_layer = gl.GroupedLinear(3, 16, 8, params_dtype=torch.float64,
                                      single_grouped_weight=False,
                                      delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    compiled_layer.load_state_dict(eager.state_dict())
    x = torch.randn(12, 16, dtype=torch.float64)
    results = []
    for layer, run in ((eager, eager), (compiled_layer, torch.compile(compiled_layer))):
        for w in layer.weight_list():
            w.main_grad = torch.zeros_like(w)
        run(x, [4, 0, 8]).pow(2).sum().backward()
        before = [p.grad is None for p in layer.parameters()]
        layer.backward_dw()
        results.append((before, [None if p.grad is None else p.grad.clone()
                                 for p in layer.parameters()],
                        [w.main_grad.clone() for w in layer.weight_list()]))
    (before_e, grads_e, main_e), (before_c, grads_c, main_c) = results
    assert before_c == before_e
    assert [g is None for g in grads_c] == [g is None for g in grads_e]
    for a, b in zip(grads_c + main_c, grads_e + main_e):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
