"""The bench's CUDA-only columns (raw grouped_mm, the FP8 recipes) on a tiny shape."""

import math

import pytest
import torch

from grouped_linear.cli.bench import Shape, render_table, run_bench
from grouped_linear.kernels.gemm import fp8_torch_gemm as fp8_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_gemm.available(torch.device("cuda")),
                    reason="needs the FP8 grouped GEMM (sm90)")
def test_fp8_columns_measure_and_compare():
    shape = Shape("tiny", (100, 0, 37, 300), 256, 128)
    columns = ["torch", "fp8_row", "fp8_row_cached", "fp8_tensor"]
    report = run_bench({"tiny": shape}, device="cuda", quiet=True, columns=columns)
    assert report["columns"] == columns
    (result,) = report["results"]
    for column in columns:
        for key in ("fwd_tflops", "fwd_bwd_tflops"):
            value = result["columns"][column][key]
            assert math.isfinite(value) and value > 0, (column, key)
    for label in ("row/torch", "rowc/torch", "tensor/torch"):
        assert result["ratios"][label]["fwd_bwd_tflops"] > 0, label
    table = render_table(report)
    assert "rowc" in table and "rowc/torch" in table
