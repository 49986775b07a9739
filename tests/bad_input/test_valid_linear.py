"""Valid but unusual calls of the layers (no rows, empty groups, one group, one column, narrow
split dtypes), against the float64 loop reference."""

from __future__ import annotations

import pytest
import torch

import grouped_linear as gl
from tests.bad_input import reference
from tests.bad_input.checks import count

F64 = torch.float64
# name: (in_features, out_features, sizes)
SHAPES: dict[str, tuple[int, int, list[int]]] = {
    "no rows": (4, 5, [0, 0, 0]),
    "empty groups": (4, 4, [0, 3, 0, 2]),
    "one group": (4, 8, [5]),
    "one column": (1, 1, [2, 0, 3]),
    "one row": (4, 4, [0, 1]),
}
SPLIT_KINDS = ("list", "tuple", "int64", "int32", "int16", "int8", "uint8", "list x")
# backend: (dtype, tolerance)
BACKENDS = {"loop": (F64, 1e-10), "triton": (torch.float32, 1e-5),
            "grouped": (torch.float32, 1e-5)}


def _splits(sizes: list[int], kind: str) -> object:
    if kind in ("list", "list x"):
        return list(sizes)
    if kind == "tuple":
        return tuple(sizes)
    return torch.tensor(sizes, dtype=getattr(torch, kind))


def _check_layer(backend: str, shape: str, kind: str, bias: bool = True) -> None:
    count("valid")
    dtype, tol = BACKENDS[backend]
    k, n, sizes = SHAPES[shape]
    layer = gl.GroupedLinear(len(sizes), k, n, bias=bias, params_dtype=dtype, backend=backend)
    x = torch.randn(sum(sizes), k, dtype=dtype, requires_grad=True)
    grad = torch.randn(sum(sizes), n, dtype=dtype)
    if kind == "list x":
        y = layer(list(x.split(sizes)))
    else:
        y = layer(x, _splits(sizes, kind))
    y.backward(grad)

    x_ref = x.detach().double().requires_grad_()
    w_ref = layer.weight.detach().double().requires_grad_()
    b_ref = layer.bias.detach().double().requires_grad_() if bias else None
    y_ref = reference.linear(x_ref, w_ref, b_ref, sizes)
    y_ref.backward(grad.double())
    close = {"rtol": tol, "atol": tol, "check_dtype": False}
    torch.testing.assert_close(y, y_ref, **close)
    torch.testing.assert_close(x.grad, x_ref.grad, **close)
    torch.testing.assert_close(layer.weight.grad, w_ref.grad, **close)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b_ref.grad, **close)


@pytest.mark.parametrize("kind", SPLIT_KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_unusual_calls_match_the_reference(shape: str, kind: str) -> None:
    _check_layer("loop", shape, kind)


@pytest.mark.parametrize("shape", SHAPES)
def test_unusual_calls_on_triton_match_the_reference(shape: str) -> None:
    _check_layer("triton", shape, "int32", bias=shape != "one row")


@pytest.mark.parametrize("shape", [s for s, (k, n, _) in SHAPES.items() if k % 4 == n % 4 == 0])
def test_unusual_calls_on_grouped_match_the_reference(shape: str) -> None:
    _check_layer("grouped", shape, "list")


@pytest.mark.parametrize("single", [True, False], ids=["single weight", "per-expert weights"])
def test_delayed_and_fused_empty_groups_match_the_reference(single: bool) -> None:
    """``main_grad`` gets exactly the reference weight gradient (zero for the empty groups),
    ``.grad`` the bias gradient, at ``backward_dw``."""
    count("valid")
    k, n, sizes = SHAPES["empty groups"]
    layer = gl.GroupedLinear(len(sizes), k, n, params_dtype=F64, single_grouped_weight=single,
                             single_grouped_bias=single, delay_wgrad_compute=True,
                             fuse_wgrad_accumulation=True)
    weights = [p for name, p in layer.named_parameters() if name.startswith("weight")]
    biases = [p for name, p in layer.named_parameters() if name.startswith("bias")]
    starts = [torch.randn_like(w) for w in weights]
    for weight, start in zip(weights, starts):
        weight.main_grad = start.clone()
    x = torch.randn(sum(sizes), k, dtype=F64, requires_grad=True)
    grad = torch.randn(sum(sizes), n, dtype=F64)
    layer(x, sizes).backward(grad)
    assert all(w.main_grad.equal(s) for w, s in zip(weights, starts)), "before backward_dw"
    layer.backward_dw()

    w_ref = layer.grouped_weight().detach().clone().requires_grad_()
    b_ref = layer.grouped_bias().detach().clone().requires_grad_()
    reference.linear(x.detach(), w_ref, b_ref, sizes).backward(grad)
    added = torch.stack([w.main_grad - s for w, s in zip(weights, starts)]).view_as(w_ref)
    torch.testing.assert_close(added, w_ref.grad)
    torch.testing.assert_close(torch.stack([b.grad for b in biases]).view_as(b_ref), b_ref.grad)
    assert all(w.grad is None for w in weights)


@pytest.mark.parametrize("recipe", [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
                                    gl.recipes.Float8Blockwise()], ids=lambda r: type(r).__name__)
def test_fp8_call_without_rows_matches_the_reference(recipe: object) -> None:
    """No rows: an empty output and zero weight and bias gradients, as in float64."""
    count("valid")
    layer = gl.GroupedLinear(3, 4, 5, recipe=recipe)
    x = torch.randn(0, 4, requires_grad=True)
    y = layer(x, [0, 0, 0], is_first_microbatch=True)
    y.backward(torch.randn(0, 5))
    w_ref = layer.weight.detach().double().requires_grad_()
    b_ref = layer.bias.detach().double().requires_grad_()
    reference.linear(x.detach(), w_ref, b_ref, [0, 0, 0]).backward(torch.zeros(0, 5, dtype=F64))
    assert y.shape == (0, 5) and x.grad.shape == (0, 4)
    torch.testing.assert_close(layer.weight.grad, w_ref.grad, check_dtype=False)
    torch.testing.assert_close(layer.bias.grad, b_ref.grad, check_dtype=False)


@pytest.mark.parametrize("shape", ["no rows", "empty groups", "one group"])
def test_grouped_mlp_unusual_calls_match_the_reference(shape: str) -> None:
    count("valid")
    hidden, _, sizes = SHAPES[shape]
    mlp = gl.GroupedMLP(len(sizes), hidden, 3, params_dtype=F64)
    x = torch.randn(sum(sizes), hidden, dtype=F64, requires_grad=True)
    grad = torch.randn(sum(sizes), hidden, dtype=F64)
    y = mlp(x, sizes)
    y.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    fc1 = (mlp.fc1.weight.detach(), mlp.fc1.bias.detach())
    fc2 = (mlp.fc2.weight.detach(), mlp.fc2.bias.detach())
    y_ref = reference.mlp(x_ref, sizes, fc1, fc2)
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("tokens", [0, 1, 3])
def test_moe_single_process_matches_the_reference(tokens: int) -> None:
    count("valid")
    moe = gl.ExpertParallelMoE(4, 3, 4, 2, params_dtype=F64)
    x = torch.randn(tokens, 4, dtype=F64)
    mlp = moe.experts
    y_ref = reference.moe(x, moe.router.weight.detach(), 2,
                          (mlp.fc1.weight.detach(), mlp.fc1.bias.detach()),
                          (mlp.fc2.weight.detach(), mlp.fc2.bias.detach()))
    torch.testing.assert_close(moe(x), y_ref)
