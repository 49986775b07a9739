"""Triton, when it is importable (CUDA builds of torch bring it; CPU builds need the extra).

Without Triton the kernel modules still import: ``triton.jit`` becomes a no-op
decorator and only the plain-PyTorch references run.
"""

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton installed
    HAS_TRITON = False

__all__ = ["triton", "tl", "HAS_TRITON", "Stub", "interpreting", "use_triton", "kernel",
           "LaunchPlan", "PlanCache", "cdiv", "next_power_of_2", "sm_count"]


class Stub:
    """Stands in for ``triton`` and ``triton.language`` (and Gluon's) where they cannot be
    imported: decorators that return the function, ``constexpr`` for annotations."""

    constexpr = object

    @staticmethod
    def jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    constexpr_function = jit


if not HAS_TRITON:  # pragma: no cover
    triton = tl = Stub()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side launch arithmetic. Triton 3.6's ``triton.cdiv`` is a
    constexpr function whose host calls cost a few µs each (argument unwrapping), and a
    small step computes several grids."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``0`` for ``0``), as ``triton.next_power_of_2``
    but a plain function (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (persistent grids size by it); 4
    elsewhere (the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``tensor``'s device."""
    return HAS_TRITON and (tensor.is_cuda or (interpreting() and tensor.device.type == "cpu"))


class _Kernel:
    """A ``@triton.jit`` kernel launched from the host, with a shorter launch path.

    ``kernel[grid](*args, **meta)`` behaves as Triton's, but once Triton has compiled the
    kernel for an argument specialization (its own binder decides: dtypes, 16-byte
    alignment of pointers and integers, constexpr values, launch options), later launches
    with the same specialization call the compiled binary directly. That skips
    ``JITFunction.run``'s per-call work (option strings, global-value checks, launch
    metadata): an empty kernel's launch took 27.9 µs of host time that way and 10.0 µs
    this way on the H200 machine's host (benchmarks/small_step.py), and small MoE
    problems are made of launches. Launch hooks (profilers) and the CPU interpreter take
    Triton's path, and so does every launch after a Triton launcher has rejected the
    cached path's arguments (:attr:`cached`). Other attributes are the JIT function's.
    """

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self._compiled: dict = {}
        # Under TRITON_INTERPRET=1 (read when the kernel was decorated) there is no binary.
        self._interpreted = not hasattr(jit_fn, "device_caches")
        # False once a launcher has rejected the cached path: Triton's own path from then on.
        self.cached = True

    def __getattr__(self, name):
        return getattr(self.jit_fn, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _launch(self, grid, args, meta):
        return self._run(grid, args, meta)[0]

    def _run(self, grid, args, meta):
        """Launch; return what Triton's launch returns and, when the cached path knows the
        compiled binary, ``(device, bound arguments)`` for :class:`LaunchPlan` (else ``None``)."""
        if not self.cached or self._interpreted or _hooks_active():
            return self.jit_fn[grid](*args, **meta), None
        device = torch.cuda.current_device()
        binder = self.jit_fn.device_caches[device][4]
        bound, specialization, options = binder(*args, **meta)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:  # first launch of this specialization: Triton compiles it
            compiled = self.jit_fn[grid](*args, **meta)
            if compiled is None or hasattr(compiled, "result"):
                return compiled, None
            self._compiled[key] = compiled
            return compiled, (device, bound)
        try:
            compiled.run(*_full_grid(grid), torch._C._cuda_getCurrentRawStream(device),
                         compiled.function,
                         compiled.packed_metadata, None, None, None, *bound.values())
        except TypeError:
            # A Triton whose launcher takes other arguments (it checks them before
            # launching anything): use Triton's own path from now on.
            self.cached = False
            return self.jit_fn[grid](*args, **meta), None
        return compiled, (device, bound)

    def launch_planned(self, grid, args, meta) -> "LaunchPlan | None":
        """Launch as ``self[grid](*args, **meta)`` does, and return a :class:`LaunchPlan`
        that repeats this launch with other tensors (``None`` where only Triton's own
        path can launch: the interpreter, launch hooks, scratch buffers)."""
        compiled, bound = self._run(grid, args, meta)
        return None if bound is None else LaunchPlan.build(compiled, grid, *bound)


def _full_grid(grid: tuple) -> tuple[int, int, int]:
    """A launch grid of 1 to 3 sizes as the launcher's three."""
    size = len(grid)
    return grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1


def _hooks_active() -> bool:
    hooks = triton.knobs.runtime
    return bool(hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls)


class LaunchPlan:
    """One compiled kernel with every launch argument fixed except its tensors.

    A caller that launches the same kernel on the same geometry again and again (a
    training step's small GEMMs) builds the plan once, through
    :meth:`_Kernel.launch_planned`, keeps it under a key that determines every integer and
    constexpr argument and every tensor's dtype and device, and then launches with
    ``plan(*tensors)``: no argument binding or specialization, only each tensor's address
    (a Gluon kernel's TMA descriptors are passed in their tensors' places: the launcher
    encodes each one, its block shape and layout fixed by the kernel's specialization).
    On the H200 machine's host that is ~9 µs per launch against ~18 µs for the cached
    path of :class:`_Kernel` (benchmarks/NOTES.md, "The small bf16 step, sixth look").

    ``plan(*tensors)`` returns ``False`` without launching when it cannot stand for
    Triton's launch: a tensor address the binary assumed 16-byte aligned is not, the
    current device is another, launch hooks are set, or the launcher has rejected the
    plan's arguments once (then the plan stays off). The caller then launches the usual way.
    """

    __slots__ = ("_launch", "_grid", "_middle", "_values", "_slots", "_aligned", "_device")

    def __init__(self, launch, grid, middle, values, slots, aligned, device):
        self._launch = launch
        self._grid = grid
        self._middle = middle
        self._values = values
        self._slots = slots
        self._aligned = aligned
        self._device = device

    @classmethod
    def build(cls, compiled, grid, device: int, bound: dict) -> "LaunchPlan | None":
        launcher = getattr(compiled, "run", None)
        launch = getattr(launcher, "launch", None)
        if launch is None or getattr(launcher, "global_scratch_size", 1) or getattr(
                launcher, "profile_scratch_size", 1):
            return None
        values = list(bound.values())
        slots = tuple(i for i, v in enumerate(values)
                      if isinstance(v, torch.Tensor) or _is_descriptor(v))
        aligned = tuple(_address(values[i]) % 16 == 0 for i in slots)
        middle = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                  None, None, compiled.packed_metadata, None, None, None)
        for i in slots:
            values[i] = None
        return cls(launch, _full_grid(grid), middle, values, slots, aligned, device)

    def __call__(self, *tensors: torch.Tensor) -> bool:
        """Launch on ``tensors`` (in the kernel's order of tensor arguments); ``False``
        where the caller must launch through Triton instead."""
        if len(tensors) != len(self._slots):
            raise TypeError(f"this launch takes {len(self._slots)} tensors, got {len(tensors)}")
        device = self._device
        if self._launch is None or torch._C._cuda_getDevice() != device or _hooks_active():
            return False
        values = self._values.copy()
        for slot, aligned, tensor in zip(self._slots, self._aligned, tensors):
            if type(tensor) is torch.Tensor or isinstance(tensor, torch.Tensor):
                address = tensor.data_ptr()
                values[slot] = address
            else:  # a TMA descriptor: the launcher encodes it (its tensor's address too)
                address = tensor.base.data_ptr()
                values[slot] = tensor
            if aligned and address & 15:
                return False
        try:
            self._launch(*self._grid, torch._C._cuda_getCurrentRawStream(device),
                         *self._middle, *values)
        except TypeError:
            # A Triton whose launcher takes other arguments (it checks them before
            # launching anything): the caller's path from now on.
            self._launch = None
            return False
        return True


class PlanCache:
    """:class:`LaunchPlan` objects by a key the caller builds from everything a launch fixes
    besides its tensors (every integer and constexpr argument, every tensor's dtype and
    device): :meth:`launch` launches from the key's plan, else the usual way, keeping a plan
    of that launch. Starts over when full."""

    __slots__ = ("_plans", "_size")

    def __init__(self, size: int = 256) -> None:
        self._plans: dict = {}
        self._size = size

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: tuple) -> "LaunchPlan | None":
        """The plan kept under ``key``, if any."""
        return self._plans.get(key)

    def keep(self, key: tuple, plan: "LaunchPlan | None") -> None:
        """Keep ``plan`` under ``key`` (nothing for ``None``)."""
        if plan is None:
            return
        if len(self._plans) >= self._size:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def launch(self, key: tuple, kernel: "_Kernel", grid: tuple, args: tuple, meta: dict) -> None:
        """``kernel[grid](*args, **meta)``, from the plan under ``key`` where it can."""
        plan = self._plans.get(key)
        if plan is not None and plan(*[arg for arg in args if isinstance(arg, torch.Tensor)
                                      or _is_descriptor(arg)]):
            return
        self.keep(key, kernel.launch_planned(grid, args, meta))


def _is_descriptor(value: object) -> bool:
    """Whether a bound launch argument is a host TMA descriptor (a tensor with a block)."""
    return isinstance(getattr(value, "base", None), torch.Tensor) and hasattr(value, "block_shape")


def _address(value: torch.Tensor | object) -> int:
    """A tensor's address, or a TMA descriptor's tensor's."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value.base.data_ptr()


def kernel(jit_fn):
    """Decorator (above ``@triton.jit``) for kernels launched from the host: see
    :class:`_Kernel`. Without Triton it returns ``jit_fn`` unchanged."""
    return _Kernel(jit_fn) if HAS_TRITON else jit_fn
