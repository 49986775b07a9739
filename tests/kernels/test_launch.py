"""The launch wrapper of the Triton kernels (kernels/_triton.py) off the GPU: under the CPU
interpreter every launch takes Triton's own path, and the wrapper passes the JIT function's
attributes through (the sm90 compile test reads them)."""

from types import SimpleNamespace

import pytest
import torch

from grouped_linear.kernels import _gluon, _triton
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


class _Descriptor:
    """Stands in for a host TMA descriptor: a tensor and a block."""

    def __init__(self, base):
        self.base = base
        self.block_shape = [2, 2]


class _Compiled:
    """Stands in for a compiled kernel: its launcher (``run.launch``) and metadata."""

    def __init__(self, launcher):
        self.function = "function"
        self.packed_metadata = "metadata"
        self.run = SimpleNamespace(launch=launcher, global_scratch_size=0, profile_scratch_size=0,
                                   launch_cooperative_grid=False, launch_pdl=False)


def test_plan_takes_descriptors_in_their_places(monkeypatch):
    """A TMA descriptor among the bound arguments is a slot of the plan: the launcher gets
    the new descriptor itself (it encodes the address), a tensor its address; a descriptor
    of a misaligned tensor is declined where the binary assumed alignment."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    launcher = _Launcher()
    first = torch.zeros(16)
    bound = {"a_desc": _Descriptor(first), "out_ptr": torch.zeros(8), "M": 40, "BLOCK": 64}
    plan = _triton.LaunchPlan.build(_Compiled(launcher), (3,), 0, bound, positions=(0, 1))
    descriptor, out = _Descriptor(torch.zeros(16)), torch.zeros(8)
    assert plan(descriptor, out) is True
    (args,) = launcher.calls
    assert args[:4] == (3, 1, 1, 1234)
    assert args[-4:] == (descriptor, out.data_ptr(), 40, 64)
    assert plan(_Descriptor(first[1:]), out) is False and len(launcher.calls) == 1


def test_plan_cache_launches_from_the_keys_plan(monkeypatch):
    """The first launch of a key goes through the kernel and keeps its plan; the next ones
    launch from the plan (the kernel not called); a full cache starts over."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    launcher = _Launcher()
    planned = []

    class Kernel:
        def launch_planned(self, grid, args, meta):
            planned.append(args)
            bound = {"x": args[0], "n": args[1], **meta}
            return _triton.LaunchPlan.build(_Compiled(launcher), grid, 0, bound,
                                            positions=(0,))

    cache = _triton.PlanCache(size=2)

    def launch(key, args):  # as the Gluon GEMM and wgrad launch
        if not cache.try_launch(key, args):
            cache.keep(key, Kernel().launch_planned((5,), args, {"C": 2}))

    x, y = torch.zeros(4), torch.zeros(4)
    launch(("k", 1), (x, 1))
    launch(("k", 1), (y, 1))
    assert len(planned) == 1 and launcher.calls == [(5, 1, 1, 1234, "function", False, False,
                                                     None, None, "metadata", None, None, None,
                                                     y.data_ptr(), 1, 2)]
    launch(("k", 2), (x, 2))
    launch(("k", 3), (x, 3))  # full: starts over
    launch(("k", 1), (x, 1))
    assert len(planned) == 4


class _TmaDescriptor(_Descriptor):
    """A host TMA descriptor as Triton's: a tensor, its shape and strides, a padding."""

    def __init__(self, base, shape=(4, 4)):
        super().__init__(base)
        self.shape = list(shape)
        self.strides = [shape[1], 1]
        self.padding = "zero"


def _descriptor_wrapper(launcher, tensordesc_meta):
    """A launch function shaped as Triton's wrapper that encodes descriptors before its C
    launcher (its closure names the launcher and the descriptors' metadata)."""

    def inner(*args):
        raise AssertionError(f"the plan should call {launcher} with {tensordesc_meta} itself")

    return inner


