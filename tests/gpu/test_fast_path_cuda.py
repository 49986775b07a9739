"""The fast path of the plain CUDA call (the verdict cache of ``ops.dispatch``)."""

import importlib

import pytest
import torch
import torch.nn.utils.parametrize as parametrize

import grouped_linear as gl
from grouped_linear import _tuning
from tests.reference import reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ops_module = importlib.import_module("grouped_linear.ops.grouped_linear")
dispatch = importlib.import_module("grouped_linear.ops.dispatch")
SIZES = [300, 0, 1, 517, 64, 0, 129, 1000]  # unaligned, empty groups
K, N = 256, 384


class _SplitsSpy:
    """Counts the calls of the full path's split normalisation."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = ops_module.normalize_splits

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(ops_module, "normalize_splits", counting)


def _layer(bias, backend, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return gl.GroupedLinear(len(SIZES), K, N, bias=bias, params_dtype=dtype, device="cuda",
                            backend=backend)


def _step(layer, x, splits, grad_out):
    for p in (x, *layer.parameters()):
        p.grad = None
    y = layer(x, splits)
    y.backward(grad_out)
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("backend", ["auto", "grouped", "triton", "loop"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", [1, 4])  # 2011 rows (Triton under auto) or 8044 (grouped)
def test_fast_path_taken_and_equal_to_full_path(monkeypatch, backend, bias, scale):
    """Device splits take the fast path (no split normalisation), host splits the full one;
    both give the same values as each other and as the float64 reference."""
    sizes = [s * scale for s in SIZES]
    rows = sum(sizes) + 5  # a tail of rows in no group
    layer = _layer(bias, backend)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    spy = _SplitsSpy(monkeypatch)
    fast = _step(layer, x, torch.tensor(sizes, device="cuda"), grad_out)
    assert spy.calls == 0
    # The full path: the same device splits with its debug checks on.
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", "1")
    full = _step(layer, x, torch.tensor(sizes, device="cuda"), grad_out)
    assert spy.calls == 1
    for got, want in zip(fast, full):
        assert torch.equal(got, want)
    ref = reference_grads(x, layer.weight, layer.bias, sizes, grad_out)
    for got, want in zip(fast, ref):
        assert rel_err(got, want) < 1e-2


def _difference(name, strided, dense, exact):
    """Where two results that should be equal differ: per group for a per-group tensor,
    with each one's error against the float64 reference."""
    diff = (strided.float() - dense.float()).abs()
    where = diff.flatten(1).amax(1).tolist() if diff.dim() == 3 else diff.max().item()
    return (f"{name}: strided and dense splits differ by {where} (relative error against "
            f"float64: strided {rel_err(strided, exact):.2e}, dense {rel_err(dense, exact):.2e})")


@pytest.mark.parametrize("backend", ["auto", "grouped", "triton", "loop"])
@pytest.mark.parametrize("debug", ["0", "1"])  # the fast path, then the full one
def test_strided_split_tensor_gives_its_values(monkeypatch, backend, debug):
    """Splits that are a column of a per-expert table (a strided view) give what the same
    sizes laid out densely give, on both paths."""
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", debug)
    layer = _layer(True, backend)
    rows = sum(SIZES) + 3
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[s, 4096] for s in SIZES], device="cuda")
    assert not table[:, 0].is_contiguous()
    strided = _step(layer, x, table[:, 0], grad_out)
    dense = _step(layer, x, table[:, 0].contiguous(), grad_out)
    ref = reference_grads(x, layer.weight, layer.bias, SIZES, grad_out)
    for name, got, want, exact in zip(("y", "dx", "dW", "db"), strided, dense, ref):
        assert torch.equal(got, want), _difference(name, got, want, exact)
    for got, want in zip(strided, ref):
        assert rel_err(got, want) < 1e-2


def test_fast_path_without_grad_and_functional(monkeypatch):
    """Inference and ``gl.grouped_linear`` take the fast path too, with the same values."""
    layer = _layer(True, "auto")
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(SIZES, device="cuda", dtype=torch.int32)
    spy = _SplitsSpy(monkeypatch)
    with torch.no_grad():
        y_inference = layer(x, splits)
    y_functional = gl.grouped_linear(x, layer.weight, layer.bias, splits)
    assert spy.calls == 0 and y_functional.requires_grad and not y_inference.requires_grad
    assert torch.equal(y_inference, y_functional.detach())
    ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones_like(y_inference))[0]
    assert rel_err(y_inference, ref) < 1e-2


@pytest.mark.parametrize("case", ["float_splits", "short_splits", "cpu_splits", "wide_x",
                                  "fp32_x", "autocast", "fp8_autocast"])
