"""``bias_activation`` (the differentiable op) and ``check_activation``."""

import numpy as np
import pytest
import torch

from grouped_linear.ops.activation import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    Activation,
    bias_activation,
    check_activation,
)
from tests.kernels.test_activation import CASES, DEVICE, grouped_f64
from tests.reference import rel_err


def _inputs(kind, dtype, sizes=(2, 0, 3), tail=0, F=3, away_from=()):
    G, M = len(sizes), sum(sizes) + tail
    width = 2 * F if kind in GATED_ACTIVATIONS else F
    h = torch.randn(M, width, dtype=torch.float64, device=DEVICE) * 2
    bias = torch.randn(G, width, dtype=torch.float64, device=DEVICE)
    ends = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    with torch.no_grad():  # keep h + b away from kinks (finite differences straddle them)
        rows = torch.repeat_interleave(torch.arange(G, device=DEVICE),
                                       torch.tensor(sizes, device=DEVICE))
        value = h[:len(rows)] + bias[rows]
        for kink in away_from:
            near = (value - kink).abs() < 0.1
            h[:len(rows)] += near * 0.25
    return h.to(dtype), bias.to(dtype), ends


@pytest.mark.parametrize("kind, interleaved", CASES)
def test_gradcheck_float64(kind, interleaved):
    params = {"gpt_oss_swiglu": {"alpha": 0.8, "limit": 1.0},
              "clamped_swiglu": {"limit": 1.0}}.get(kind, {})
    act = check_activation(kind, "interleaved" if interleaved else "concatenated", params)
    kinks = {"relu": (0.0,), "relu2": (0.0,), "gpt_oss_swiglu": (-1.0, 1.0),
             "clamped_swiglu": (-1.0, 1.0)}.get(kind, ())
    h, bias, ends = _inputs(kind, torch.float64, away_from=kinks)
    h.requires_grad_()
    bias.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, b: bias_activation(h, b, ends, act, False),
                                    (h, bias))


@pytest.mark.parametrize("kind, interleaved", CASES)
def test_op_gradients_match_float64(kind, interleaved):
    """Through the autograd function (Triton where it runs): the output and the gradients of
    ``h`` and of the bias against the float64 formulas, rows past the groups included."""
    sizes, dtype = (3, 0, 5), torch.bfloat16
    act = check_activation(kind, "interleaved" if interleaved else "concatenated")
    h, bias, ends = _inputs(kind, dtype, sizes=sizes, tail=2, F=8)
    h.requires_grad_()
    bias.requires_grad_()
    out = bias_activation(h, bias, ends, act, True)
    grad = torch.randn(out.shape, dtype=torch.float64, device=DEVICE).to(dtype)
    out.backward(grad)
    h64 = h.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    want = grouped_f64(kind, h64, b64, sizes, interleaved, act.alpha, act.limit)
    want.backward(grad.double())
    tol = 2e-2
    assert rel_err(out, want) < tol
    assert rel_err(h.grad, h64.grad) < tol and rel_err(bias.grad, b64.grad) < tol


def test_default_gpt_oss_parameters_and_names():
    assert set(ACTIVATIONS) == {"swiglu", "geglu", "geglu_erf", "gpt_oss_swiglu",
                                "clamped_swiglu", "gelu", "gelu_erf", "relu", "silu", "relu2"}
    assert check_activation("gpt_oss_swiglu") == Activation("gpt_oss_swiglu", False, 1.702, 7.0)
    assert check_activation("clamped_swiglu").limit == 10.0
    assert check_activation("clamped_swiglu", "interleaved", {"limit": 3}) == \
        Activation("clamped_swiglu", True, 1.702, 3.0)
    assert check_activation("gpt_oss_swiglu", "interleaved", {"alpha": 2, "limit": None}) == \
        Activation("gpt_oss_swiglu", True, 2.0, 7.0)
    assert check_activation("relu", "concatenated", {"alpha": None}).kind == "relu"


@pytest.mark.parametrize("args, error, match", [
    (("tanh",), ValueError, r"activation='tanh'"),
    ((None,), ValueError, r"activation=None"),
    (("swiglu", "gate_first"), ValueError, r"gate_up_order='gate_first'"),
    (("swiglu", 1), ValueError, r"gate_up_order=1"),
    (("gelu", "interleaved"), ValueError, r"gate_up_order='interleaved'.*activation='gelu'"),
    (("swiglu", "concatenated", {"alpha": 1.0}), ValueError, r"alpha=1.0 applies only"),
    (("relu", "concatenated", {"limit": 3.0}), ValueError, r"limit=3.0 applies only"),
    (("clamped_swiglu", "concatenated", {"alpha": 1.0}), ValueError,
     r"alpha=1.0 applies only to activation in \['gpt_oss_swiglu'\]"),
    (("relu2", "interleaved"), ValueError, r"gate_up_order='interleaved'.*activation='relu2'"),
    (("clamped_swiglu", "concatenated", {"limit": -2}), ValueError, r"limit=-2.0"),
    (("gpt_oss_swiglu", "concatenated", {"beta": 1.0}), TypeError, r"'beta'"),
    (("gpt_oss_swiglu", "concatenated", {"alpha": "1"}), TypeError, r"alpha must be"),
    (("gpt_oss_swiglu", "concatenated", {"alpha": True}), TypeError, r"alpha must be"),
    (("gpt_oss_swiglu", "concatenated", {"limit": torch.tensor(7.0)}), TypeError,
     r"limit must be"),
    (("gpt_oss_swiglu", "concatenated", {"alpha": float("inf")}), ValueError, r"alpha=inf"),
    (("gpt_oss_swiglu", "concatenated", {"limit": -1.0}), ValueError, r"limit=-1.0"),
    (("gpt_oss_swiglu", "concatenated", {"limit": float("nan")}), ValueError, r"limit=nan"),
])
def test_check_activation_rejects(args, error, match):
    with pytest.raises(error, match=match):
        check_activation(*args)


def test_numpy_parameters_and_unbounded_limit():
    act = check_activation("gpt_oss_swiglu", "concatenated",
                           {"alpha": np.float32(1.5), "limit": float("inf")})
    assert act.alpha == 1.5 and act.limit == float("inf")
    h, bias, ends = _inputs("gpt_oss_swiglu", torch.float32, F=4)
    h = h * 10
    out = bias_activation(h, bias, ends, act, False)
    want = grouped_f64("gpt_oss_swiglu", h.double(), bias.double(), (2, 0, 3), alpha=1.5,
                       limit=float("inf"))
    assert rel_err(out, want) < 1e-5


def test_op_rejects_unknown_kind():
    h, bias, ends = _inputs("relu", torch.float32)
    with pytest.raises(ValueError, match="activation='tanh'"):
        bias_activation(h, bias, ends, "tanh", False)
