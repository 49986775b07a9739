"""Bad input on CUDA (run by ``make test-gpu``): device split tensors with bad values (clamped on
the device without a host read; checked with ``GROUPED_LINEAR_DEBUG=1``), device mismatches,
more than 1,024 groups, and the FP8 weight cache after a refused call."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import grouped_linear as gl
from tests.bad_input import reference
from tests.bad_input.checks import Names, count, expect_rejected
from tests.gpu.test_grouped_linear_cuda import no_host_sync
from tests.reference import reference_grads, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

K, N = 64, 32
BF16 = torch.bfloat16
# Device split values no host split may hold: negative, past the rows, past int32.
BAD_DEVICE_SIZES = {
    "negative": [5, -3, 9, 0],
    "past the rows": [5, 40, 9, 0],
    "past int32": [5, 2**40, 9, 0],
    "short of the rows (a tail)": [5, 0, 3, 1],
}
ROWS = 20


def clamped_sizes(values: list[int], rows: int) -> list[int]:
    """The sizes the device sees: ``ends[g] = min(rows, sum(max(v, 0) for v <= g))``."""
    sizes, end = [], 0
    for value in values:
        new_end = min(rows, end + max(value, 0))
        sizes.append(new_end - end)
        end = new_end
    return sizes


@pytest.mark.parametrize("backend", ["auto", "grouped", "triton"])
@pytest.mark.parametrize("case", BAD_DEVICE_SIZES)
def test_bad_device_splits_are_clamped_without_a_host_read(case: str, backend: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GROUPED_LINEAR_DEBUG", raising=False)
    count("range")
    values = BAD_DEVICE_SIZES[case]
    sizes = clamped_sizes(values, ROWS)
    x = torch.randn(ROWS, K, device="cuda", dtype=BF16, requires_grad=True)
    w = (torch.randn(len(values), N, K, device="cuda", dtype=BF16) / 8).requires_grad_()
    b = torch.randn(len(values), N, device="cuda", dtype=BF16, requires_grad=True)
    splits = torch.tensor(values, device="cuda", dtype=torch.int64)
    grad = torch.randn(ROWS, N, device="cuda", dtype=BF16)
    with no_host_sync():
        y = gl.grouped_linear(x, w, b, splits, backend=backend)
        y.backward(grad)
    want = reference_grads(x, w, b, sizes, grad)
    for name, got, ref in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), want):
        assert rel_err(got, ref) < 1e-2, (name, rel_err(got, ref))


DEBUG_CALLS: dict[str, tuple[Callable[[torch.Tensor], object], Names]] = {
    "GroupedLinear": (lambda s: gl.GroupedLinear(4, K, N, device="cuda")(
        torch.randn(ROWS, K, device="cuda"), s), "m_splits"),
    "pad_groups": (lambda s: gl.pad_groups(torch.randn(ROWS, K, device="cuda"), s), "m_splits"),
    "unpad_groups": (lambda s: gl.unpad_groups(torch.randn(64, K, device="cuda"), s, torch.full(
        (4,), 16, device="cuda"), ROWS), "m_splits"),
}


@pytest.mark.parametrize("entry", DEBUG_CALLS)
@pytest.mark.parametrize("case", ["negative", "past the rows", "past int32"])
def test_bad_device_splits_are_refused_with_debug_checks(case: str, entry: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", "1")
    call, names = DEBUG_CALLS[entry]
    splits = torch.tensor(BAD_DEVICE_SIZES[case], device="cuda", dtype=torch.int64)
    expect_rejected("range", lambda: call(splits), names)


def test_bad_device_splits_refused_by_debug_checks_keep_the_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", "1")
    layer = gl.GroupedLinear(4, K, N, device="cuda", params_dtype=BF16, delay_wgrad_compute=True)
    x = torch.randn(ROWS, K, device="cuda", dtype=BF16, requires_grad=True)
    layer(x, torch.tensor([5, 5, 5, 5], device="cuda")).sum().backward()
    splits = torch.tensor(BAD_DEVICE_SIZES["negative"], device="cuda")
    expect_rejected("range", lambda: layer(x, splits), "m_splits", state=layer)


def test_bad_expert_indices_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropped without a host read; refused by name with the debug checks."""
    x = torch.randn(4, K, device="cuda", dtype=torch.float64)
    topk = torch.tensor([[0, 7], [2, -1], [1, 1], [-5, 2]], device="cuda")
    monkeypatch.delenv("GROUPED_LINEAR_DEBUG", raising=False)
    count("range")
    with no_host_sync():
        x_perm, m_splits, row_map = gl.permute(x, topk, 3)
    kept = torch.where((topk >= 0) & (topk < 3), topk, -1).cpu()
    x_ref, sizes_ref, map_ref = reference.permute(x.cpu(), kept, 3, 1)
    assert m_splits.tolist() == sizes_ref and row_map.tolist() == map_ref
    torch.testing.assert_close(x_perm[:x_ref.shape[0]].cpu(), x_ref, rtol=0, atol=0)
    assert bool((x_perm[x_ref.shape[0]:] == 0).all())
    monkeypatch.setenv("GROUPED_LINEAR_DEBUG", "1")
    expect_rejected("range", lambda: gl.permute(x, topk, 3), "topk_indices", value="7")