def test_other_calls_take_the_full_path(monkeypatch, case):
    """Every call the fast path does not cover reaches the full path, which raises the same
    errors and computes the same values as before."""
    layer = _layer(True, "auto")
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(SIZES, device="cuda")
    spy = _SplitsSpy(monkeypatch)
    if case == "float_splits":
        with pytest.raises(TypeError, match="m_splits"):
            layer(x, splits.float())
    elif case == "short_splits":
        with pytest.raises(ValueError, match="m_splits has length 7"):
            layer(x, splits[:7])
    elif case == "wide_x":
        with pytest.raises(ValueError, match="x has 257 features"):
            layer(torch.randn(10, K + 1, device="cuda", dtype=torch.bfloat16), splits)
        return  # rejected before the splits are looked at
    elif case == "fp32_x":
        with pytest.raises(TypeError, match="weight has dtype torch.bfloat16"):
            layer(x.float(), splits)
        return  # rejected before the splits are looked at
    elif case == "cpu_splits":
        y = layer(x, splits.cpu())
        assert torch.equal(y, layer(x, SIZES))
        ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones_like(y))[0]
        assert rel_err(y, ref) < 1e-2
    elif case == "autocast":
        with torch.autocast("cuda", dtype=torch.float16):
            assert layer(x, splits).dtype == torch.float16
    elif case == "fp8_autocast":
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("FP8 GEMMs need sm90")
        with gl.autocast(gl.recipes.Float8Rowwise()):
            y = layer(x, splits)
        ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones_like(y))[0]
        assert 1e-4 < rel_err(y, ref) < 6e-2  # FP8 error, not bf16's
    assert spy.calls >= 1


@pytest.mark.parametrize("backend, scale, node", [
    ("auto", 1, "TritonGroupedLinearFunctionBackward"),
    ("triton", 4, "TritonGroupedLinearFunctionBackward"),
    ("auto", 4, "GroupedLinearFunctionBackward"),
    ("grouped", 1, "GroupedLinearFunctionBackward"),
])
def test_fast_path_records_the_triton_node_for_the_triton_backend(backend, scale, node):
    """The triton backend's fast path records the cut-down node (ops/fast_path.py); the
    other backends, and the full path under debug checks, record the general one."""
    layer = _layer(True, backend)
    x = torch.randn(sum(SIZES) * scale, K, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    splits = torch.tensor([s * scale for s in SIZES], device="cuda")
    assert type(layer(x, splits).grad_fn).__name__ == node


def test_fast_path_verdicts_are_kept_per_signature(monkeypatch):
    """A second call of the same signature reuses the first call's verdict (for the triton
    backend with the same launches object), another row count gets its own; the verdict
    follows the Triton rows threshold (part of the key), and a parametrized weight (absent from
    ``_parameters``) is applied: the layer's call takes it through the full path."""
    layer = _layer(True, "auto")
    dispatch._VERDICTS.clear()
    resolutions = []
    resolve = dispatch._plain_route
    monkeypatch.setattr(dispatch, "_plain_route",
                        lambda *args: resolutions.append(1) or resolve(*args))
    splits = torch.tensor(SIZES, device="cuda")
    x = torch.randn(sum(SIZES) + 3, K, device="cuda", dtype=torch.bfloat16)
    layer(x, splits)
    (verdict,) = dispatch._VERDICTS.values()
    layer(x, splits)
    assert len(resolutions) == 1 and list(dispatch._VERDICTS.values()) == [verdict]
    assert verdict[0] == "triton" and verdict[1] is not None
    layer(x[:-2], splits)
    assert [name for name, _ in dispatch._VERDICTS.values()] == ["triton", "triton"]
    with _tuning.override(triton_auto_max_rows=16):
        y = layer(x, splits)
    assert sorted(name for name, _ in dispatch._VERDICTS.values()) == [
        "grouped", "triton", "triton"]
    assert len(resolutions) == 3
    ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones_like(y))[0]
    assert rel_err(y, ref) < 1e-2

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return weight * 2

    before = layer(x, splits)
    parametrize.register_parametrization(layer, "weight", Doubled())
    y = layer(x, splits)
    assert torch.equal(layer.weight, layer.parametrizations.weight.original * 2)
    ref = reference_grads(x, layer.weight, layer.bias, SIZES, torch.ones_like(y))[0]
    assert rel_err(y, ref) < 1e-2 and rel_err(before, ref) > 0.3


def test_unusual_arguments_reach_the_full_path_errors():
    """A non-tensor bias or a non-string backend with otherwise plain CUDA arguments gets the
    full path's TypeError / ValueError naming the argument, not an error from the lookup."""
    layer = _layer(True, "auto")
    x = torch.randn(sum(SIZES), K, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(SIZES, device="cuda")
    with pytest.raises(TypeError, match="bias must be a torch.Tensor, got list"):
        gl.grouped_linear(x, layer.weight, layer.bias.tolist(), splits)
    with pytest.raises(ValueError, match=r"backend=\['auto'\] is not one of"):
        gl.grouped_linear(x, layer.weight, layer.bias, splits, backend=["auto"])
