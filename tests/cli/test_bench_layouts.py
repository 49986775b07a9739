"""The layouts benchmark suite runs at tiny sizes on CPU and reports sane numbers."""

import json
import math

import pytest
import torch

import grouped_linear.cli.bench_layouts as bench_layouts
from grouped_linear.cli.bench_layouts import PERMUTE_MULTIPLES, TOP_K, run_layouts_bench
from grouped_linear.cli.main import main


@pytest.fixture(autouse=True)
def _plain_cpu_kernels(monkeypatch):
    """Run the CLI as users get it on CPU: PyTorch kernels, not Triton's (slow) interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def test_layouts_suite_reports_every_op_both_directions(tmp_path, capsys):
    path = tmp_path / "layouts.json"
    report = run_layouts_bench(device="cpu", json_path=str(path), reps=1)

    assert set(report) >= {"device", "copy_gbps", "rows", "mlp", "table"}
    assert report["device"] == "cpu" and report["dtype"] == "fp32"
    assert _positive(report["copy_gbps"])

    ops = ["pad_groups(128)", "unpad_groups",
           *(f"permute(multiple={m})" for m in PERMUTE_MULTIPLES), "permute(map)",
           "permute(capacity)", "permute(capacity, position)", "permute(pad_to_capacity)",
           "permute(num_out_tokens)", "sort_chunks", "unpermute", "unpermute (probs grad)"]
    assert sorted({(r["op"], r["direction"]) for r in report["rows"]}) == sorted(
        (op, d) for op in ops for d in ("fwd", "bwd"))
    for row in report["rows"]:
        assert row["hidden"] == 64 and row["rows"] == 2048
        for key in ("ms", "gbps", "fraction_of_copy", "bytes"):
            assert _positive(row[key]), (row["op"], row["direction"], key)
        assert row["fraction_of_copy"] == pytest.approx(row["gbps"] / report["copy_gbps"])
    # The byte counts follow the documented formulas: e.g. unpad forward = 2 * M * H * 4.
    unpad_fwd = next(r for r in report["rows"] if (r["op"], r["direction"]) == ("unpad_groups", "fwd"))
    assert unpad_fwd["bytes"] == 2 * 2048 * 64 * 4
    # the probs gradient reads every slot's row (M = 2048) and each token's gradient row
    probs_bwd = next(r for r in report["rows"]
                     if (r["op"], r["direction"]) == ("unpermute (probs grad)", "bwd"))
    assert probs_bwd["bytes"] == (2048 + 2048 // TOP_K) * 64 * 4
    # the capacity modes: N = 64 * ceil(M / 64) padded rows, of which backward reads only
    # the kept ones; num_out_tokens = 3M/4 rows
    fwd, bwd = ({r["op"]: r["bytes"] for r in report["rows"] if r["direction"] == d}
                for d in ("fwd", "bwd"))
    assert fwd["permute(pad_to_capacity)"] == (2048 // TOP_K + 2048) * 64 * 4
    assert bwd["permute(pad_to_capacity)"] < fwd["permute(pad_to_capacity)"]
    assert fwd["permute(num_out_tokens)"] == bwd["permute(num_out_tokens)"] == (
        2048 // TOP_K + 3 * 2048 // 4) * 64 * 4

    assert [m["shape"] for m in report["mlp"]] == ["dsv3_ep32", "qwen35_397b_ep64"]
    for entry in report["mlp"]:
        for key in ("mlp_ms", "gemm_ms", "ratio"):
            assert _positive(entry[key]), (entry["shape"], key)
        assert entry["ratio"] == pytest.approx(entry["mlp_ms"] / entry["gemm_ms"])

    assert json.loads(path.read_text())["rows"] == report["rows"]
    out = capsys.readouterr().out
    assert out.strip() == report["table"].strip()
    assert "GB/s" in out and "unpermute" in out and "qwen35_397b_ep64" in out


def test_bench_command_picks_the_suite(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_layouts, "run_layouts_bench", lambda **kwargs: calls.append(kwargs))
    assert main(["bench", "--suite", "layouts", "--device", "cpu", "--json", "x.json",
                 "--reps", "2"]) == 0
    assert calls == [{"device": "cpu", "json_path": "x.json", "reps": 2}]
    with pytest.raises(SystemExit, match="--shapes: for --suite gemm only"):
        main(["bench", "--suite", "layouts", "--shapes", "dsv3_ep32_fc1"])
    with pytest.raises(SystemExit):
        main(["bench", "--suite", "nope"])


def test_each_unpermute_row_differentiates_only_its_own_input():
    """The ``unpermute`` row's backward is the ``y_perm`` gradient alone and the ``probs grad``
    row's the ``probs`` gradient alone: a graph that also needs the other input would time
    both gradients under one name."""
    torch.manual_seed(0)
    ops = {op.name: op for op in bench_layouts._case_ops(64, 2048, torch.device("cpu"),
                                                         torch.float32)}
    for name, wanted in (("unpermute", 0), ("unpermute (probs grad)", 2)):
        node = ops[name].forward().grad_fn
        # next_functions: (y_perm, row_map, probs); None where an input needs no gradient
        needs = [entry[0] is not None for entry in node.next_functions]
        assert needs == [i == wanted for i in range(3)], (name, needs)
