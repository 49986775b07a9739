"""Registers and spills of the Triton GEMM kernels on Hopper, without a GPU.

``PYTHONPATH=. python benchmarks/kernel_resources.py``: compiles each kernel ahead of
time for sm90 (Triton's NVIDIA backend; the launch constants of
``tests/kernels/test_compiles_for_sm90.py`` and of the bf16 wrappers) and runs the PTX
through ``ptxas -v``, printing registers per thread and spill bytes. Spills in a GEMM's
main loop cost far more than the arithmetic: check here before timing on a GPU.
"""

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from grouped_linear.kernels import triton_gemm as tg

sys.argv = sys.argv[:1]
from tests.kernels import test_compiles_for_sm90 as cases  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
BF16 = {"a_ptr": "*bf16", "b_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "sizes_ptr": "*i64", "dy_ptr": "*bf16", "x_ptr": "*bf16", "dw_ptr": "*bf16"}
EXTRA = {
    "bf16 mm 64x128x64 (triton backend)": (
        tg._grouped_mm_kernel, BF16,
        {"HAS_BIAS": True, "PRECISION": "tf32", "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 128,
         "BLOCK_K": 64, "BLOCK_G": 16, "NUM_PROGRAMS": 132, "stride_bk": 1}, 4),
    "bf16 wgrad 64x64x64 (triton backend)": (
        tg._grouped_wgrad_kernel, BF16,
        {"HAS_BIAS": True, "PRECISION": "tf32", "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 64,
         "BLOCK_K": 64, "BLOCK_G": 16}, 4),
}


def ptxas_report(kernel, pointers, constants, num_warps) -> str:
    signature = {p.name: "constexpr" if p.is_constexpr else
                 pointers.get(p.name, "*fp32") if p.name.endswith("_ptr") else "i32"
                 for p in kernel.params}
    compiled = triton.compile(ASTSource(kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 3})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    run = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    lines = (run.stdout + run.stderr).splitlines()
    used = next((line.split("Used")[1].split(",")[0].strip() for line in lines if "Used" in line), "?")
    spills = next((line.split(",", 1)[1].strip() for line in lines if "spill stores" in line), "?")
    return f"{used:>14s}  {spills}"


def main():
    for name, case in {**cases.CASES, **EXTRA}.items():
        print(f"{name:40s} {ptxas_report(*case)}")


if __name__ == "__main__":
    main()
