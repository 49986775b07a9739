"""The route table (ops/dispatch.py) and the thresholds it reads (grouped_linear/_tuning.py)."""

import importlib

import pytest
import torch

import grouped_linear as gl
from grouped_linear import _tuning
from grouped_linear.kernels.gemm import fp8_fused_gemm, fp8_torch_gemm, triton_gemm
from grouped_linear.ops.dispatch import (
    TORCH_GROUPED_MAX_GROUPS,
    choose_route,
    fp8_route,
    resolve_backend,
)
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.reference import reference_grads, rel_err

dispatch = importlib.import_module("grouped_linear.ops.dispatch")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # resolution only: nothing is placed


@pytest.mark.parametrize("groups", [1, 128, 65536])
@pytest.mark.parametrize("rows", [0, 4096, 1 << 20])
@pytest.mark.parametrize("dtype, in_features, out_features, want", [
    (torch.float32, 64, 32, "grouped"),
    (torch.float32, 2048, 768, "grouped"),
    (torch.float32, 62, 32, "loop"),  # rows of 248 bytes: torch's grouped GEMM refuses
    (torch.float32, 64, 30, "loop"),
    (torch.float32, 0, 32, "loop"),  # zero width: no strides torch's grouped GEMM takes
    (torch.float32, 64, 0, "loop"),
    (torch.bfloat16, 64, 32, "grouped"),  # a bias too: by addmm per group, forward only
    (torch.bfloat16, 64, 36, "loop"),  # rows of 72 bytes
    (torch.float16, 64, 32, "loop"),  # the grouped backend takes no fp16 on CPU
    (torch.float64, 64, 32, "loop"),  # torch's grouped GEMM has no float64
])
def test_cpu_auto_takes_the_grouped_gemm_for_fp32_and_bf16(
        dtype, in_features, out_features, want, rows, groups):
    """On CPU ``auto`` runs torch's grouped GEMM in fp32 and bf16, with or without a bias,
    whatever the rows and groups, and the loop otherwise (benchmarks/cpu_backends.py); a recipe runs
    the emulation."""
    assert choose_route("auto", None, CPU, dtype, in_features, out_features, rows,
                        groups) == want
    if want == "grouped":  # what auto picks, the backend asked for by name takes
        assert resolve_backend("grouped", CPU, dtype, in_features, out_features, rows,
                               groups) == "grouped"
    assert choose_route("loop", None, CPU, dtype, in_features, out_features, rows,
                        groups) == "loop"
    for recipe in (Float8Rowwise(), Float8Tensorwise(), Float8Blockwise()):
        assert choose_route("auto", recipe, CPU, torch.bfloat16, 64, 32, rows,
                            groups) == "fp8_emulated"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_grouped_route_gives_the_loops_results(dtype, with_bias):
    """On CPU the grouped route runs the loop's GEMMs in C++ (a bf16 bias joins the forward's
    products by addmm, rounded once): the output and every gradient equal the loop's bit for
    bit, empty groups included, and lie within the dtype's tolerance of float64."""
    gen = torch.Generator().manual_seed(7)
    sizes, features, out_features = [5, 0, 17, 1, 9], 24, 40
    x = torch.randn(sum(sizes), features, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(5, out_features, features, generator=gen).to(dtype).requires_grad_()
    bias = (torch.randn(5, out_features, generator=gen).to(dtype).requires_grad_()
            if with_bias else None)
    grad = torch.randn(sum(sizes), out_features, generator=gen).to(dtype)
    leaves = [t for t in (x, weight, bias) if t is not None]
    results = {}
    for backend in ("loop", "grouped"):
        y = gl.grouped_linear(x, weight, bias, sizes, backend=backend)
        y.backward(grad)
        results[backend] = [y.detach()] + [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
    for a, b in zip(results["loop"], results["grouped"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    want = [w for w in reference_grads(x, weight, bias, sizes, grad) if w is not None]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for got, ref in zip(results["grouped"], want, strict=True):
        assert rel_err(got, ref) < tol


def _strided_input(layout: str, rows: int, features: int) -> torch.Tensor:
    """A ``(rows, features)`` fp32 input laid out as ``layout`` says."""
    if layout == "transposed":
        return torch.randn(features, rows).t()
    if layout == "padded rows":  # 66 * 4 bytes between rows: not a multiple of 16
        return torch.randn(rows, features + 2)[:, :features]
    if layout == "every other row":
        return torch.randn(2 * rows, features)[::2]
    return torch.randn(features * rows + 1)[1:].view(rows, features)  # starts 4 bytes past 16


@pytest.mark.parametrize("layout", ["transposed", "padded rows", "every other row",
                                    "unaligned start"])
@pytest.mark.parametrize("backend", ["auto", "grouped"])
def test_the_grouped_gemm_takes_any_input_layout(backend, layout):
    """torch's grouped GEMM refuses strides that are not 16-byte multiples; the grouped route
    (fp32 ``auto`` on CPU) copies such operands, so every layout the loop takes it takes."""
    torch.manual_seed(0)
    sizes, features, out_features = [3, 0, 7], 64, 32
    assert resolve_backend(backend, CPU, torch.float32, features, out_features, 10, 3) == "grouped"
    x = _strided_input(layout, sum(sizes), features).requires_grad_()
    weight = torch.randn(3, out_features, features, requires_grad=True)
    bias = torch.randn(3, out_features, requires_grad=True)
    grad = torch.randn(sum(sizes), out_features)
    y = gl.grouped_linear(x, weight, bias, sizes, backend=backend)
    y.backward(grad)
    want = reference_grads(x, weight, bias, sizes, grad)
    for got, ref in zip((y, x.grad, weight.grad, bias.grad), want):
        assert rel_err(got, ref) < 1e-5


def test_a_recipe_checks_the_backend_name_only():
    """With a recipe the backend selects nothing (the FP8 GEMMs are chosen by device and
    dtype), so a backend that could not take the high-precision call is not an error; an
    unknown name still is."""
    assert choose_route("triton", Float8Rowwise(), CPU, torch.float64, 7, 5, 10, 2) == "fp8_emulated"
    with pytest.raises(ValueError, match="backend='fast' is not one of"):
        choose_route("fast", Float8Rowwise(), CPU, torch.bfloat16, 64, 32, 10, 2)
    with pytest.raises(ValueError, match="backend='grouped' needs in_features"):
        choose_route("grouped", None, CPU, torch.float32, 7, 5, 10, 2)


@pytest.mark.parametrize("rows", [16, 17, 4096, 4097])
def test_the_triton_rows_threshold_follows_the_tuning(rows):
    default = _tuning.current().triton_auto_max_rows
    want = "triton" if rows <= default else "grouped"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 1024, 1024, rows, 8) == want
    with _tuning.override(triton_auto_max_rows=16):
        want = "triton" if rows <= 16 else "grouped"
        assert resolve_backend("auto", CUDA, torch.bfloat16, 1024, 1024, rows, 8) == want
    assert _tuning.current().triton_auto_max_rows == default


def test_override_restores_on_error_and_rejects_unknown_names():
    before = _tuning.current()
    with pytest.raises(RuntimeError), _tuning.override(triton_auto_max_rows=1):
        assert _tuning.current().triton_auto_max_rows == 1
        raise RuntimeError
    assert _tuning.current() is before
    with pytest.raises(TypeError), _tuning.override(no_such_threshold=3):
        pass
    assert _tuning.current() is before


def test_a_rejected_fp8_call_leaves_the_weight_cache_as_it_was():
    """Every argument is checked before the cache moves: a call with bad splits and
    ``is_first_microbatch=True`` raises without re-quantizing the cached weight."""
    torch.manual_seed(0)
    layer = gl.GroupedLinear(2, 32, 16, recipe=Float8Rowwise())
    x = torch.randn(10, 32)
    first = layer(x, [4, 6], is_first_microbatch=True)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    entry, stamp = layer._fp8_weights.entry, layer._fp8_weights.stamp
    held = [b.clone() for b in entry.buffers()]
    for flag in (True, False):  # False: the weight changed, so it would quantize too
        with pytest.raises(ValueError, match="sums to 11"):
            layer(x, [5, 6], is_first_microbatch=flag)
        assert layer._fp8_weights.entry is entry and layer._fp8_weights.stamp == stamp
        assert all(torch.equal(a, b) for a, b in zip(entry.buffers(), held))
    assert not torch.equal(layer(x, [4, 6], is_first_microbatch=False), first)


# --------------------------------------------------------------------------- group counts
def _auto(rows: int, groups: int, features: int = 64) -> str:
    return resolve_backend("auto", CUDA, torch.bfloat16, features, features, rows, groups)


@pytest.mark.parametrize("groups", [1, 1023, 1024, 4095, 4096, 65536])
@pytest.mark.parametrize("rows", [4096, 4097])
def test_auto_takes_a_route_whose_gemms_take_the_group_count(groups, rows):
    """torch's CUDA grouped GEMM takes at most 1023 groups and the Triton kernels 4095: past
    the first ``auto`` runs the Triton kernels at any row count, past both the loop."""
    if groups <= triton_gemm.MAX_GROUPS and (rows <= 4096 or groups > TORCH_GROUPED_MAX_GROUPS):
        want = "triton"
    elif groups <= TORCH_GROUPED_MAX_GROUPS:
        want = "grouped"
    else:
        want = "loop"
    assert _auto(rows, groups) == want
    # features that are not multiples of 8: never the grouped GEMMs
    assert _auto(rows, groups, 60) == (want if want != "grouped" else "loop")


def test_grouped_backend_by_name_names_its_group_limit_on_cuda():
    assert resolve_backend("grouped", CUDA, torch.bfloat16, 64, 64, 10, 1023) == "grouped"
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        with pytest.raises(ValueError, match=r"backend='grouped' takes at most 1023 groups on "
                                             r"CUDA .* got 1024 groups"):
            resolve_backend("grouped", CUDA, dtype, 64, 64, 10, 1024)
    # torch's CPU grouped GEMM is a loop without the limit
    assert resolve_backend("grouped", CPU, torch.float32, 64, 64, 10, 65536) == "grouped"
    with pytest.raises(ValueError, match=r"backend='triton' takes at most 4095 groups"):
        resolve_backend("triton", CUDA, torch.bfloat16, 64, 64, 10, 4096)


def test_fp8_scaled_mm_only_within_torch_group_limit(monkeypatch):
    """``torch._scaled_grouped_mm`` has the same limit: more groups run the emulation (the
    recipe's numerics); the device's capabilities are faked, nothing runs."""
    monkeypatch.setattr(fp8_torch_gemm, "available", lambda device: True)
    monkeypatch.setattr(fp8_torch_gemm, "gemm_accepts", lambda *args: True)
    cuda0 = torch.device("cuda", 0)
    for recipe in (Float8Rowwise(), Float8Tensorwise()):
        assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 1023) == "fp8_scaled_mm"
        assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 1024) == "fp8_emulated"
        assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 65536) == "fp8_emulated"