def test_plan_encodes_each_descriptor_once_per_geometry(monkeypatch):
    """Behind Triton's encoding wrapper the plan calls the C launcher itself, each descriptor
    expanded in its place (encoded map, shape, strides), and encodes a descriptor only for a
    new address or geometry."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    encoded = []

    def encode(descriptor, meta):
        encoded.append((descriptor.base.data_ptr(), tuple(descriptor.shape)))
        return [("map", descriptor.base.data_ptr(), meta["swizzle"]), *descriptor.shape,
                *descriptor.strides]

    monkeypatch.setattr(_triton, "_ENCODE", [encode])
    launcher = _Launcher()
    first, second = torch.zeros(64), torch.zeros(64)
    compiled = _Compiled(_descriptor_wrapper(launcher, [{"swizzle": 128}]))
    bound = {"a_desc": _TmaDescriptor(first), "out_ptr": torch.zeros(8), "M": 40, "BLOCK": 64}
    plan = _triton.LaunchPlan.build(compiled, (3,), 0, bound, positions=(0, 1))
    assert encoded == [(first.data_ptr(), (4, 4))]  # the width of its arguments, once
    out = torch.zeros(8)
    for base in (first, second, first, second):
        assert plan(_TmaDescriptor(base), out) is True
    assert plan(_TmaDescriptor(first, shape=(2, 8)), out) is True
    assert encoded == [(first.data_ptr(), (4, 4)), (second.data_ptr(), (4, 4)),
                       (first.data_ptr(), (2, 8))]
    assert [args[13:] for args in launcher.calls[:2]] == [
        (("map", first.data_ptr(), 128), 4, 4, 4, 1, out.data_ptr(), 40, 64),
        (("map", second.data_ptr(), 128), 4, 4, 4, 1, out.data_ptr(), 40, 64)]
    assert launcher.calls[-1][13:18] == (("map", first.data_ptr(), 128), 2, 8, 8, 1)
    assert plan(_TmaDescriptor(first[1:]), out) is False  # misaligned: declined, not encoded
    assert len(encoded) == 3


def test_plan_leaves_unknown_launchers_to_encode():
    """A launcher that is not Triton's encoding wrapper (or whose descriptors are not lowered
    to TMA: metadata ``None``) encodes its descriptors itself."""
    assert _triton._unwrap_descriptor_launch(_Launcher()) is None
    assert _triton._unwrap_descriptor_launch(_descriptor_wrapper(_Launcher(), [None])) is None
    assert _triton._unwrap_descriptor_launch(lambda *args: None) is None


def test_unwraps_tritons_own_encoding_wrapper():
    """The wrapper this Triton builds around a launcher of a descriptor-taking kernel is the
    one the plan recognizes (the launcher and the metadata come back)."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    launcher, metas = _Launcher(), [{"swizzle": 128, "elem_size": 2, "elem_type": 1,
                                     "block_size": [128, 64], "fp4_padded": False}]
    wrapped = driver.wrap_handle_tensordesc(
        launcher, {"a_desc": "tensordesc<bf16[128, 64]>", "M": "i32"}, metas)
    assert wrapped is not launcher
    assert _triton._unwrap_descriptor_launch(wrapped) == (launcher, metas)


