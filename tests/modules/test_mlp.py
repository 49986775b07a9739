"""GroupedMLP against a float64 per-expert reference (CPU)."""

import pytest
import torch

import grouped_linear as gl
from tests.kernels.test_activation import CASES, GATED
from tests.ops.test_mlp import reference
from tests.reference import rel_err

SIZES = [5, 0, 9, 2]


def _reference(x, mlp, activation, interleaved=False, **params):
    params = {**{name: value for name, value in (("alpha", mlp.alpha), ("limit", mlp.limit))
                 if value is not None}, **params}
    w1, b1 = mlp.fc1.grouped_weight().double(), mlp.fc1.grouped_bias()
    w2, b2 = mlp.fc2.grouped_weight().double(), mlp.fc2.grouped_bias()
    b1 = b1.double() if b1 is not None else None
    b2 = b2.double() if b2 is not None else None
    return reference(x.double(), w1, b1, w2, b2, SIZES, activation, interleaved, **params)


@pytest.mark.parametrize("activation, interleaved", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_reference(activation, interleaved, bias):
    order = "interleaved" if interleaved else "concatenated"
    mlp = gl.GroupedMLP(4, 8, 6, activation=activation, bias=bias, params_dtype=torch.float64,
                        gate_up_order=order)
    gated = activation in GATED
    assert mlp.fc1.weight.shape == (4, 12 if gated else 6, 8)
    assert mlp.fc2.weight.shape == (4, 8, 6)
    x = torch.randn(sum(SIZES), 8, dtype=torch.float64, requires_grad=True)
    y = mlp(x, SIZES)
    x_ref = x.detach().clone().requires_grad_()
    ref = _reference(x_ref, mlp, activation, interleaved)
    assert rel_err(y, ref) < 1e-12
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert rel_err(x.grad, x_ref.grad) < 1e-12


def test_mlp_is_grouped_mlp_on_its_layers():
    mlp = gl.GroupedMLP(4, 8, 6, activation="gpt_oss_swiglu", gate_up_order="interleaved",
                        alpha=1.2, limit=0.5)
    assert (mlp.alpha, mlp.limit, mlp.gate_up_order) == (1.2, 0.5, "interleaved")
    assert "gate_up_order='interleaved', alpha=1.2, limit=0.5" in repr(mlp)
    x = torch.randn(sum(SIZES), 8) * 3
    want = gl.grouped_mlp(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, SIZES,
                          activation="gpt_oss_swiglu", gate_up_order="interleaved", alpha=1.2,
                          limit=0.5)
    torch.testing.assert_close(mlp(x, SIZES), want, rtol=0, atol=0)
    assert rel_err(want, _reference(x, mlp, "gpt_oss_swiglu", True, alpha=1.2,
                                    limit=0.5)) < 1e-5


def test_clamped_swiglu_and_squared_relu_modules():
    mlp = gl.GroupedMLP(4, 8, 6, activation="clamped_swiglu", limit=0.5)
    assert (mlp.alpha, mlp.limit) == (None, 0.5) and "limit=0.5" in repr(mlp)
    assert gl.GroupedMLP(4, 8, 6, activation="clamped_swiglu").limit == 10.0
    x = torch.randn(sum(SIZES), 8) * 3
    want = gl.grouped_mlp(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, SIZES,
                          activation="clamped_swiglu", limit=0.5)
    torch.testing.assert_close(mlp(x, SIZES), want, rtol=0, atol=0)
    assert rel_err(want, _reference(x, mlp, "clamped_swiglu")) < 1e-5
    unclamped = _reference(x, mlp, "clamped_swiglu", limit=float("inf"))
    assert rel_err(want, unclamped) > 1e-2  # the limit binds on these values
    relu2 = gl.GroupedMLP(4, 8, 6, activation="relu2")
    assert relu2.fc1.weight.shape == (4, 6, 8) and relu2.limit is None
    assert rel_err(relu2(x, SIZES), _reference(x, relu2, "relu2")) < 1e-5


@pytest.mark.parametrize("kwargs, error, match", [
    ({"activation": "swiglu", "alpha": 1.0}, ValueError, r"alpha=1.0 applies only"),
    ({"activation": "relu", "limit": 2.0}, ValueError, r"limit=2.0 applies only"),
    ({"activation": "gelu", "gate_up_order": "interleaved"}, ValueError, r"gate_up_order"),
    ({"gate_up_order": "up_first"}, ValueError, r"gate_up_order='up_first'"),
    ({"activation": "gpt_oss_swiglu", "limit": "7"}, TypeError, r"limit must be"),
    ({"activation": "gpt_oss_swiglu", "alpha": float("nan")}, ValueError, r"alpha=nan"),
])
def test_mlp_rejects_activation_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        gl.GroupedMLP(4, 8, 6, **kwargs)


def test_mlp_kwargs_pass_to_both_layers_and_list_input():
    mlp = gl.GroupedMLP(4, 8, 6, single_grouped_weight=False, bias=False, backend="loop",
                        params_dtype=torch.float64)
    for fc in (mlp.fc1, mlp.fc2):
        assert not fc.single_grouped_weight and not fc.use_bias and fc.backend == "loop"
    pieces = [torch.randn(s, 8, dtype=torch.float64) for s in SIZES]
    assert rel_err(mlp(pieces), _reference(torch.cat(pieces), mlp, "swiglu")) < 1e-12


@pytest.mark.parametrize("kwargs", [{}, {"activation": "gpt_oss_swiglu", "limit": 0.5,
                                           "gate_up_order": "interleaved"}])
def test_mlp_delayed_wgrad(kwargs):
    mlp = gl.GroupedMLP(4, 8, 6, delay_wgrad_compute=True, params_dtype=torch.float64, **kwargs)
    ref_mlp = gl.GroupedMLP(4, 8, 6, params_dtype=torch.float64, **kwargs)
    ref_mlp.load_state_dict(mlp.state_dict())
    x = torch.randn(sum(SIZES), 8, dtype=torch.float64)
    mlp(x, SIZES).sum().backward()
    ref_mlp(x, SIZES).sum().backward()
    assert mlp.fc1.weight.grad is None
    mlp.backward_dw()
    for a, b in zip(mlp.parameters(), ref_mlp.parameters()):
        assert rel_err(a.grad, b.grad) < 1e-12


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("delay", [False, True])
def test_recompute_activation_matches_and_frees_fc2_input(activation, delay):
    import gc
    import weakref

    torch.manual_seed(0)
    kwargs = {"params_dtype": torch.float64, "delay_wgrad_compute": delay}
    plain = gl.GroupedMLP(3, 16, 8, activation=activation, **kwargs)
    lean = gl.GroupedMLP(3, 16, 8, activation=activation, recompute_activation=True, **kwargs)
    lean.load_state_dict(plain.state_dict())
    assert "recompute_activation=True" in repr(lean)
    sizes = [5, 0, 7]
    x = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
    x_lean = x.detach().clone().requires_grad_()
    fc2_inputs = []
    lean.fc2.register_forward_pre_hook(lambda m, args: fc2_inputs.append(weakref.ref(args[0])))
    y = plain(x, sizes)
    y_lean = lean(x_lean, sizes)
    gc.collect()
    assert fc2_inputs[0]() is None  # autograd holds no reference to the activation output
    grad = torch.randn_like(y)
    y.backward(grad)
    y_lean.backward(grad)
    if delay:
        plain.backward_dw()
        lean.backward_dw()
    torch.testing.assert_close(y_lean, y, rtol=0, atol=0)
    torch.testing.assert_close(x_lean.grad, x.grad, rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), lean.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(TypeError, match="recompute_activation"):
        gl.GroupedMLP(3, 16, 8, recompute_activation="yes")