@pytest.mark.fp8_fused  # the default work threshold: small calls may take the fused route
@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise(), Float8Blockwise()],
                         ids=lambda r: type(r).__name__)
def test_fp8_routes_on_either_side_of_their_group_bounds(recipe, monkeypatch):
    """The fused kernels and the blockwise GEMMs hold a table of the groups in registers and
    take at most 4095 groups: a small call of 4095 groups runs fused, of 4096 the emulation;
    a large blockwise call of 4095 groups runs the blockwise GEMMs, of 4096 the emulation.
    The device's capabilities are faked, nothing runs."""
    monkeypatch.setattr(fp8_torch_gemm, "available", lambda device: True)
    monkeypatch.setattr(fp8_torch_gemm, "gemm_accepts", lambda *args: True)
    monkeypatch.setattr(dispatch, "_fp8_gemms_on", lambda device: True)
    cuda0 = torch.device("cuda", 0)
    assert fp8_fused_gemm.MAX_GROUPS == triton_gemm.MAX_GROUPS == 4095
    assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 4095, 8) == "fp8_fused"
    assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 4096, 8) == "fp8_emulated"
    large = "fp8_blockwise" if isinstance(recipe, Float8Blockwise) else "fp8_emulated"
    past_work = _tuning.current().fp8_fused_max_work // (64 * 64) + 1
    for rows in (None, past_work):  # a large call: past the fused route's work
        assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 4095, rows) == large
        assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 4096, rows) == "fp8_emulated"
    assert fp8_route(recipe, cuda0, torch.bfloat16, 64, 64, 1, None) == (
        large if large == "fp8_blockwise" else "fp8_scaled_mm")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_plain_calls_route_is_the_route_tables(dtype, with_bias):
    """The fast path's verdict for a call signature (reached here directly, on CPU tensors)
    is the route the table gives the same call."""
    G, N, K, M = 3, 32, 64, 40
    x, weight = torch.randn(M, K, dtype=dtype), torch.randn(G, N, K, dtype=dtype)
    bias = torch.randn(G, N, dtype=dtype) if with_bias else None
    splits = torch.tensor([10, 0, 30])
    want = choose_route("auto", None, CPU, dtype, K, N, M, G)
    assert dispatch._plain_route(x, weight, bias, splits, "auto") == want
