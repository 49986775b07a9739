"""FP8 recipes on CUDA: real FP8 GEMMs (sm90) against float64 and against the emulation."""

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels.gemm import fp8_torch_gemm
from grouped_linear.ops.dispatch import fp8_route
from grouped_linear.recipes import Float8Blockwise, Float8Rowwise, Float8Tensorwise
from tests.gpu.test_cuda_graphs import check_layer_step_replays
from tests.reference import reference_grads, rel_err, saved_by

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
RECIPES = [Float8Rowwise(), Float8Tensorwise(), Float8Rowwise(fp8_format="hybrid"),
           Float8Tensorwise(power_of_two_scales=True), Float8Rowwise(power_of_two_scales=True)]
SIZES = [100, 0, 333, 79, 512]
TRITON_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
# Rowwise and tensorwise on torch's FP8 GEMM, blockwise on the Triton one (tighter bound).
DEVICE_RECIPES = [Float8Rowwise(), Float8Tensorwise(),
                  pytest.param(Float8Blockwise(), marks=pytest.mark.skipif(
                      not TRITON_FP8, reason="needs FP8 tensor cores (sm89+)"))]


def _tolerance(recipe):
    return 4e-2 if isinstance(recipe, Float8Blockwise) else 6e-2
K, N = 256, 128


def _step(recipe, split_kind="cuda", x_scale=1.0, grad_scale=1.0, sizes=SIZES, tail=11,
          bias=True):
    G = len(sizes)
    M = sum(sizes) + (tail if split_kind == "cuda" else 0)
    x = (torch.randn(M, K, device="cuda") * x_scale).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(G, N, K, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    b = torch.randn(G, N, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    splits = sizes if split_kind == "list" else torch.tensor(sizes, device="cuda")
    y = gl.grouped_linear(x, w, b, splits, recipe=recipe)
    grad_out = (torch.randn(M, N, device="cuda") * grad_scale).to(torch.bfloat16)
    y.backward(grad_out)
    ref = reference_grads(x, w, b, sizes, grad_out)
    got = (y, x.grad, w.grad) + ((b.grad,) if bias else ())
    return got, ref, M


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMM is sm90's")
def test_each_recipe_takes_its_fp8_gemm_path():
    x = torch.randn(4, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, N, K, device="cuda", dtype=torch.bfloat16)
    takes_e5m2 = fp8_torch_gemm.gemm_accepts(torch.float8_e5m2, torch.float8_e4m3fn,
                                       torch.cuda.current_device())
    def route(recipe, dtype=torch.bfloat16, in_features=K):
        return fp8_route(recipe, x.device, dtype, in_features, N, w.shape[0])

    for recipe in RECIPES:
        want = "fp8_scaled_mm" if recipe.fp8_format == "e4m3" or takes_e5m2 else "fp8_emulated"
        assert route(recipe) == want, recipe
    assert route(Float8Blockwise()) == "fp8_blockwise"
    assert route(Float8Blockwise(fp8_format="hybrid")) == "fp8_emulated"
    assert route(Float8Rowwise(), torch.float32) == "fp8_emulated"
    assert route(Float8Rowwise(), in_features=40) == "fp8_emulated"  # K % 16 != 0


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMM is sm90's")
@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise()], ids=repr)
@pytest.mark.parametrize("split_kind", ["list", "cuda"])
def test_rowwise_recipes_take_the_group_scaled_gluon_wgrad(recipe, split_kind, monkeypatch):
    """The weight gradient runs this library's group-scaled Gluon GEMM (128-token group
    blocks) on sm90, once per call, not the Triton one, and every gradient matches
    float64."""
    from grouped_linear.kernels.gemm import fp8_gluon_wgrad, fp8_triton_gemm

    calls = []
    for module, name in ((fp8_gluon_wgrad, "gluon"), (fp8_triton_gemm, "triton")):
        original = module.blockwise_wgrad
        monkeypatch.setattr(module, "blockwise_wgrad",
                            lambda *a, _o=original, _n=name, **k:
                            calls.append((_n, k.get("group_scales"))) or _o(*a, **k))
    got, ref, _ = _step(recipe, split_kind)
    assert calls == [("gluon", True)]
    for name, a, b in zip(("y", "dx", "dW", "db"), got, ref):
        assert rel_err(a, b) < 6e-2, (name, rel_err(a, b))