def test_plan_takes_the_tensors_from_the_launch_arguments_by_position(monkeypatch):
    """A plan built with the positions of the tensor arguments launches from a full argument
    tuple (integers and all) on the tensors at those positions; the cache's ``try_launch``
    says whether a plan launched."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    launcher = _Launcher()
    x, out = torch.zeros(4), torch.zeros(8)
    bound = {"x": x, "n": 3, "out": out, "m": 5, "BLOCK": 64}
    plan = _triton.LaunchPlan.build(_Compiled(launcher), (2,), 0, bound, positions=(0, 2))
    y, other = torch.zeros(4), torch.zeros(8)
    assert plan.launch_from((y, 3, other, 5)) is True
    assert launcher.calls[-1][13:] == (y.data_ptr(), 3, other.data_ptr(), 5, 64)
    single = _triton.LaunchPlan.build(_Compiled(launcher), (2,), 0, {"x": x, "n": 3},
                                      positions=(0,))
    assert single.launch_from((y, 3)) is True and launcher.calls[-1][13:] == (y.data_ptr(), 3)
    calls = len(launcher.calls)  # a tensor passed by keyword: the arguments do not hold it
    by_keyword = _triton.LaunchPlan.build(_Compiled(launcher), (2,), 0, bound, positions=(0,))
    assert by_keyword.launch_from((y, 3, other, 5)) is False and len(launcher.calls) == calls
    cache = _triton.PlanCache()
    assert cache.try_launch(("k",), (y, 3, other, 5)) is False  # no plan yet
    cache.keep(("k",), plan)
    assert cache.try_launch(("k",), (other, 3, y, 5)) is True
    assert launcher.calls[-1][13:] == (other.data_ptr(), 3, y.data_ptr(), 5, 64)


@pytest.mark.skipif(not _gluon.HAS_GLUON, reason="needs Gluon")
def test_descriptor_is_tritons_and_checks_what_tma_needs():
    """The descriptor equals Triton's own construction of it; a start off 16 bytes, rows not
    in whole 16 bytes, a column stride or an empty dimension raise ValueError."""
    t = torch.zeros(64, 32, dtype=torch.bfloat16)
    ours = _gluon.descriptor(t, 16, 32)
    theirs = _gluon.TensorDescriptor(t, [64, 32], [32, 1], [16, 32], ours.layout)
    assert type(ours) is type(theirs) and ours == theirs
    base = torch.zeros(4096, dtype=torch.bfloat16)
    for bad in (base[1:1 + 64 * 32].view(64, 32), base[:64 * 36].view(64, 36),
                t.t(), t[:0]):
        with pytest.raises(ValueError, match="no TMA descriptor"):
            _gluon.descriptor(bad, 16, 32)


class _FakeJit:
    """Stands in for a compiled ``@triton.jit`` function on device 0: its binder (counted)
    binds every argument, specializes on the tensors' dtypes and the integers, and the
    first launch of a specialization "compiles" it (counted)."""

    def __init__(self):
        self.binds = 0
        self.compiles = 0
        self.launcher = _Launcher()
        self.cached_runs = []
        self.device_caches = {0: (None, None, None, None, self._bind)}

    def _bind(self, *args, **meta):
        self.binds += 1
        bound = {f"a{i}": arg for i, arg in enumerate(args)} | meta
        specialization = [arg.dtype if isinstance(arg, torch.Tensor) else repr(arg) for arg in args]
        return bound, specialization, {}

    def __getitem__(self, grid):
        def compile_and_launch(*args, **meta):
            self.compiles += 1
            compiled = _Compiled(self.launcher)
            compiled.run = _CachedRun(compiled.run, self.cached_runs)
            return compiled
        return compile_and_launch


class _CachedRun:
    """A compiled kernel's ``run``: callable (the cached path, recorded) with the launcher's
    attributes."""

    def __init__(self, namespace, calls):
        self.__dict__.update(vars(namespace))
        self._calls = calls

    def __call__(self, *args):
        self._calls.append(args)


def test_repeated_launches_go_through_the_kernels_own_plan(monkeypatch):
    """The first launch of a key binds (and compiles), the second binds and keeps a plan,
    later ones launch from the plan without binding, on their own tensors; another integer is
    another key; an unhashable argument is launched without a plan."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    jit = _FakeJit()
    kernel = _triton._Kernel(jit)
    assert not kernel._interpreted
    x, out = torch.zeros(4), torch.zeros(8)
    kernel[(3,)](x, 7, out, BLOCK=64)
    kernel[(3,)](x, 7, out, BLOCK=64)
    assert (jit.binds, jit.compiles, len(jit.cached_runs)) == (2, 1, 1)
    y, other = torch.zeros(4), torch.zeros(8)
    kernel[(3,)](y, 7, other, BLOCK=64)
    assert jit.binds == 2 and len(jit.launcher.calls) == 1
    assert jit.launcher.calls[-1][:4] == (3, 1, 1, 1234)
    assert jit.launcher.calls[-1][13:] == (y.data_ptr(), 7, other.data_ptr(), 64)
    kernel[(3,)](y, 8, other, BLOCK=64)  # another integer: bound again
    kernel[(3,)](y, 7, other, BLOCK=32)  # another constexpr
    kernel[(3,)](y.double(), 7, other, BLOCK=64)  # another dtype
    assert jit.binds == 5 and len(jit.launcher.calls) == 1
    kernel[(3,)](y, [7], other, BLOCK=64)
    kernel[(3,)](y, [7], other, BLOCK=64)
    assert jit.binds == 7 and len(jit.launcher.calls) == 1


def test_launch_key_parts():
    """Tensors key by dtype, integers by value, other values by type and value (True is not
    1), descriptors by dtype, tile, layout and padding; lists cannot be keyed."""
    part = _triton._key_part
    assert part(torch.zeros(2)) == part(torch.ones(3)) == torch.float32
    assert part(5) == 5 and part(True) != part(1) and part(1.0) != part(1)
    assert part(None) == (type(None), None)
    descriptor = _TmaDescriptor(torch.zeros(16, dtype=torch.bfloat16))
    descriptor.layout = "layout"
    assert part(descriptor) == (torch.bfloat16, 2, 2, "layout", "zero")
    with pytest.raises(TypeError):
        part([1])
