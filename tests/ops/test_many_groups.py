"""Past 1024 groups on the Triton side: the ``triton`` backend's forward and backward against
float64, and the group helpers that hand more than 1024 groups to torch (kernels/ends.py,
kernels/bias.py) against independent sums, with the Triton kernels on (CUDA where there is
one, else Triton's CPU interpreter)."""

import itertools

import pytest
import torch

import grouped_linear as gl
from grouped_linear.kernels import bias as bias_kernels
from grouped_linear.kernels import ends as ends_kernels
from grouped_linear.kernels._triton import HAS_TRITON, interpreting
from grouped_linear.ops.dispatch import TORCH_GROUPED_MAX_GROUPS
from tests.reference import gathered_reference, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not interpreting()),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
TRITON_GROUPS = 1024  # the most groups the helpers' one-program kernels scan


def _spread(rows: int, groups: int) -> list[int]:
    """``rows`` spread over ``groups``, most of them empty when groups outnumber rows."""
    sizes = [0] * groups
    for i in range(rows):
        sizes[(i * 7919) % groups] += 1
    return sizes


class _Launches:
    """Stands in for a Triton kernel: counts its launches and runs the kernel (or, with
    ``run=False``, nothing)."""

    def __init__(self, kernel, run: bool) -> None:
        self.kernel, self.run, self.count = kernel, run, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid] if self.run else lambda *args, **kwargs: None


def _spy(monkeypatch, module, name: str, run: bool = True) -> _Launches:
    launches = _Launches(getattr(module, name), run)
    monkeypatch.setattr(module, name, launches)
    return launches


def test_triton_backend_past_torch_group_limit():
    """1100 groups (more than torch's CUDA grouped GEMM takes, a group table of 2048 slots)
    with tensor splits: output and gradients within float32 rounding of float64, empty
    groups' weight and bias gradients exactly zero."""
    G, K, N, rows = 1100, 16, 8, 40
    assert G > TORCH_GROUPED_MAX_GROUPS
    sizes = _spread(rows, G)
    x = torch.randn(rows, K, device=DEVICE, requires_grad=True)
    w = torch.randn(G, N, K, device=DEVICE, requires_grad=True)
    b = torch.randn(G, N, device=DEVICE, requires_grad=True)
    y = gl.grouped_linear(x, w, b, torch.tensor(sizes, device=DEVICE), backend="triton")
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    ref = gathered_reference(x, w, b, sizes, grad_out)
    for name, got, want in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad), ref):
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))
    empty = torch.tensor(sizes, device=DEVICE) == 0
    assert int(empty.sum()) > G - rows - 1
    assert torch.all(w.grad[empty] == 0) and torch.all(b.grad[empty] == 0)


def _splits(groups: int) -> tuple[torch.Tensor, int]:
    """Split sizes with negative entries (counted as 0) summing past the rows, and the rows:
    the ends clamp at both."""
    sizes = [(g * 37) % 5 - 1 for g in range(groups)]
    rows = sum(max(s, 0) for s in sizes) - 7
    return torch.tensor(sizes, device=DEVICE), rows


@pytest.mark.parametrize("groups", [TRITON_GROUPS, TRITON_GROUPS + 1, 4097])
def test_group_ends_and_aligned_ends(groups, monkeypatch):
    """The kernels up to 1024 groups, torch's cumulative sums past them (no kernel launched),
    either equal to the ends summed here one group at a time."""
    splits, rows = _splits(groups)
    ends_launches = _spy(monkeypatch, ends_kernels, "_group_ends_kernel")
    aligned_launches = _spy(monkeypatch, ends_kernels, "_aligned_ends_kernel")
    ends = ends_kernels.group_ends(splits, rows)
    want = [min(e, rows) for e in itertools.accumulate(max(s, 0) for s in splits.tolist())]
    assert ends.dtype == torch.int32 and ends.tolist() == want
    assert torch.equal(ends, ends_kernels.group_ends_reference(splits, rows))
    for align in (16, 128):
        aligned = ends_kernels.aligned_ends(ends, align)
        sizes = [e - s for s, e in zip([0, *want[:-1]], want)]
        want_aligned = list(itertools.accumulate(-(-size // align) * align for size in sizes))
        assert aligned.dtype == torch.int32 and aligned.tolist() == want_aligned
        assert torch.equal(aligned, ends_kernels.aligned_ends_reference(ends, align))
    on_triton = groups <= TRITON_GROUPS
    assert (ends_launches.count, aligned_launches.count) == ((1, 2) if on_triton else (0, 0))


def _bias_grad_inputs(groups: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Sizes over 300 rows, their ends, and a gradient of 5 rows more (past the groups)."""
    sizes = _spread(300, groups)
    ends = torch.tensor(list(itertools.accumulate(sizes)), device=DEVICE, dtype=torch.int32)
    return sizes, ends, torch.randn(305, 8, device=DEVICE)


def test_bias_grad_runs_its_kernels_up_to_1024_groups(monkeypatch):
    """At 1024 groups the chunked kernels are launched (not run here: 2048 programs, each
    scanning the group table, take half a minute under the interpreter)."""
    _, ends, grad_out = _bias_grad_inputs(TRITON_GROUPS)
    partial = _spy(monkeypatch, bias_kernels, "_bias_grad_partial_kernel", run=False)
    reduce = _spy(monkeypatch, bias_kernels, "_bias_grad_reduce_kernel", run=False)
    assert bias_kernels.bias_grad(grad_out, ends, torch.float32).shape == (TRITON_GROUPS, 8)
    assert (partial.count, reduce.count) == (1, 1)


@pytest.mark.parametrize("groups", [TRITON_GROUPS + 1, 4097, 65536])
def test_bias_grad_past_1024_groups(groups, monkeypatch):
    """Per-group column sums of the gradient (rows past the groups ignored, empty groups
    zero) from torch's segmented sum, no kernel launched: within float32 rounding of the
    float64 sums."""
    sizes, ends, grad_out = _bias_grad_inputs(groups)
    rows, N = sum(sizes), grad_out.shape[1]
    partial = _spy(monkeypatch, bias_kernels, "_bias_grad_partial_kernel")
    reduce = _spy(monkeypatch, bias_kernels, "_bias_grad_reduce_kernel")
    got = bias_kernels.bias_grad(grad_out, ends, torch.float32)
    groups_of_rows = torch.repeat_interleave(torch.arange(groups), torch.tensor(sizes))
    want = torch.zeros(groups, N, dtype=torch.float64).index_add_(
        0, groups_of_rows, grad_out[:rows].double().cpu())
    assert got.shape == (groups, N) and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-6
    assert torch.all(got[torch.tensor(sizes, device=DEVICE) == 0] == 0)
    assert rel_err(got, bias_kernels.bias_grad_reference(grad_out, ends, torch.float32)) < 1e-6
    assert (partial.count, reduce.count) == (0, 0)
