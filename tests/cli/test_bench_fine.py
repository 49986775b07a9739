"""The fine-grained benchmark suite runs a tiny grid on CPU and reports consistent numbers."""

import itertools
import json
import math
import statistics

import pytest
import torch

import grouped_linear.cli.bench_fine as suite
from grouped_linear.cli.bench_fine import (
    CPU_GRID,
    GRID,
    Grid,
    render_fine_tables,
    run_fine_bench,
    skewed_sizes,
)
from grouped_linear.cli.main import main

TINY = Grid(groups=(4, 8), rows=(2, 5), features=((16, 24), (8, 16)))
CPU_COLUMNS = {"torch", "gl", "torch_fwd", "gl_fwd"}


@pytest.fixture(autouse=True)
def _plain_cpu_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def tiny_run(tmp_path):
    path = tmp_path / "fine.json"
    report = run_fine_bench(device="cpu", json_path=str(path), reps=1, rounds=2, grid=TINY)
    return report, path


def test_every_cell_and_column_is_reported(capsys, tiny_run):
    report, path = tiny_run
    assert json.loads(path.read_text()) == report
    expected = [(G, rows, kind, K, N) for (K, N), G, rows, kind
                in itertools.product(TINY.features, TINY.groups, TINY.rows, TINY.kinds)]
    assert [(c["G"], c["rows_per_group"], c["split"], c["K"], c["N"])
            for c in report["cells"]] == expected
    assert report["smoke_test"] and report["dtype"] == "float32"
    for cell in report["cells"]:
        G, K, N = cell["G"], cell["K"], cell["N"]
        assert cell["M"] == sum(cell["sizes"]) == G * cell["rows_per_group"]
        assert cell["empty_groups"] == cell["sizes"].count(0)
        # the route the plain call took: on CPU in float32, torch's grouped GEMM where its
        # 16-byte rows allow (K and N multiples of 4), else the loop
        assert cell["gl_route"] == ("grouped" if K % 4 == 0 and N % 4 == 0 else "loop")
        assert set(cell["columns"]) == CPU_COLUMNS
        for name, column in cell["columns"].items():
            forward_only = name.endswith("_fwd")
            flops = (1 if forward_only else 3) * 2 * cell["M"] * K * N
            assert len(column["rounds_ms"]) == 2
            assert column["ms"] == statistics.median(column["rounds_ms"])
            assert math.isclose(column["tflops"], flops / (column["ms"] / 1e3) / 1e12)
            assert column["out_rel_err"] < 1e-5  # float32 against float64
            assert column["peak_bytes"] is None
            if forward_only:
                assert column["wgrad_rel_err"] is None and column["empty_wgrad_zero"] is None
            else:
                assert column["wgrad_rel_err"] < 1e-5
                assert column["empty_wgrad_zero"] is True
            assert column["within_tolerance"]
        cols = cell["columns"]
        assert cols["gl"]["ratio"] == cols["torch"]["ms"] / cols["gl"]["ms"]
        assert cols["gl_fwd"]["ratio"] == cols["torch_fwd"]["ms"] / cols["gl_fwd"]["ms"]
        assert cols["torch"]["ratio"] == cols["torch_fwd"]["ratio"] == 1.0
        if cell["split"] == "skewed":
            assert cell["empty_groups"] > 0
    assert render_fine_tables(report) in capsys.readouterr().out


def test_the_summary_is_min_median_max_with_the_worst_cell(tiny_run):
    report, _ = tiny_run
    groups = {f"{K}x{N}" for K, N in TINY.features} | {"all"}
    assert {(s["features"], s["column"]) for s in report["summary"]} == {
        (f, c) for f in groups for c in ("gl", "gl_fwd")}
    for row in report["summary"]:
        cells = [c for c in report["cells"]
                 if row["features"] in ("all", f"{c['K']}x{c['N']}")]
        ratios = {c["name"]: c["columns"][row["column"]]["ratio"] for c in cells}
        assert row["count"] == len(ratios)
        assert row["min"] <= row["median"] <= row["max"]
        assert (row["min"], row["median"], row["max"]) == (
            min(ratios.values()), statistics.median(ratios.values()), max(ratios.values()))
        assert ratios[row["worst"]] == row["min"]
        low, median = row["target"]
        assert row["met"] == (row["min"] >= low and (median is None or row["median"] >= median))


def test_cached_fp8_columns_are_summarised_by_rows_per_group():
    """The FP8 cached target differs at 64 rows per group, so their summary rows do too."""
    cells = [{"name": f"c{rows}_{ratio}", "K": 8, "N": 8, "rows_per_group": rows,
              "columns": {"row_cached": {"ratio": ratio}}}
             for rows, ratio in ((8, 0.95), (32, 1.2), (64, 1.1), (128, 0.99))]
    rows = {(s["features"], s["cells"]): s for s in suite._summary(cells, ["row_cached"])}
    assert set(rows) == {(f, c) for f in ("8x8", "all") for c in ("rows>=64", "rows<64")}
    low, high = rows["all", "rows<64"], rows["all", "rows>=64"]
    assert (low["min"], low["max"], low["worst"], low["met"]) == (0.95, 1.2, "c8_0.95", True)
    assert (high["min"], high["max"], high["worst"], high["met"]) == (0.99, 1.1, "c128_0.99",
                                                                       False)


