"""GroupedMLP with routing probabilities (``probs``, ``probs_on``) and N-D input (CPU)."""

import pytest
import torch

import grouped_linear as gl
from tests.bad_input.checks import expect_rejected
from tests.bad_input.layers import SIZES as BAD_SIZES
from tests.bad_input.layers import K, M, make_mlp, rows
from tests.kernels.test_activation import CASES
from tests.ops.test_mlp import reference
from tests.reference import rel_err

SIZES = [5, 0, 9, 2]
H, F = 8, 6


def _float64_reference(mlp, x, probs, kind, interleaved=False):
    """The unfused float64 computation on the module's own parameters, with autograd."""
    params = [mlp.fc1.grouped_weight(), mlp.fc1.grouped_bias(), mlp.fc2.grouped_weight(),
              mlp.fc2.grouped_bias()]
    params = [p.detach().double() if p is not None else None for p in params]
    return reference(x, *params, SIZES, kind, interleaved, probs=probs, probs_on=mlp.probs_on)


@pytest.mark.parametrize("probs_on", ["activation", "input"])
@pytest.mark.parametrize("activation, interleaved", CASES)
def test_probs_match_float64(activation, interleaved, probs_on):
    """float32 parameters (the fused kernel runs) against the unfused float64 computation:
    output and the gradients of the input and of the probabilities."""
    torch.manual_seed(0)
    order = "interleaved" if interleaved else "concatenated"
    mlp = gl.GroupedMLP(4, H, F, activation=activation, gate_up_order=order,
                        probs_on=probs_on)
    x = torch.randn(sum(SIZES), H, requires_grad=True)
    probs = torch.rand(sum(SIZES), requires_grad=True)
    y = mlp(x, SIZES, probs)
    x64 = x.detach().double().requires_grad_()
    p64 = probs.detach().double().requires_grad_()
    want = _float64_reference(mlp, x64, p64, activation, interleaved)
    assert rel_err(y, want) < 1e-5
    grad = torch.randn(y.shape, dtype=torch.float64)
    y.backward(grad.float())
    want.backward(grad)
    assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(probs.grad, p64.grad) < 1e-5


@pytest.mark.parametrize("probs_on", ["activation", "input"])
def test_module_is_grouped_mlp_on_its_layers(probs_on):
    mlp = gl.GroupedMLP(4, H, F, activation="gpt_oss_swiglu", gate_up_order="interleaved",
                        limit=0.5, probs_on=probs_on)
    assert mlp.probs_on == probs_on
    assert ("probs_on='input'" in repr(mlp)) == (probs_on == "input")
    x = torch.randn(sum(SIZES), H) * 3
    probs = torch.rand(sum(SIZES))
    want = gl.grouped_mlp(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, SIZES,
                          activation="gpt_oss_swiglu", gate_up_order="interleaved", limit=0.5,
                          probs=probs, probs_on=probs_on)
    torch.testing.assert_close(mlp(x, SIZES, probs=probs), want, rtol=0, atol=0)


def _step(mlp, x, probs, grad):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    y = mlp(x, SIZES, probs)
    y.backward(grad)
    if mlp.fc1.delay_wgrad_compute:
        mlp.backward_dw()
    return y, x.grad, probs.grad


@pytest.mark.parametrize("probs_on", ["activation", "input"])
@pytest.mark.parametrize("variant", ["recompute_activation", "delay_wgrad_compute"])
def test_recompute_and_delayed_wgrad_with_probs(variant, probs_on):
    """With probs, recomputing the activation and delaying the weight gradients (fc1 then
    adds its own bias) give the plain module's output and gradients."""
    torch.manual_seed(1)
    kwargs = {"params_dtype": torch.float64, "probs_on": probs_on}
    plain = gl.GroupedMLP(4, H, F, **kwargs)
    other = gl.GroupedMLP(4, H, F, **kwargs, **{variant: True})
    other.load_state_dict(plain.state_dict())
    x = torch.randn(sum(SIZES), H, dtype=torch.float64)
    probs = torch.rand(sum(SIZES), dtype=torch.float64)
    grad = torch.randn(sum(SIZES), H, dtype=torch.float64)
    for got, want in zip(_step(other, x, probs, grad), _step(plain, x, probs, grad),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(plain.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_nd_input_is_the_flattened_call():
    torch.manual_seed(2)
    mlp = gl.GroupedMLP(4, H, F, params_dtype=torch.float64)
    x = torch.randn(4, 4, H, dtype=torch.float64)
    probs = torch.rand(4, 4, dtype=torch.float64)
    flat = mlp(x.reshape(16, H), SIZES, probs.reshape(16))
    for given in (probs, probs.reshape(16)):
        y = mlp(x, SIZES, given)
        assert y.shape == (4, 4, H)
        torch.testing.assert_close(y.reshape(16, H), flat, rtol=0, atol=0)
    torch.testing.assert_close(mlp(x, SIZES).reshape(16, H), mlp(x.reshape(16, H), SIZES),
                               rtol=0, atol=0)


def test_probs_on_constructor_check():
    for bad in ("output", None, 1):
        with pytest.raises(ValueError, match=f"probs_on={bad!r}"):
            gl.GroupedMLP(4, H, F, probs_on=bad)


@pytest.mark.parametrize("kind, probs, names", [
    ("type", lambda: [0.5] * M, "probs"),
    ("dtype", lambda: torch.ones(M, dtype=torch.int32), "probs"),
    ("dtype", lambda: torch.ones(M, dtype=torch.bool), "probs"),
    ("device", lambda: torch.ones(M, device="meta"), "probs"),
    ("shape", lambda: torch.ones(M + 1), "probs"),
    ("shape", lambda: torch.ones(1, M), "probs"),
    ("shape", lambda: torch.ones(()), "probs"),
])
def test_rejected_probs_change_nothing(kind, probs, names):
    """A rejected call leaves parameters, gradients and the delayed-gradient queues as
    they were."""
    mlp = make_mlp()
    expect_rejected(kind, lambda: mlp(rows().requires_grad_(), BAD_SIZES, probs(),
                                      is_first_microbatch=True), names, state=mlp)


def test_rejected_probs_on_and_nd_input_change_nothing():
    mlp = make_mlp()
    mlp.probs_on = "weights"  # the attribute is checked on every call
    expect_rejected("range", lambda: mlp(rows(), BAD_SIZES, torch.ones(M)), "probs_on",
                    state=mlp)
    mlp = make_mlp()
    expect_rejected("shape", lambda: mlp(torch.randn(2, M, K + 1), BAD_SIZES), "x", state=mlp)
