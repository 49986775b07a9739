"""The transformers benchmark suite runs at tiny sizes on CPU and reports sane numbers."""

import json
import math

import pytest

from grouped_linear.cli.bench_transformers import (
    BASELINE,
    CASES,
    Case,
    render_transformers_table,
    run_transformers_bench,
)
from grouped_linear.cli.main import main

TINY = (Case("tiny_qwen3", "qwen3_moe", "Qwen3MoeExperts",
             dict(hidden_size=128, moe_intermediate_size=64, num_experts=8), 512, 2),
        Case("tiny_gpt_oss", "gpt_oss", "GptOssExperts",
             dict(hidden_size=128, intermediate_size=128, num_local_experts=4), 512, 2))


@pytest.fixture(autouse=True)
def _plain_cpu_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_every_case_and_column_is_reported(tmp_path, capsys):
    path = tmp_path / "transformers.json"
    report = run_transformers_bench(device="cpu", json_path=str(path), reps=1, rounds=1,
                                    cases=TINY)
    assert json.loads(path.read_text()) == report
    assert [c["case"] for c in report["cases"]] == ["tiny_qwen3", "tiny_gpt_oss"]
    for case in report["cases"]:
        assert set(case["columns"]) == {BASELINE, "grouped_linear"}
        assert case["columns"][BASELINE]["speedup"] == 1.0
        for column in case["columns"].values():
            assert math.isfinite(column["tflops"]) and column["tflops"] > 0
            assert column["rel_diff"] < 1e-5  # float32 on CPU: the same function
    out = capsys.readouterr().out
    assert render_transformers_table(report) in out


def test_the_cases_are_the_families_measured():
    assert {c.experts_class for c in CASES} == {"Qwen3MoeExperts", "GptOssExperts",
                                                "MixtralExperts", "DeepseekV3Experts"}


def test_bf16_on_cpu_is_measured_when_asked(monkeypatch):
    """``--dtype bf16`` reaches the suite, which then builds bf16 modules on CPU; other suites
    of whole cases refuse it."""
    import grouped_linear.cli.bench_transformers as suite

    seen = {}
    monkeypatch.setattr(suite, "run_transformers_bench", lambda **kwargs: seen.update(kwargs))
    assert main(["bench", "--suite", "transformers", "--device", "cpu", "--dtype", "bf16"]) == 0
    assert seen["dtype"] == "bf16"
    monkeypatch.undo()
    report = run_transformers_bench(device="cpu", reps=1, rounds=1, cases=TINY[:1],
                                    dtype="bf16")
    assert report["dtype"] == "bfloat16"
    columns = report["cases"][0]["columns"]
    assert 0 < columns["grouped_linear"]["rel_diff"] < 2e-2  # bf16: each rounds its own way
    with pytest.raises(SystemExit, match="--dtype"):
        main(["bench", "--suite", "moe", "--dtype", "bf16"])


def test_suite_refuses_gemm_only_options():
    with pytest.raises(SystemExit, match="--shapes"):
        main(["bench", "--suite", "transformers", "--shapes", "x"])


@pytest.mark.parametrize("argv, rounds", [([], 3), (["--rounds", "5"], 5)])
def test_the_command_runs_three_alternating_rounds_unless_told(monkeypatch, argv, rounds):
    """``bench --suite transformers`` measures three alternating rounds by default (the
    gemm suite one), or ``--rounds``."""
    import grouped_linear.cli.bench_transformers as suite

    seen = {}
    monkeypatch.setattr(suite, "run_transformers_bench", lambda **kwargs: seen.update(kwargs))
    assert main(["bench", "--suite", "transformers", "--device", "cpu", *argv]) == 0
    assert seen["rounds"] == rounds