def test_the_byte_floor_counts_what_forward_and_backward_must_move():
    """Forward+backward: x read twice and dx written, the weight read twice and dW written,
    y written and dy read twice; forward: x, the weight and y once. Its ceilings are
    summarised per (K, N) beside the columns, without a target."""
    G, M, K, N, size = 3, 10, 16, 8, 2
    tensors = {"x": M * K, "w": G * N * K, "y": M * N}
    moved = {"x": 3, "w": 3, "y": 3}  # x, dx, x again; w, w, dW; y, dy, dy
    bandwidth = 1e9
    fwd_bwd, fwd = suite.byte_floor_ms(G, M, K, N, size, bandwidth)
    assert fwd_bwd == pytest.approx(sum(size * n * moved[k] for k, n in tensors.items())
                                     / bandwidth * 1e3)
    assert fwd == pytest.approx(size * sum(tensors.values()) / bandwidth * 1e3)
    cells = [{"name": name, "K": 8, "N": 8, "rows_per_group": 8, "fwd_bwd_ceiling": c,
              "fwd_ceiling": c / 2, "columns": {"gl": {"ratio": 1.0}}}
             for name, c in (("a", 1.4), ("b", 1.2), ("c", 1.3))]
    rows = {(s["features"], s["column"]): s for s in suite._summary(cells, ["gl"])}
    floor = rows["8x8", "floor (fwd_bwd)"]
    assert (floor["min"], floor["median"], floor["max"], floor["worst"]) == (1.2, 1.3, 1.4, "b")
    assert floor["target"] is None and floor["met"] is None
    assert rows["all", "floor (fwd)"]["median"] == pytest.approx(0.65)


@pytest.mark.parametrize("G, rows", [(4, 2), (8, 8), (64, 8), (128, 32), (256, 128)])
def test_skewed_splits_keep_the_rows_and_empty_some_groups(G, rows):
    sizes = skewed_sizes(G, rows)
    assert len(sizes) == G and sum(sizes) == G * rows and min(sizes) >= 0
    assert sizes.count(0) >= max(1, G // 4)
    assert sum(s == 3 * rows for s in sizes) >= max(1, G // 8)
    assert sizes == skewed_sizes(G, rows)  # a fixed seed


def test_the_grids_are_the_cells_asked_for():
    assert len(GRID.cells()) == 72
    assert {(c["K"], c["N"]) for c in GRID.cells()} == {(2048, 768), (768, 2048), (4096, 2048),
                                                        (7168, 2048)}
    assert all(c["sizes"] == [c["rows_per_group"]] * c["G"]
               for c in CPU_GRID.cells() if c["split"] == "balanced")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(reps=0), ValueError, "reps is 0"),
    (dict(rounds=True), TypeError, "rounds"),
    (dict(grid=((4,), (2,))), TypeError, "grid="),
    (dict(json_path=3), TypeError, "json_path=3"),
    (dict(device="tpu"), ValueError, "device='tpu'"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        run_fine_bench(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(groups=(2,), rows=(2,)), "groups is 2"),
    (dict(groups=(4,), rows=(2,), kinds=("zipf",)), "'zipf'"),
    (dict(groups=(4,), rows=(2,), features=((12, 16),)), r"\(12, 16\)"),
    (dict(groups=[4], rows=(2,)), r"groups=\[4\]"),
])
def test_bad_grids_are_refused_by_name(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Grid(**kwargs)


def test_bench_command_picks_the_fine_suite(monkeypatch):
    calls = []
    monkeypatch.setattr(suite, "run_fine_bench", lambda **kwargs: calls.append(kwargs))
    assert main(["bench", "--suite", "fine", "--device", "cpu", "--json", "x.json",
                 "--reps", "2"]) == 0
    assert main(["bench", "--suite", "fine", "--device", "cpu", "--rounds", "3"]) == 0
    assert calls == [{"device": "cpu", "json_path": "x.json", "reps": 2, "rounds": 1},
                     {"device": "cpu", "json_path": None, "reps": 5, "rounds": 3}]


@pytest.mark.parametrize("flag", [["--shapes", "x"], ["--plot", "x.png"], ["--dtype", "bf16"],
                                  ["--columns", "gl"]])
def test_suite_refuses_gemm_only_options(monkeypatch, flag):
    monkeypatch.setattr(suite, "run_fine_bench", lambda **kwargs: pytest.fail("ran"))
    with pytest.raises(SystemExit, match=f"{flag[0]}: not for --suite fine"):
        main(["bench", "--suite", "fine", *flag])


def test_the_fp8_columns_measure_their_recipe_and_cache():
    """The CUDA-only columns, run here through the emulated FP8 route: the cached ones after
    one ``is_first_microbatch=True`` call, each within the FP8 tolerance of float64 with
    exact zero weight gradients for the empty groups."""
    cell = Grid(groups=(8,), rows=(16,), kinds=("skewed",), features=((128, 64),)).cells()[0]
    names = ["torch", "gl", "row", "block", "row_cached", "block_cached", "torch_fwd", "gl_fwd"]
    result = suite._measure_cell(cell, names, torch.device("cpu"), torch.float32, 1, 1)
    assert list(result["columns"]) == names and result["empty_groups"] > 0
    for name in ("row", "block", "row_cached", "block_cached"):
        column = result["columns"][name]
        assert column["tolerance"] == suite.FP8_TOLERANCE
        assert 0 < column["out_rel_err"] <= suite.FP8_TOLERANCE
        assert 0 < column["wgrad_rel_err"] <= suite.FP8_TOLERANCE
        assert column["empty_wgrad_zero"] is True
        assert column["ratio"] == result["columns"]["torch"]["ms"] / column["ms"]
