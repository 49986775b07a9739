"""The cached launch path of the Triton kernels (kernels/_triton.py) on CUDA."""

import pytest
import torch

from grouped_linear.kernels._triton import PlanCache, triton
from grouped_linear.kernels.gemm import triton_gemm
from tests.reference import grouped_linear_ref, reference_grads, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _forward(x, weight, sizes):
    got = triton_gemm.forward(x, weight, None, sizes)
    want = grouped_linear_ref(x.double(), weight.double(), None, sizes.tolist())
    return rel_err(got, want)


def test_cached_launches_follow_the_argument_specialization():
    """Aligned and misaligned inputs, repeated: each specialization gets its own binary and
    every launch, cached or not, gives the reference result; the cached path is taken."""
    torch.manual_seed(0)
    kernel = triton_gemm._grouped_mm_kernel
    kernel._compiled.clear()
    runs = []
    weight = torch.randn(3, 48, 64, device="cuda") / 8
    sizes = torch.tensor([5, 0, 27], device="cuda")
    base = torch.randn(33, 64, device="cuda")
    for _ in range(3):
        aligned = base[:32]            # 16-byte aligned data pointer, rows of 64
        shifted = base.view(-1)[1:1 + 32 * 63].view(32, 63)  # odd pointer and width
        assert _forward(aligned, weight, sizes) < 1e-5
        runs.append(len(kernel._compiled))
        assert _forward(shifted, weight[:, :, :63].contiguous(), sizes) < 1e-5
    assert runs[-1] == 2 and len(kernel._compiled) == 2


def test_tritons_own_launch_gives_the_same_result():
    torch.manual_seed(1)
    x = torch.randn(40, 32, device="cuda")
    weight = torch.randn(2, 16, 32, device="cuda")
    sizes = torch.tensor([17, 23], device="cuda")
    slow = x.new_empty(40, 16)
    strides = (weight.stride(0), weight.stride(2), weight.stride(1))
    grid, args, meta = triton_gemm._mm_launch(x, weight, strides, None, sizes, slow, 32)
    triton_gemm._grouped_mm_kernel.jit_fn[grid](*args, **meta)
    fast = triton_gemm.forward(x, weight, None, sizes)
    fast = triton_gemm.forward(x, weight, None, sizes)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)


# --------------------------------------------------------------------------- launch plans
def _no_binding(monkeypatch, kernel):
    """Make every launch of ``kernel`` that is not a plan's fail."""
    def refuse(*args, **kwargs):
        raise AssertionError("launched through Triton's argument binding")

    monkeypatch.setattr(kernel, "_run", refuse)


def test_forward_plan_launches_again_without_binding(monkeypatch):
    """The second forward on a geometry launches the plan the first one left (the binding
    path is made to fail), and both give the reference; a new geometry gets its own plan."""
    torch.manual_seed(2)
    triton_gemm._PLANS.clear()
    weight = torch.randn(3, 48, 64, device="cuda", dtype=torch.bfloat16) / 8
    bias = torch.randn(3, 48, device="cuda", dtype=torch.bfloat16)
    sizes = torch.tensor([5, 0, 27], device="cuda")
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    first = triton_gemm.forward(x, weight, bias, sizes)
    assert len(triton_gemm._PLANS) == 1
    with monkeypatch.context() as patch:
        _no_binding(patch, triton_gemm._grouped_mm_kernel)
        x2 = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
        second = triton_gemm.forward(x2, weight, bias, torch.tensor([20, 20, 0], device="cuda"))
    for got, inp, split in ((first, x, [5, 0, 27]), (second, x2, [20, 20, 0])):
        want = grouped_linear_ref(inp.double(), weight.double(), bias.double(), split)
        assert rel_err(got, want) < 1e-2
    triton_gemm.forward(x[:33], weight, bias, sizes)
    assert len(triton_gemm._PLANS) == 2