DEVICE_MISMATCHES: dict[str, tuple[Callable[[], object], Names]] = {
    "x on CUDA, layer on CPU": (lambda: gl.GroupedLinear(2, K, N)(
        torch.randn(4, K, device="cuda"), [2, 2]), ("x", "weight")),
    "m_splits on CUDA, x on CPU": (lambda: gl.GroupedLinear(2, K, N)(
        torch.randn(4, K), torch.tensor([2, 2], device="cuda")), "m_splits"),
    "bias on CPU": (lambda: gl.grouped_linear(
        torch.randn(4, K, device="cuda"), torch.randn(2, N, K, device="cuda"),
        torch.randn(2, N), [2, 2]), "bias"),
    "topk_indices on CPU": (lambda: gl.permute(
        torch.randn(4, K, device="cuda"), torch.zeros(4, 1, dtype=torch.int64), 2),
        "topk_indices"),
    "row_map on CPU": (lambda: gl.unpermute(
        torch.randn(4, K, device="cuda"), torch.zeros(4, 1, dtype=torch.int64)), "row_map"),
    "probs on CPU": (lambda: gl.unpermute(
        torch.randn(4, K, device="cuda"), torch.arange(4, device="cuda")[:, None],
        torch.ones(4, 1)), "probs"),
}


@pytest.mark.parametrize("case", DEVICE_MISMATCHES)
def test_device_mismatches_are_refused(case: str) -> None:
    call, names = DEVICE_MISMATCHES[case]
    expect_rejected("device", call, names)


