"""Registers and spills of the Triton GEMM kernels on Hopper, without a GPU.

``PYTHONPATH=. python benchmarks/kernel_resources.py``: compiles each kernel ahead of
time for sm90 (Triton's NVIDIA backend; the kernels, launch constants and alignment
assumptions of ``tests/kernels/test_compiles_for_sm90.py``) and runs the PTX
through ``ptxas -v``, printing registers per thread and spill bytes. Spills in a GEMM's
main loop cost far more than the arithmetic: check here before timing on a GPU.
"""

import os
import subprocess
import sys
import tempfile

import triton

sys.argv = sys.argv[:1]
from tests.kernels import test_compiles_for_sm90 as cases  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(kernel, pointers, constants, num_warps) -> str:
    compiled = cases._compile(kernel, pointers, constants, num_warps)
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
    for name, case in cases.CASES.items():
        print(f"{name:40s} {ptxas_report(*case)}")


if __name__ == "__main__":
    main()