def test_plan_refuses_a_misaligned_address_it_was_not_built_for():
    """Same shapes and strides, a data pointer 2 bytes off: a plan built on an aligned input
    hands the launch back to Triton (which picks an unaligned binary); one built on the
    misaligned input launches aligned ones too. Every result matches the reference."""
    torch.manual_seed(3)
    weight = torch.randn(2, 32, 64, device="cuda", dtype=torch.bfloat16) / 8
    sizes = torch.tensor([10, 14], device="cuda")
    base = torch.randn(24 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    aligned = base[:24 * 64].view(24, 64)
    shifted = base[1:].view(24, 64)
    assert aligned.stride() == shifted.stride() and shifted.data_ptr() % 16 == 2
    for order in ((aligned, shifted, aligned), (shifted, aligned, shifted)):
        triton_gemm._PLANS.clear()
        for x in order:
            got = triton_gemm.forward(x, weight, None, sizes)
            want = grouped_linear_ref(x.double(), weight.double(), None, [10, 14])
            assert rel_err(got, want) < 1e-2
        assert len(triton_gemm._PLANS) == 1


def test_backward_plan_matches_the_reference(monkeypatch):
    torch.manual_seed(4)
    triton_gemm._PLANS.clear()
    G, N, K, M = 3, 32, 48, 50
    weight = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) / 8
    sizes = torch.tensor([7, 0, 30], device="cuda")  # 13 tail rows
    results = []
    for step in range(3):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        with monkeypatch.context() as patch:
            if step:
                _no_binding(patch, triton_gemm._grouped_backward_kernel)
            results.append((x, grad, triton_gemm.backward(grad, x, weight, sizes, True)))
    for x, grad, (grad_x, grad_w, grad_b) in results:
        gd, xd = grad.double(), x.double()
        want_x = torch.zeros(M, K, dtype=torch.float64, device="cuda")
        want_w = torch.zeros(G, N, K, dtype=torch.float64, device="cuda")
        want_b = torch.zeros(G, N, dtype=torch.float64, device="cuda")
        start = 0
        for g, size in enumerate([7, 0, 30]):
            rows = slice(start, start + size)
            want_x[rows] = gd[rows] @ weight[g].double()
            want_w[g] = gd[rows].t() @ xd[rows]
            want_b[g] = gd[rows].sum(0)
            start += size
        assert rel_err(grad_x, want_x) < 1e-2
        assert rel_err(grad_w, want_w) < 1e-2
        assert rel_err(grad_b, want_b) < 1e-2
        assert grad_b.dtype == torch.bfloat16


def test_plans_step_aside_for_launch_hooks_and_stay_bounded(monkeypatch):
    bound = 8  # the cache's size below, reached in 16 calls
    monkeypatch.setattr(triton_gemm, "_PLANS", PlanCache(size=bound))
    torch.manual_seed(5)
    weight = torch.randn(2, 16, 32, device="cuda")
    sizes = torch.tensor([9, 11], device="cuda")
    x = torch.randn(20, 32, device="cuda")
    want = triton_gemm.forward(x, weight, None, sizes)
    assert rel_err(want, grouped_linear_ref(x.double(), weight.double(), None, [9, 11])) < 1e-5
    (plan,) = triton_gemm._PLANS._plans.values()
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(*args):
        pass

    hooks.add(hook)  # a profiler's hook: launches go through Triton, which calls it
    try:
        assert plan(x, weight, want, want, sizes) is False
        torch.testing.assert_close(triton_gemm.forward(x, weight, None, sizes), want, rtol=0,
                                   atol=0)
    finally:
        hooks.remove(hook)
    with pytest.raises(TypeError, match="takes 5 tensors, got 2"):
        plan(x, weight)
    wide = torch.randn(bound + 8, 32, device="cuda")
    for rows in range(1, bound + 8):  # one geometry (and plan) per row count
        triton_gemm.forward(wide[:rows], weight, None, sizes)
        assert len(triton_gemm._PLANS) <= bound


# --------------------------------------------------------------------------- Gluon kernels
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0), reason="needs sm90")
def test_gluon_kernels_take_the_cached_launch_path():
    """The Gluon GEMM's later launches of a specialization go through its launch plan (the
    descriptors encoded once, by the plan); their outputs equal those of Triton's own
    launch, bit for bit."""
    from grouped_linear.kernels.gemm import gluon_gemm

    torch.manual_seed(5)
    kernel = gluon_gemm._mm_kernel
    kernel._compiled.clear()
    x = torch.randn(700, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3, 512, 256, device="cuda", dtype=torch.bfloat16) / 16
    bias = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([300, 300, 650], device="cuda", dtype=torch.int32)
    assert gluon_gemm.supported(x, weight)
    gluon_gemm._PLANS.clear()
    cached = [gluon_gemm.grouped_mm(x, weight, ends, bias) for _ in range(3)]
    assert len(kernel._compiled) == 1 and kernel.cached
    gluon_gemm._PLANS.clear()  # the next launch through the kernel, not a plan
    real = kernel._run
    calls = []

    def own_path(grid, args, meta):
        calls.append(grid)
        return kernel.jit_fn[grid](*args, **meta), None

    kernel._run = own_path
    try:
        slow = gluon_gemm.grouped_mm(x, weight, ends, bias)
    finally:
        kernel._run = real
    assert calls
    want = gluon_gemm.grouped_mm_reference(x, weight, ends, bias)
    for got in cached:
        assert torch.equal(got, slow)
    assert rel_err(slow, want) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0), reason="needs sm90")