def test_main_grad_on_the_wrong_device_is_refused() -> None:
    layer = gl.GroupedLinear(2, K, N, device="cuda", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    x = torch.randn(4, K, device="cuda", requires_grad=True)
    expect_rejected("device", lambda: layer(x, [2, 2]), "main_grad", state=layer)


# --------------------------------------------------------------------------- many groups
@pytest.mark.parametrize("split_kind", ["cuda", "list"])
@pytest.mark.parametrize("num_groups", [1025, 4096])
def test_more_than_1024_groups_with_backend_auto(num_groups: int, split_kind: str) -> None:
    """1025 groups stay on the Triton route (up to 4095), 4096 go past it; both equal the
    float64 reference, empty groups included."""
    count("valid")
    generator = torch.Generator().manual_seed(num_groups)
    sizes = torch.randint(0, 3, (num_groups,), generator=generator).tolist()
    rows = sum(sizes)
    x = torch.randn(rows, 16, device="cuda", dtype=BF16, requires_grad=True)
    w = (torch.randn(num_groups, 8, 16, device="cuda", dtype=BF16) / 4).requires_grad_()
    b = torch.randn(num_groups, 8, device="cuda", dtype=BF16, requires_grad=True)
    splits = torch.tensor(sizes, device="cuda") if split_kind == "cuda" else sizes
    grad = torch.randn(rows, 8, device="cuda", dtype=BF16)
    y = gl.GroupedLinear(num_groups, 16, 8, device="cuda", params_dtype=BF16)
    with torch.no_grad():
        y.weight.copy_(w)
        y.bias.copy_(b)
    out = y(x, splits)
    out.backward(grad)
    want = reference_grads(x, w, b, sizes, grad)
    for name, got, ref in zip(("y", "dx", "dW", "db"),
                              (out, x.grad, y.weight.grad, y.bias.grad), want):
        assert rel_err(got, ref) < 1e-2, (name, rel_err(got, ref))


def test_permute_with_more_than_1024_experts() -> None:
    count("valid")
    topk = torch.randint(-1, 1500, (300, 2), device="cuda")
    x = torch.randn(300, 4, device="cuda", dtype=torch.float64)
    x_perm, m_splits, row_map = gl.permute(x, topk, 1500, multiple=2)
    x_ref, sizes_ref, map_ref = reference.permute(x.cpu(), topk.cpu(), 1500, 2)
    assert m_splits.tolist() == sizes_ref and row_map.tolist() == map_ref
    torch.testing.assert_close(x_perm[:x_ref.shape[0]].cpu(), x_ref, rtol=0, atol=0)


# --------------------------------------------------------------------------- FP8 weight cache
FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
FP8_BAD_CALLS: dict[str, tuple[str, Callable[[], tuple], Names]] = {
    "m_splits sum": ("range", lambda: (torch.randn(8, 128, device="cuda", dtype=BF16),
                                       [4, 0, 3], {}), "m_splits"),
    "m_splits numpy bool": ("type", lambda: (torch.randn(8, 128, device="cuda", dtype=BF16),
                                             [4, np.bool_(False), 4], {}), "m_splits"),
    "x wrong features": ("shape", lambda: (torch.randn(8, 64, device="cuda", dtype=BF16),
                                           [4, 0, 4], {}), "x"),
    "x on CPU": ("device", lambda: (torch.randn(8, 128, dtype=BF16), [4, 0, 4], {}), "x"),
    "x=[]": ("shape", lambda: ([], [4, 0, 4], {}), "x"),
    "is_first_microbatch=str": ("type", lambda: (torch.randn(8, 128, device="cuda", dtype=BF16),
                                                 [4, 0, 4], {"is_first_microbatch": "yes"}),
                                "is_first_microbatch"),
}


@pytest.mark.skipif(not FP8, reason="needs FP8 tensor cores (sm89+)")
@pytest.mark.parametrize("recipe", [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
                                    gl.recipes.Float8Blockwise()], ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("case", FP8_BAD_CALLS)
def test_a_refused_call_keeps_the_fp8_weight_cache(case: str, recipe: object) -> None:
    kind, make, names = FP8_BAD_CALLS[case]
    layer = gl.GroupedLinear(3, 128, 128, device="cuda", params_dtype=BF16, recipe=recipe)
    x = torch.randn(8, 128, device="cuda", dtype=BF16)
    splits = torch.tensor([4, 0, 4], device="cuda")
    with torch.no_grad():
        layer(x, splits, is_first_microbatch=True)
        layer.weight.mul_(2)
        reused = layer(x, splits, is_first_microbatch=False)
    bad_x, m_splits, kwargs = make()
    kwargs = {"is_first_microbatch": True} | kwargs
    expect_rejected(kind, lambda: layer(bad_x, m_splits, **kwargs), names, state=layer)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, splits, is_first_microbatch=False), reused,
                                   rtol=0, atol=0)
