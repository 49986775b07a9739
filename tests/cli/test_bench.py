"""The benchmark runs on tiny scaled shapes on CPU and reports sane numbers."""

import json
import math

import pytest
import torch

from grouped_linear.cli import bench as bench_module
from grouped_linear.cli.bench import Shape, load_shapes, run_bench, scale_for_cpu
from grouped_linear.cli.main import main
from grouped_linear.cli.report import RATIOS, ratio, render_table
from grouped_linear.cli.timing import Progress, format_table, randn, warm_gpu

TINY = "unaligned_g16,qwen35_397b_ep64_fc2"


@pytest.fixture(autouse=True)
def _plain_cpu_kernels(monkeypatch):
    """Run the CLI as users get it on CPU: PyTorch kernels, not Triton's (slow) interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_bench_command_writes_json_and_prints_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--shapes", TINY, "--json", str(path),
                 "--reps", "2"]) == 0
    report = json.loads(path.read_text())
    assert report["scaled"] and report["dtype"] == "fp32"
    assert report["columns"] == ["dense", "loop", "gl_nobias", "grouped_linear"]
    assert [r["shape"] for r in report["results"]] == TINY.split(",")
    for result in report["results"]:
        for column in report["columns"]:
            numbers = result["columns"][column]
            for key in ("fwd_tflops", "fwd_bwd_tflops", "fwd_ms", "fwd_bwd_ms"):
                assert math.isfinite(numbers[key]) and numbers[key] > 0, (column, key)
        ratio = result["ratios"]["gl/loop"]["fwd_bwd_tflops"]
        assert math.isfinite(ratio) and ratio > 0

    out = capsys.readouterr().out
    assert "grouped_linear" in out and "gl/loop" in out and "scaled down" in out
    for name in TINY.split(","):
        assert name in out


def test_report_renders_a_saved_report(tmp_path):
    """The table is a function of the report alone: a report read back from its JSON renders
    the table ``run_bench`` printed."""
    path = tmp_path / "bench.json"
    shapes = {"tiny": Shape("tiny", (5, 0, 11), 16, 24)}
    report = run_bench(shapes, device="cpu", json_path=str(path), reps=1, quiet=True)
    assert render_table(json.loads(path.read_text())) == report["table"]
    assert bench_module.render_table is render_table
    labels = [label for label, _, _ in RATIOS]
    assert len(set(labels)) == len(labels) and "gl/torch" in labels
    assert ratio({"x": 3.0}, {"x": 2.0}, "x") == 1.5
    assert ratio({"x": 3.0}, {"x": 0.0}, "x") is None and ratio(None, {"x": 1.0}, "x") is None


def test_inputs_and_warm_up_off_cuda():
    torch.manual_seed(0)
    a = randn(64, 8, device="cpu", dtype=torch.float32, scale=0.5, requires_grad=True)
    torch.manual_seed(0)
    b = randn(64, 8, device="cpu", dtype=torch.bfloat16, scale=0.5)
    assert a.is_leaf and a.requires_grad and not b.requires_grad
    assert torch.equal(a.detach().to(torch.bfloat16), b) and bool((a != 0).all())
    warm_gpu(50, "cpu")  # nothing to warm: returns at once


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    shapes = {"tiny": Shape("tiny", (5, 0, 11), 16, 24)}
    report = run_bench(shapes, device="cpu", plot_path=str(path), reps=1, quiet=True)
    assert report["results"][0]["M"] == 16
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shapes_load_and_scale_keeps_zeros_and_unaligned_sizes():
    shapes = load_shapes()
    skew = shapes["qwen3_30b_g128_skew"]
    assert skew.G == 128 and skew.K == 2048
    small = scale_for_cpu(skew)
    assert small.G == 128 and small.K == skew.K // 8 and small.N == skew.N // 8
    assert [s == 0 for s in small.splits] == [s == 0 for s in skew.splits]
    assert any(s % 8 for s in small.splits)
    with pytest.raises(ValueError, match="unknown shape"):
        run_bench(["no_such_shape"], device="cpu", quiet=True)


def test_uniform_shapes_are_measured_as_given(tmp_path):
    """``uniform:G:M:K:N`` beside the packaged names: G groups of M // G rows, not scaled."""
    report = run_bench(["uniform:4:64:32:16"], device="cpu", quiet=True, reps=1,
                       columns=["grouped_linear"])
    (result,) = report["results"]
    assert (result["G"], result["M"], result["K"], result["N"]) == (4, 64, 32, 16)


def test_format_table_and_text_progress(capsys):
    table = format_table(["name", "x"], [["a", 1], ["bbb", 22.5]], title="T")
    lines = table.splitlines()
    assert lines[0] == "T" and len({len(line) for line in lines[1:]}) == 1
    bar = Progress(3, "work")
    for _ in range(3):
        bar.update()
    bar.set_postfix_str("loss 1.0")
    bar.close()
    assert "3/3" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--shapes", "nosuch"], "unknown shape(s) ['nosuch']"),
    (["bench", "--columns", "nosuch"], "unknown column(s) ['nosuch']"),
    (["bench", "--columns", ","], "--columns ',' names nothing"),
    (["bench", "--shapes", ",,"], "--shapes ',,' names nothing"),
    (["bench", "--shapes", "uniform:8:64:32"], "expected uniform:G:M:K:N with four integers"),
    (["bench", "--shapes", "uniform:8:4:32:16"], "all positive, M >= G"),
    (["bench", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["bench", "--json", "/nonexistent-dir/x.json"], "its directory does not exist"),
    (["demo", "--ep", "3"], "ep=3 must divide num_experts=8"),
])
def test_command_line_errors_are_usage_errors(argv, message, capsys):
    """Bad arguments end with argparse's usage message and exit code 2, before any work."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_device_without_cuda_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["bench", "--device", "cuda"], ["demo", "--device", "cuda"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "no CUDA device is available" in capsys.readouterr().err


def test_no_column_that_runs_here(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cpu", "--columns", "torch"])
    assert "none of the columns ['torch'] runs on cpu" in capsys.readouterr().err


def test_rounds_report_the_median_of_alternating_rounds(monkeypatch):
    """Each round measures every column once, in order; the figure is the rounds' median."""
    calls = []
    times = iter([5.0, 1.0, 3.0, 9.0, 2.0, 7.0, 4.0, 6.0, 8.0, 0.5, 1.5, 2.5])

    def fake_measure(column, shape, device, dtype, grad_out, reps):
        calls.append(column)
        return {"fwd_s": next(times), "fwd_bwd_s": next(times), "peak_mem_bytes": None,
                "flops": 1e12}

    monkeypatch.setattr(bench_module, "_measure", fake_measure)
    shapes = {"tiny": Shape("tiny", (5, 0, 11), 16, 24)}
    report = run_bench(shapes, device="cpu", reps=1, quiet=True, columns=["loop", "gl_nobias"],
                       rounds=3)
    assert calls == ["loop", "gl_nobias"] * 3
    loop = report["results"][0]["columns"]["loop"]
    assert loop["rounds_fwd_ms"] == [5000.0, 2000.0, 8000.0]
    assert loop["fwd_ms"] == 5000.0 and loop["fwd_bwd_ms"] == 1000.0  # of 5, 2, 8 / 1, 7, .5
    assert loop["fwd_tflops"] == pytest.approx(1 / 5.0)
    assert report["rounds"] == 3 and "median of 3 alternating rounds" in report["table"]
    with pytest.raises(ValueError, match="rounds=0"):
        run_bench(shapes, device="cpu", quiet=True, rounds=0)