@pytest.mark.parametrize("planned", [False, True])
def test_descriptor_launch_from_a_thread_no_cuda_call_has_touched(planned):
    """Triton encodes TMA descriptors before its launcher makes a context current: the
    first descriptor launch of a fresh thread (autograd's backward thread, when every
    allocation comes from the cache) binds one first, through Triton's launch and through
    a plan encoding a new address alike. The thread's values equal the two-pass reference's."""
    import threading

    from grouped_linear.kernels.quantize import blocks_gluon
    from tests.kernels.quantize.test_blocks_gluon import two_passes

    torch.manual_seed(6)
    t = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)  # a new address
    sizes = torch.tensor([100, 0, 200], device="cuda", dtype=torch.int32)
    kernel = blocks_gluon._quantize_both_kernel
    assert blocks_gluon.supported(t, 3)
    kernel._plans.clear()
    kernel._seen.clear()

    def quantize(rows):
        return blocks_gluon.quantize_row_tiles_and_token_blocks(rows, sizes, torch.float8_e4m3fn,
                                                                False)

    quantize(other)  # the kernel's first sight of this launch
    if planned:
        quantize(t)  # seen twice: planned, with t's descriptor encoded (not other's)
    else:
        kernel._plans.clear()
        kernel._seen.clear()
    torch.cuda.synchronize()  # the outputs' blocks are back in the cache for the thread
    results = []

    def run():
        try:
            results.append([v for pair in quantize(other) for v in pair])
        except Exception as error:  # noqa: BLE001 - handed to the test's thread
            results.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    got = results[0]
    assert not isinstance(got, Exception), got
    want = [v for pair in two_passes(other, sizes, torch.float8_e4m3fn, False) for v in pair]
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


@pytest.mark.parametrize("launch", ["one launch", "wgrad", "wgrad, small groups"])
def test_weight_gradients_repeat_bit_for_bit(launch):
    """No reduction of the Triton backward depends on timing: 200 repeats (a GEMM on a
    side stream beside every other one) give the first result bit for bit, and that one is
    the reference's. A pipelined tile overwritten while an MMA still reads it (a race)
    shows here as a tile that differs now and then."""
    torch.manual_seed(7)
    sizes_list = [300, 0, 1, 517, 64, 0, 129, 1000]
    rows, K, N = sum(sizes_list) + 3, 256, 384
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(len(sizes_list), N, K, device="cuda", dtype=torch.bfloat16) / 16
    sizes = torch.tensor(sizes_list, device="cuda")
    if launch == "one launch":
        def run():
            return triton_gemm.backward(dy, x, weight, sizes, True, one_launch=True)
    else:
        tile = triton_gemm.WGRAD_TILE if launch == "wgrad" else triton_gemm.SMALL_GROUPS_TILE

        def run():
            return triton_gemm.wgrad(dy, x, sizes, True, tile=tile)
    first = [t.clone() for t in run()]
    side, load = torch.cuda.Stream(), torch.randn(2048, 2048, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    differing = 0
    for i in range(200):
        if i % 2:
            with torch.cuda.stream(side):
                load @ load
        differing += not all(torch.equal(a, b) for a, b in zip(run(), first))
    assert differing == 0, f"{differing} of 200 repeats differ"
    bias = torch.zeros(len(sizes_list), N, device="cuda", dtype=torch.bfloat16)
    _, _, want_w, want_b = reference_grads(x, weight, bias, sizes_list, dy)
    assert rel_err(first[-2], want_w) < 1e-2 and rel_err(first[-1], want_b) < 1e-2
