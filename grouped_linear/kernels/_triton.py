"""Triton, when it is importable (CUDA builds of torch bring it; CPU builds need the extra).

Without Triton the kernel modules still import: ``triton.jit`` becomes a no-op
decorator and only the plain-PyTorch references run.
"""

import functools
import operator
import os
import threading

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton installed
    HAS_TRITON = False

__all__ = ["triton", "tl", "HAS_TRITON", "Stub", "interpreting", "use_triton", "kernel",
           "LaunchPlan", "PlanCache", "cdiv", "next_power_of_2", "sm_count", "bind_context"]


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


_THREAD = threading.local()


def bind_context() -> None:
    """Make the current CUDA device's primary context current in this thread (once a thread).

    Triton encodes a launch's TMA descriptors (``cuTensorMapEncodeTiled``, a driver call)
    before its launcher makes a context current, and the encoding fails with "invalid device
    context" in a thread that no CUDA runtime call has touched: autograd's backward thread,
    when the caching allocator serves the backward's allocations from its cache and only
    Triton kernels run before the first descriptor. A runtime call binds the context."""
    if not getattr(_THREAD, "bound", False):
        if torch.cuda.is_available():
            torch.cuda.mem_get_info()
        _THREAD.bound = True


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

    A launch that repeats one seen before, every argument but the tensors' addresses
    equal (the grid, integers, constexprs, tensors' dtypes, descriptors' tiles), goes one
    step further: from the second time on it launches from a :class:`LaunchPlan` kept by
    the kernel (no binding at all; a Gluon kernel's descriptors encoded once per address).
    """

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self._compiled: dict = {}
        # Under TRITON_INTERPRET=1 (read when the kernel was decorated) there is no binary.
        self._interpreted = not hasattr(jit_fn, "device_caches")
        # False once a launcher has rejected the cached path: Triton's own path from then on.
        self.cached = True
        self._plans = PlanCache()
        self._seen: set = set()  # launch keys met once, planned when met again

    def __getattr__(self, name):
        return getattr(self.jit_fn, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _launch(self, grid, args, meta):
        """A launch from the kernel's plan for these arguments where one is kept; the second
        time a launch is seen, through :meth:`launch_planned`, keeping its plan."""
        if self._interpreted or type(grid) is not tuple:
            return self._launch_direct(grid, args, meta)
        try:
            key = (grid, *map(_key_part, args), *meta.items())
            if self._plans.try_launch(key, args):
                return None
        except TypeError:  # an argument that cannot be part of a key: no plan
            return self._launch_direct(grid, args, meta)
        if key not in self._seen:
            if len(self._seen) >= PLANNED_KEYS:
                self._seen.clear()
            self._seen.add(key)
            return self._launch_direct(grid, args, meta)
        self._plans.keep(key, self.launch_planned(grid, args, meta))
        return None

    def _launch_direct(self, grid, args, meta):
        """The launch through the cached binary (or Triton's own path), no plan."""
        return self._run(grid, args, meta)[0]

    def _run(self, grid, args, meta):
        """Launch; return what Triton's launch returns and, when the cached path knows the
        compiled binary, ``(device, bound arguments)`` for :class:`LaunchPlan` (else ``None``)."""
        if self._interpreted:
            return self.jit_fn[grid](*args, **meta), None
        bind_context()  # Triton's launcher encodes the TMA descriptors before binding one
        if not self.cached or _hooks_active():
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
        if bound is None:
            return None
        return LaunchPlan.build(compiled, grid, *bound, positions=_tensor_positions(args))


# Launch keys a kernel remembers having seen once (and plans it keeps: PlanCache's size).
PLANNED_KEYS = 256


def _key_part(arg: object) -> object:
    """What a launch argument contributes to the key of a kernel's own plans: a tensor its
    dtype (its address is the plan's to fill in, its alignment the plan's to check), a TMA
    descriptor its dtype, tile, layout and padding (shape and strides are encoded per launch),
    an integer itself, anything else its type and value (``TypeError`` if unhashable)."""
    if type(arg) is int:
        return arg
    if isinstance(arg, torch.Tensor):
        return arg.dtype
    if _is_descriptor(arg):
        return (arg.base.dtype, *arg.block_shape, arg.layout, arg.padding)
    hash(arg)
    return (type(arg), arg)


def _tensor_positions(args: tuple) -> tuple[int, ...]:
    """Where the tensors and TMA descriptors sit among a launch's positional arguments."""
    return tuple(i for i, arg in enumerate(args)
                 if isinstance(arg, torch.Tensor) or _is_descriptor(arg))


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
    ``plan(*tensors)``: no argument binding or specialization, only each tensor's address.
    On the H200 machine's host that is ~9 µs per launch against ~18 µs for the cached
    path of :class:`_Kernel` (benchmarks/NOTES.md, "The small bf16 step, sixth look").

    A Gluon kernel's TMA descriptors are passed in their tensors' places. Triton's launcher
    encodes each one on every launch (``cuTensorMapEncodeTiled`` behind a Python wrapper);
    the plan keeps the encoded descriptors by what they encode (address, shape, strides;
    block shape, swizzle and element type are fixed by the specialization) and hands them
    to the C launcher itself, so a training step whose tensors come back at the same
    addresses (the caching allocator's usual case) encodes each descriptor once. An encoded
    descriptor holds an address, not a tensor: it keeps no memory alive, and a new tensor at
    that address with the same geometry is described by it exactly.

    ``plan(*tensors)`` returns ``False`` without launching when it cannot stand for
    Triton's launch: a tensor address the binary assumed 16-byte aligned is not, the
    current device is another, launch hooks are set, or the launcher has rejected the
    plan's arguments once (then the plan stays off). The caller then launches the usual way.
    """

    __slots__ = ("_launch", "_grid", "_middle", "_values", "_slots", "_aligned", "_device",
                 "_encodings", "_pick")

    def __init__(self, launch, grid, middle, values, slots, aligned, device, encodings=None,
                 positions=None):
        self._launch = launch
        self._grid = grid
        self._middle = middle
        self._values = values
        self._slots = slots  # positions in ``values`` of each tensor argument
        self._aligned = aligned
        self._device = device
        # Per slot ``None`` (a tensor, or a descriptor the launcher encodes) or the
        # :class:`_Encodings` of a descriptor encoded here, ``values[slot:slot + width]``.
        self._encodings = encodings or (None,) * len(slots)
        # The tensor arguments out of the kernel's positional arguments (:meth:`launch_from`;
        # ``None``: some tensor came by keyword, the plan launches only through its call).
        self._pick = None
        if positions is not None and len(positions) == len(slots) > 1:
            self._pick = operator.itemgetter(*positions)
        elif positions is not None and len(positions) == len(slots) == 1:
            only = positions[0]
            self._pick = lambda args: (args[only],)

    @classmethod
    def build(cls, compiled, grid, device: int, bound: dict,
              positions: tuple[int, ...]) -> "LaunchPlan | None":
        """The plan of a launch that ran ``compiled`` with the arguments ``bound`` (by
        name, in the kernel's order); ``positions``: where the tensor arguments sit among
        the positional arguments of the launch (for :meth:`launch_from`)."""
        launcher = getattr(compiled, "run", None)
        launch = getattr(launcher, "launch", None)
        if launch is None or getattr(launcher, "global_scratch_size", 1) or getattr(
                launcher, "profile_scratch_size", 1):
            return None
        arguments = list(bound.values())
        tensors = [v for v in arguments if isinstance(v, torch.Tensor) or _is_descriptor(v)]
        aligned = tuple(_address(v) % 16 == 0 for v in tensors)
        middle = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                  None, None, compiled.packed_metadata, None, None, None)
        unwrapped = _unwrap_descriptor_launch(launch)
        metas = iter(())
        if unwrapped is not None and len(unwrapped[1]) == sum(map(_is_descriptor, tensors)):
            launch, metas = unwrapped[0], iter(unwrapped[1])  # the C launcher itself
        values, slots, encodings = [], [], []
        for v in arguments:
            if isinstance(v, torch.Tensor) or _is_descriptor(v):
                slots.append(len(values))
                meta = next(metas, None) if _is_descriptor(v) else None
                encoding = None if meta is None else _Encodings(meta, v)
                encodings.append(encoding)
                values.extend([None] * (encoding.width if encoding else 1))
            else:
                values.append(v)
        return cls(launch, _full_grid(grid), middle, values, tuple(slots), aligned, device,
                   tuple(encodings), positions)

    def launch_from(self, args: tuple) -> bool:
        """:meth:`__call__` on the tensor arguments among ``args``, the kernel's positional
        arguments as the planned launch took them."""
        pick = self._pick
        return pick is not None and self(*pick(args))

    def __call__(self, *tensors: torch.Tensor) -> bool:
        """Launch on ``tensors`` (in the kernel's order of tensor arguments); ``False``
        where the caller must launch through Triton instead."""
        if len(tensors) != len(self._slots):
            raise TypeError(f"this launch takes {len(self._slots)} tensors, got {len(tensors)}")
        device = self._device
        if self._launch is None or torch._C._cuda_getDevice() != device or _hooks_active():
            return False
        values = self._values.copy()
        for slot, aligned, encodings, tensor in zip(self._slots, self._aligned, self._encodings,
                                                    tensors):
            is_tensor = isinstance(tensor, torch.Tensor)
            address = tensor.data_ptr() if is_tensor else tensor.base.data_ptr()
            if aligned and address & 15:
                return False
            if is_tensor:
                values[slot] = address
            elif encodings is None:  # a TMA descriptor the launcher encodes
                bind_context()
                values[slot] = tensor
            else:
                encoded = encodings.get(tensor, address)
                values[slot:slot + len(encoded)] = encoded
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
    device): :meth:`try_launch` launches from the key's plan; where it cannot, the caller
    launches through :meth:`_Kernel.launch_planned` and keeps that plan (:meth:`keep`). Starts
    over when full."""

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

    def try_launch(self, key: tuple, args: tuple) -> bool:
        """Launch from the plan under ``key`` on the tensors among ``args`` (the kernel's
        positional arguments); ``False`` where there is no plan or it cannot launch."""
        plan = self._plans.get(key)
        return plan is not None and plan.launch_from(args)


class _Encodings:
    """The encoded forms of one descriptor argument of a plan, by what they encode: the
    launcher's arguments for a descriptor (the encoded ``CUtensorMap``, then its shape and
    strides), from Triton's own encoder on first sight. Starts over when full."""

    __slots__ = ("_meta", "_by_geometry", "width")
    SIZE = 64

    def __init__(self, meta: dict, descriptor) -> None:
        self._meta = meta
        self._by_geometry: dict = {}
        self.width = len(self.get(descriptor, _address(descriptor)))

    def get(self, descriptor, address: int) -> list:
        key = (address, *descriptor.shape, *descriptor.strides, descriptor.padding)
        encoded = self._by_geometry.get(key)
        if encoded is None:
            bind_context()
            encoded = _ENCODE[0](descriptor, self._meta)
            if len(self._by_geometry) >= self.SIZE:
                self._by_geometry.clear()
            self._by_geometry[key] = encoded
        return encoded


_ENCODE: list = [None]  # Triton's encoder of a host TMA descriptor, once found


def _unwrap_descriptor_launch(launch):
    """``(C launcher, per-descriptor metadata)`` where ``launch`` is Triton's wrapper that
    encodes the host TMA descriptors of a TMA-lowered kernel before calling its C launcher,
    else ``None`` (no descriptor arguments, another Triton, descriptors not lowered to TMA)."""
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
    inner, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    if (not callable(inner) or not isinstance(metas, list)
            or not all(isinstance(meta, dict) for meta in metas)):
        return None
    if _ENCODE[0] is None:
        try:
            from triton.backends.nvidia.driver import make_tensordesc_arg
        except ImportError:  # pragma: no cover - another Triton
            return None
        _ENCODE[0] = make_tensordesc_arg
    return inner, metas


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
