"""Compiling kernels for Hopper (sm90) without a GPU, and reading what Triton made of them.

The helpers of ``test_compiles_for_sm90`` (run in its child process, without
``TRITON_INTERPRET``): a Triton or Gluon kernel compiled for ``cuda:90`` with the argument
kinds its CUDA launch has, ``ptxas -v``'s report on the PTX, and a check of the software
pipeline's shared buffers in the TTGIR.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def compile_triton(kernel, pointers: dict, constants: dict, num_warps: int = 4,
                   num_stages: int = 3):
    """``kernel`` (a launch wrapper or its JIT function) compiled for sm90: ``pointers``
    names the pointer types (others ``*fp32``), ``constants`` the constexprs and the
    integers specialized to a value; every other pointer and integer is 16-divisible, as
    Triton's launcher specializes them on aligned shapes."""
    kernel = getattr(kernel, "jit_fn", kernel)
    signature = {}
    for param in kernel.params:
        if param.is_constexpr or param.name in constants:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = pointers.get(param.name, "*fp32")
        else:
            signature[param.name] = "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, param in enumerate(kernel.params)
               if signature[param.name] != "constexpr"}
    source = ASTSource(kernel, signature, constants, aligned)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_notes(ptx: str) -> str:
    """What ``ptxas -v`` reports on ``ptx`` for sm90a (registers, spills, serialized MMAs)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                                capture_output=True, text=True)
    return report.stdout + report.stderr


_ALLOC = re.compile(r"(%[\w.]+) = ttg\.local_alloc\s*: \(\) -> !ttg\.memdesc<(\d+)x")
_INDEX = re.compile(r"(%[\w.]+) = ttg\.memdesc_index (%[\w.]+)\[")
_COPY = re.compile(r"ttg\.async_copy_global_to_local %[\w.]+, (%[\w.]+)")
_MMA = re.compile(r"= ttng\.warp_group_dot (%[\w.]+), (%[\w.]+), [^\n]*\n[^\n]*"
                  r"warp_group_dot_wait[^\n]*pendings = (\d+)")


def pipelined_mma_buffers(ttgir: str) -> dict[str, tuple[int, int]]:
    """The multi-buffered shared allocations an asynchronous warp-group MMA reads directly:
    ``{name: (buffers, copies in flight when a step's MMA is issued)}``.

    A loop pipelined over ``s`` stages issues the copies of ``s - 1`` steps before it
    starts (one ``async_copy`` each in the prologue) and one per step inside; a step's MMA
    stays in flight past the loop's wait (``pendings >= 1``) while the copy of step
    ``i + s - 1`` is issued. That copy must land in another buffer than step ``i``'s:
    ``buffers > copies in flight``."""
    buffers = {m.group(1): int(m.group(2)) for m in _ALLOC.finditer(ttgir)}
    parent = {m.group(1): m.group(2) for m in _INDEX.finditer(ttgir)}
    copies = collections.Counter(parent.get(m.group(1)) for m in _COPY.finditer(ttgir))
    read = {}
    for m in _MMA.finditer(ttgir):
        for operand in m.group(1, 2):
            alloc = parent.get(operand)
            if alloc in buffers and int(m.group(3)) >= 1:
                read[alloc] = (buffers[alloc], copies[alloc] - 1)
    return read


def overwritten_buffers(ttgir: str) -> list[str]:
    """The allocations of :func:`pipelined_mma_buffers` a copy in flight may overwrite
    while the MMA still reads them."""
    return [f"{name}: {count} buffers for {ahead} copies in flight"
            for name, (count, ahead) in pipelined_mma_buffers(ttgir).items() if count <= ahead]