@pytest.mark.parametrize("recipe", RECIPES, ids=repr)
@pytest.mark.parametrize("split_kind", ["list", "cuda"])
def test_fp8_matches_float64_on_cuda(recipe, split_kind):
    got, ref, M = _step(recipe, split_kind)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, ref):
        err = rel_err(a, b)
        print(f"{recipe!r} {split_kind} {name}: {err:.4f}")
        assert err < 6e-2, (name, err)
        assert torch.isfinite(a).all()
    assert torch.all(got[0][sum(SIZES):] == 0) and torch.all(got[1][sum(SIZES):] == 0)


@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise()], ids=repr)
def test_fp8_scaling_far_from_unit_range(recipe):
    got, ref, _ = _step(recipe, x_scale=1e3, grad_scale=1e-4)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, ref):
        assert rel_err(a, b) < 6e-2, (name, rel_err(a, b))


@pytest.mark.parametrize("recipe", DEVICE_RECIPES, ids=repr)
def test_fp8_unaligned_single_and_empty_groups(recipe):
    for sizes in ([1, 15, 17, 0, 33], [0, 0, 700, 0, 0], [0, 0, 0, 0, 0]):
        got, ref, _ = _step(recipe, sizes=sizes, tail=5)
        for name, a, b in zip(("y", "dx", "dW", "db"), got, ref):
            assert torch.isfinite(a).all()
            if sum(sizes):
                assert rel_err(a, b) < _tolerance(recipe), (sizes, name, rel_err(a, b))
            else:
                assert torch.all(a == 0), (sizes, name)
        assert torch.all(got[2][[g for g, s in enumerate(sizes) if s == 0]] == 0)


@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise()], ids=repr)
def test_fp8_zeros_and_huge_values_stay_finite(recipe):
    sizes = [64, 0, 96]
    x = torch.randn(160, K, device="cuda", dtype=torch.bfloat16)
    x[:64] = 0
    x[100, 3] = 3e38
    w = (torch.randn(3, N, K, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    x.requires_grad_()
    y = gl.grouped_linear(x, w, None, sizes, recipe=recipe)
    y.float().sum().backward()
    assert torch.all(y[:64] == 0)
    for t in (x.grad, w.grad):
        assert not torch.isnan(t).any()


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMM is sm90's")
@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise()], ids=repr)
def test_device_gemms_agree_with_the_emulation(recipe):
    """Same scales, same FP8 values: only accumulation order and bf16 rounding differ."""
    sizes = [100, 0, 333, 79, 512]
    x = torch.randn(sum(sizes), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5, N, K, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(sum(sizes), N, device="cuda", dtype=torch.bfloat16)
    results = []
    for device in ("cuda", "cpu"):
        xd = x.detach().to(device).requires_grad_()
        wd = w.detach().to(device).requires_grad_()
        y = gl.grouped_linear(xd, wd, None, sizes, recipe=recipe)
        y.backward(grad_out.to(device))
        results.append((y, xd.grad, wd.grad))
    for name, a, b in zip(("y", "dx", "dW"), *results):
        assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMM is sm90's")
def test_fp8_weight_cache_refreshes_in_place():
    layer = gl.GroupedLinear(2, K, N, recipe=Float8Rowwise(), params_dtype=torch.bfloat16,
                             device="cuda")
    x = torch.randn(10, K, device="cuda", dtype=torch.bfloat16)
    first = layer(x, [4, 6], is_first_microbatch=True)
    cache = layer._fp8_weights.entry
    assert cache.route == "fp8_scaled_mm"
    pointers = [t.data_ptr() for t in cache.buffers()]
    with torch.no_grad():
        layer.weight.mul_(2.0)
    followed = layer(x, [4, 6], is_first_microbatch=False)  # the change is seen
    fresh = layer(x, [4, 6], is_first_microbatch=True)
    uncached = layer(x, [4, 6])
    assert torch.equal(followed, uncached) and torch.equal(fresh, uncached)
    assert not torch.equal(fresh, first)
    assert layer._fp8_weights.entry is cache
    assert [t.data_ptr() for t in cache.buffers()] == pointers


@pytest.mark.parametrize("recipe", DEVICE_RECIPES, ids=repr)
def test_fp8_step_in_cuda_graph(recipe):
    layer = gl.GroupedLinear(6, K, N, params_dtype=torch.bfloat16, device="cuda", recipe=recipe)
    # the cached FP8 weight must follow the weight, changed in place between replays
    check_layer_step_replays(layer, _tolerance(recipe), lambda lay, _: lay.weight.mul_(1.1),
                             forward_kwargs={"is_first_microbatch": True}, zeros_when_empty=True)


@pytest.mark.skipif(not TRITON_FP8, reason="needs FP8 tensor cores (sm89+)")
@pytest.mark.parametrize("split_kind", ["list", "cuda"])
def test_blockwise_runs_the_triton_gemms_and_matches_float64(split_kind):
    x = torch.randn(4, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, N, K, device="cuda", dtype=torch.bfloat16)
    assert fp8_route(Float8Blockwise(), x.device, x.dtype, K, N, w.shape[0]) == "fp8_blockwise"
    got, ref, _ = _step(Float8Blockwise(), split_kind)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, ref):
        err = rel_err(a, b)
        print(f"Float8Blockwise {split_kind} {name}: {err:.4f}")
        assert err < 4e-2, (name, err)
    assert torch.all(got[0][sum(SIZES):] == 0) and torch.all(got[1][sum(SIZES):] == 0)


