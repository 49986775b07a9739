"""``recompute_activation`` under each FP8 route: fc2 keeps no copy of its input for
backward, in any precision (neither the input nor the FP8 codes the route would derive from
it), and backward rebuilds it from fc1's output. On CPU the routes' Triton kernels run
under the interpreter and torch's FP8 grouped GEMM (sm90 only) as its dequantized
reference."""

import importlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels.gemm import fp8_torch_gemm
from grouped_linear.ops import mlp as ops_mlp
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.ops.test_mlp import reference
from tests.reference import rel_err

ops_linear = importlib.import_module("grouped_linear.ops.grouped_linear")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, F = 3, 128, 256
SIZES = [40, 0, 75]
CASES = [
    ("fp8_scaled_mm", Float8Rowwise()), ("fp8_scaled_mm", Float8Tensorwise()),
    ("fp8_blockwise", Float8Blockwise()),
    ("fp8_fused", Float8Rowwise()), ("fp8_fused", Float8Blockwise()),
    ("fp8_emulated", Float8Rowwise()), ("fp8_emulated", Float8Blockwise()),
]


@pytest.fixture
def dequantized_gemm(monkeypatch):
    """torch's FP8 grouped GEMM as its float32 reference of the dequantized operands."""
    if DEVICE == "cpu":
        def gemm(a, a_inv, b, b_inv, ends, out_dtype):
            return fp8_torch_gemm.dequantized_reference(a, a_inv, b, b_inv, ends).to(out_dtype)

        monkeypatch.setattr(fp8_torch_gemm, "forward", gemm)
        monkeypatch.setattr(fp8_torch_gemm, "dgrad", gemm)


@pytest.mark.fp8_fused
@pytest.mark.parametrize("route, recipe", CASES,
                         ids=[f"{route}-{type(recipe).__name__}" for route, recipe in CASES])
def test_fp8_fc2_keeps_nothing_of_its_input_and_rebuilds_it(route, recipe, monkeypatch,
                                                             dequantized_gemm):
    """The rebuilt input goes through the route's ``save_original_input`` backward: the
    recomputing block equals, bit for bit, the block whose fc2 keeps its input as given;
    and fc2's input is what autograd packed (replaced by the stand-in), nothing else of it."""
    monkeypatch.setattr(ops_linear, "choose_route", lambda *args: route)
    stand_ins = []

    class Counting(ops_mlp._Recompute):
        def __init__(self):
            stand_ins.append(self)

    monkeypatch.setattr(ops_mlp, "_Recompute", Counting)
    torch.manual_seed(0)
    kwargs = {"params_dtype": torch.bfloat16, "device": DEVICE, "recipe": recipe}
    lean = gl.GroupedMLP(E, H, F, recompute_activation=True, **kwargs)
    keeps_input = gl.GroupedMLP(E, H, F, **kwargs)
    keeps_input.load_state_dict(lean.state_dict())
    keeps_input.fc2.save_original_input = True
    x = torch.randn(sum(SIZES), H, device=DEVICE).bfloat16()
    probs = torch.rand(sum(SIZES), device=DEVICE)
    grad = torch.randn(sum(SIZES), H, device=DEVICE).bfloat16()
    results = []
    for mlp in (lean, keeps_input):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = mlp(xi, SIZES, pi)
        y.backward(grad)
        results.append([y, xi.grad, pi.grad, *(p.grad for p in mlp.parameters())])
    assert len(stand_ins) == 1  # fc2's input, packed as the stand-in, by the lean block only
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    # and both are the block, within FP8's error: float64, one expert at a time
    w1, b1, w2, b2 = (t.detach().double().cpu() for t in (
        lean.fc1.weight, lean.fc1.bias, lean.fc2.weight, lean.fc2.bias))
    x64 = x.double().cpu().requires_grad_()
    y64 = reference(x64, w1, b1, w2, b2, SIZES, "swiglu", probs=probs.double().cpu())
    y64.backward(grad.double().cpu())
    assert rel_err(results[0][0], y64) < 7e-2 and rel_err(results[0][1], x64.grad) < 7e-2


def test_fp8_fc2_without_recompute_keeps_fp8_codes(monkeypatch, dequantized_gemm):
    """The other side: without ``recompute_activation`` the rowwise route keeps fc2's input
    as FP8 codes (nothing packed as the stand-in, the input not saved as given)."""
    monkeypatch.setattr(ops_linear, "choose_route", lambda *args: "fp8_scaled_mm")
    torch.manual_seed(0)
    mlp = gl.GroupedMLP(E, H, F, params_dtype=torch.bfloat16, device=DEVICE,
                        recipe=Float8Rowwise())
    fc2_inputs = []
    mlp.fc2.register_forward_pre_hook(lambda m, args: fc2_inputs.append(args[0]))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(sum(SIZES), H, device=DEVICE).bfloat16()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x, SIZES)
    assert not any(t is fc2_inputs[0] for t in saved)
    assert any(t.dtype == torch.float8_e4m3fn and t.numel() >= sum(SIZES) * F for t in saved)
