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


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_gemm.available(torch.device("cuda")),
                    reason="needs the FP8 GEMMs (sm90)")
def test_moe_suite_memory_columns_on_cuda():
    """Every column of the block bench reports its peak and the memory kept for backward;
    recomputing fc2's input keeps at least its FP8 codes (T * k * F bytes) less."""
    from grouped_linear.cli.bench_moe import PRIMARY, RECOMPUTED, Case, run_moe_bench

    case = Case("tiny", num_experts=4, top_k=2, hidden=256, ffn=384, tokens=1024)
    report = run_moe_bench(device="cuda", reps=1, rounds=1, cases=(case,))
    columns = report["cases"][0]["columns"]
    for name, column in columns.items():
        assert column["peak_bytes"] > 0 and column["saved_bytes"] > 0, name
        assert math.isfinite(column["tflops"]) and column["rel_err_out"] < 0.1, name
    for name in RECOMPUTED:
        saved = columns[name]["saved_bytes"] - columns[f"{name}_recompute"]["saved_bytes"]
        assert saved >= case.tokens * case.top_k * case.ffn, (name, saved)
    for name in PRIMARY:  # the same codes as the recipe makes per step
        assert columns[f"{name}_primary"]["rel_err_out"] == pytest.approx(
            columns[name]["rel_err_out"], rel=1e-2)


@pytest.mark.parametrize("fused", [pytest.param(True, marks=pytest.mark.fp8_fused), False],
                         ids=["fp8_fused", "fp8_large_call_routes"])
def test_fine_suite_cell_every_cuda_column_within_tolerance(fused):
    """One tiny skewed cell of the fine suite with every CUDA column (Triton for ``gl``, the
    FP8 columns on the fused route as by default, or on the large calls' routes): each
    within its tolerance of float64, each empty expert's weight gradient exactly zero."""
    import grouped_linear.cli.bench_fine as suite

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 columns need sm89+")
    dev = torch.device("cuda")
    cell = suite.Grid(groups=(64,), rows=(8,), kinds=("skewed",),
                      features=((256, 256),)).cells()[0]
    names = suite._columns(dev, torch.bfloat16)
    assert {"gl", "row", "block", "row_cached", "block_cached", "gl_fwd"} <= set(names)
    result = suite._measure_cell(cell, names, dev, torch.bfloat16, 1, 1)
    assert list(result["columns"]) == names and result["empty_groups"] > 0
    assert result["gl_route"] == "triton"
    routes = result["fp8_routes"].split("/")
    assert (routes == ["fused", "fused"]) if fused else ("fused" not in routes)
    for name, column in result["columns"].items():
        assert column["within_tolerance"] is True, (name, column)
        assert column["out_rel_err"] <= column["tolerance"], name
        if name in suite.FORWARD_ONLY:
            assert column["wgrad_rel_err"] is None and column["empty_wgrad_zero"] is None
        else:
            assert column["wgrad_rel_err"] <= column["tolerance"], name
            assert column["empty_wgrad_zero"] is True, name
        assert math.isfinite(column["ms"]) and column["ms"] > 0, name