@pytest.mark.skipif(not TRITON_FP8, reason="needs FP8 tensor cores (sm89+)")
def test_blockwise_beats_rowwise_on_outlier_channels_on_cuda():
    sizes, K_ = [96, 0, 160], 512
    x = torch.randn(sum(sizes), K_, device="cuda")
    w = torch.randn(3, 64, K_, device="cuda") / K_ ** 0.5
    x[:, :128] *= 1e4
    w[:, :, :128] /= 1e4
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    ref = reference_grads(x, w, None, sizes, torch.zeros(sum(sizes), 64))[0]
    err = {type(r).__name__: rel_err(gl.grouped_linear(x, w, None, sizes, recipe=r), ref)
           for r in (Float8Rowwise(), Float8Blockwise())}
    print("outlier channels x1e4:", err)
    assert err["Float8Blockwise"] < 4e-2 and err["Float8Blockwise"] < 0.85 * err["Float8Rowwise"]


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMM is sm90's")
@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise()])
def test_list_input_is_quantized_piece_by_piece(recipe, monkeypatch):
    """A list input takes the piece-by-piece quantization (no concatenation) and gives the
    tensor input's output and gradients; the pieces' gradients are views of one tensor."""
    from grouped_linear.kernels.quantize import rows as q
    from grouped_linear.kernels.quantize import transposed as qt
    calls = []
    for module, name in ((q, "quantize_rows_pieces"), (qt, "quantize_group_columns_t_pieces")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    G = len(SIZES)
    x = (torch.randn(sum(SIZES), K, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(G, N, K, device="cuda") / 16).to(torch.bfloat16)
    b = torch.randn(G, N, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(sum(SIZES), N, device="cuda").to(torch.bfloat16)
    results = []
    for as_list in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        inp = list(leaves[0].detach().split(SIZES)) if as_list else leaves[0]
        if as_list:
            inp = [piece.clone().requires_grad_() for piece in inp]
        y = gl.grouped_linear(inp, leaves[1], leaves[2], None if as_list else SIZES,
                              recipe=recipe)
        y.backward(grad_out)
        grad_x = torch.cat([piece.grad for piece in inp]) if as_list else leaves[0].grad
        results.append((y, grad_x, leaves[1].grad, leaves[2].grad))
    assert calls.count("quantize_rows_pieces") == 1
    # the wgrad reads the forward's FP8 rows, transposed: the pieces are not read again
    assert calls.count("quantize_group_columns_t_pieces") == 0
    for tensor_value, list_value in zip(*results, strict=True):
        assert rel_err(list_value, tensor_value) < 1e-6
    ref = reference_grads(x, w, b, SIZES, grad_out)
    for got, want in zip(results[1], ref, strict=True):
        assert rel_err(got, want) < _tolerance(recipe)


@pytest.mark.parametrize("recipe", DEVICE_RECIPES)
def test_save_original_input_keeps_x_and_no_fp8_copy_of_it(recipe):
    """``save_original_input=True``: backward keeps ``x`` itself (no FP8 copy of its rows);
    the output is the default's bit for bit, the input gradient too (the dgrad does not
    read x), and the weight gradient within the FP8 bound of float64."""
    torch.manual_seed(8)
    sizes = [300, 0, 200, 57]
    M = sum(sizes)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(sizes), N, K, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    splits = torch.tensor(sizes, device="cuda")
    grad_out = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    results = {}
    for keep in (False, True):
        saved, y = saved_by(lambda keep=keep: gl.grouped_linear(
            x, w, None, splits, recipe=recipe, save_original_input=keep))
        x.grad = w.grad = None
        y.backward(grad_out)
        fp8_rows = [t for t in saved if t.dtype.itemsize == 1 and t.shape[-1] in (K, M)
                    and t.numel() >= M * K]
        keeps_x = any(t.data_ptr() == x.data_ptr() and t.shape == x.shape
                      and t.dtype == x.dtype for t in saved)
        results[keep] = (y.detach(), x.grad, w.grad, keeps_x, fp8_rows)
    assert results[True][3] and not results[True][4]
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    want = reference_grads(x, w, None, sizes, grad_out)[2]
    assert rel_err(results[True][2], want) < _tolerance(recipe)


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMMs are sm90's")
@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise(), Float8Blockwise()])
def test_backward_frees_the_per_call_fp8_weight_after_the_dgrad(recipe):
    """A weight quantized for one call is released by backward once the dgrad has read it:
    what backward allocates above the forward's saved state (which holds that one-byte copy)
    stays below 1.5 bytes per weight although the weight gradient takes two: the copy is
    gone when the gradient is allocated (held, the peak would be two bytes per weight)."""
    torch.manual_seed(9)
    G, big, M = 8, 2048, 256
    x = torch.randn(M, big, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(G, big, big, device="cuda") / 64).to(torch.bfloat16).requires_grad_()
    splits = torch.full((G,), M // G, device="cuda")
    grad_out = torch.randn(M, big, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the second step with every kernel compiled and the grads allocated
        x.grad = w.grad = None
        y = gl.grouped_linear(x, w, None, splits, recipe=recipe)
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.backward(grad_out)
        torch.cuda.synchronize()
        above = torch.cuda.max_memory_allocated() - after_forward
    weights = w.numel()
    assert above < weights + weights // 2, (above, weights)
    want = reference_grads(x, w, None, [M // G] * G, grad_out)
    assert rel_err(w.grad, want[2]) < _tolerance(recipe)
    assert rel_err(x.grad, want[1]) < _tolerance(recipe)


@pytest.mark.skipif(not SM90, reason="the FP8 grouped GEMMs are sm90's")
@pytest.mark.parametrize("recipe", [Float8Rowwise(), Float8Tensorwise(), Float8Blockwise()])
def test_second_backward_of_a_retained_graph_quantizes_the_weight_again(recipe):
    """The first backward hands the forward's FP8 weight over and frees it; a second backward
    through the retained graph gets the same input gradient from a fresh quantization."""
    torch.manual_seed(10)
    sizes = [130, 0, 77, 300]
    M = sum(sizes)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(sizes), N, K, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    y = gl.grouped_linear(x, w, None, torch.tensor(sizes, device="cuda"), recipe=recipe)
    grad_out = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    first, = torch.autograd.grad(y, x, grad_out, retain_graph=True)
    second, = torch.autograd.grad(y, x, grad_out)
    assert torch.equal(first, second)
    want = reference_grads(x, w, None, sizes, grad_out)[1]
    assert rel_err(first, want) < _tolerance(recipe)
