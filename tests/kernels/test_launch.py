"""The launch wrapper of the Triton kernels (kernels/_triton.py) off the GPU: under the CPU
interpreter every launch takes Triton's own path, and the wrapper passes the JIT function's
attributes through (the sm90 compile test reads them)."""

import pytest
import torch

from grouped_linear.kernels import _triton
from grouped_linear.kernels._triton import HAS_TRITON, interpreting, triton
from grouped_linear.kernels.gemm import triton_gemm

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def test_wrapper_exposes_the_jit_function():
    kernel = triton_gemm._grouped_mm_kernel
    assert kernel.jit_fn is not kernel
    assert kernel.fn is kernel.jit_fn.fn  # the Python function under the JIT
    assert getattr(kernel, "params", None) is getattr(kernel.jit_fn, "params", None)


@pytest.mark.skipif(not interpreting() or torch.cuda.is_available(),
                    reason="the interpreter path (CPU CI)")
def test_interpreted_launches_are_not_cached():
    kernel = triton_gemm._grouped_mm_kernel
    kernel._compiled.clear()
    x = torch.randn(12, 16)
    weight = torch.randn(2, 8, 16)
    out = triton_gemm.forward(x, weight, None, torch.tensor([5, 7]))
    torch.testing.assert_close(out[:5], x[:5] @ weight[0].t())
    torch.testing.assert_close(out[5:], x[5:] @ weight[1].t())
    assert kernel._compiled == {} and kernel.cached


# --------------------------------------------------------------------------- launch plans
class _Launcher:
    """Stands in for Triton's C launcher: records each call's arguments (and counts the
    calls it rejects)."""

    def __init__(self, error=None):
        self.calls = []
        self.rejected = 0
        self.error = error

    def __call__(self, *args):
        if self.error is not None:
            self.rejected += 1
            raise self.error
        self.calls.append(args)


def _plan(monkeypatch, launcher, device=0):
    """A plan over (tensor, int, tensor, constexpr) with the first tensor's binary assuming a
    16-byte aligned address, the second not; the current device is 0."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    middle = ("function", False, False, None, None, "metadata", None, None, None)
    return _triton.LaunchPlan(launcher, (7, 1, 1), middle, [None, 40, None, 64], (0, 2),
                              (True, False), device)


def test_plan_passes_addresses_in_the_tensor_slots(monkeypatch):
    launcher = _Launcher()
    plan = _plan(monkeypatch, launcher)
    a, b = torch.zeros(8), torch.zeros(8)
    assert plan(a, b) is True
    (args,) = launcher.calls
    assert args == (7, 1, 1, 1234, "function", False, False, None, None, "metadata", None, None,
                     None, a.data_ptr(), 40, b.data_ptr(), 64)


def test_plan_declines_what_its_binary_cannot_take(monkeypatch):
    """A misaligned address where the binary assumed alignment, another current device, or
    a launch hook set (a profiler): ``False`` and nothing launched; a misaligned address
    where the binary assumed none launches. The wrong number of tensors is a TypeError."""
    launcher = _Launcher()
    plan = _plan(monkeypatch, launcher)
    base = torch.zeros(16)
    shifted = base[1:]  # 4 bytes past a 16-byte aligned address
    assert shifted.data_ptr() % 16
    assert plan(shifted, base) is False
    assert plan(base, shifted) is True and len(launcher.calls) == 1
    with pytest.raises(TypeError, match="takes 2 tensors, got 1"):
        plan(base)
    other_device = _plan(monkeypatch, launcher, device=1)
    assert other_device(base, base) is False
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(*args):
        pass

    hooks.add(hook)
    try:
        assert plan(base, base) is False and len(launcher.calls) == 1
    finally:
        hooks.remove(hook)
    assert plan(base, base) is True and len(launcher.calls) == 2


def test_plan_turns_itself_off_when_the_launcher_rejects_it(monkeypatch):
    launcher = _Launcher(TypeError("function takes exactly 40 arguments"))
    plan = _plan(monkeypatch, launcher)
    assert plan(torch.zeros(4), torch.zeros(4)) is False
    assert plan(torch.zeros(4), torch.zeros(4)) is False  # not offered to the launcher again
    assert launcher.rejected == 1
