"""The MoE block benchmark suite runs at tiny sizes on CPU and reports sane numbers."""

import json
import math

import pytest

import grouped_linear.cli.bench_moe as bench_moe
from grouped_linear.cli.bench_moe import (
    BASELINE,
    CASES,
    PRIMARY,
    RECIPES,
    RECOMPUTED,
    Case,
    render_moe_table,
    run_moe_bench,
)
from grouped_linear.cli.main import main

# On CPU the suite divides widths by 8 and tokens by 256: 4 experts, H = 32, F = 16, T = 32.
TINY = (Case("tiny", num_experts=4, top_k=2, hidden=256, ffn=128, tokens=8192),)


@pytest.fixture(autouse=True)
def _plain_cpu_kernels(monkeypatch):
    """Run the CLI as users get it on CPU: PyTorch kernels, not Triton's (slow) interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_every_column_is_reported_with_its_errors(tmp_path, capsys):
    path = tmp_path / "moe.json"
    report = run_moe_bench(device="cpu", json_path=str(path), reps=1, rounds=1, cases=TINY)
    assert json.loads(path.read_text()) == report
    assert report["dtype"] == "float32"
    (case,) = report["cases"]
    assert (case["case"], case["num_experts"], case["top_k"]) == ("tiny", 4, 2)
    assert (case["hidden"], case["ffn"], case["tokens"]) == (32, 16, 32)
    T, k, H, F = case["tokens"], case["top_k"], case["hidden"], case["ffn"]
    assert case["flops"] == 6 * T * k * H * 3 * F
    assert list(case["columns"]) == [BASELINE, *RECIPES,
                                     *(f"{name}_recompute" for name in RECOMPUTED),
                                     *(f"{name}_primary" for name in PRIMARY)]
    assert case["columns"][BASELINE]["speedup"] == 1.0
    base_ms = case["columns"][BASELINE]["ms"]
    for name, column in case["columns"].items():
        assert math.isfinite(column["tflops"]) and column["tflops"] > 0, name
        assert column["tflops"] == pytest.approx(case["flops"] / (column["ms"] * 1e-3) / 1e12)
        assert column["speedup"] == pytest.approx(base_ms / column["ms"])
        assert column["peak_bytes"] is None and column["saved_bytes"] is None  # CPU
    for key in ("rel_err_out", "rel_err_dx"):
        assert case["columns"][BASELINE][key] < 1e-5  # float32 against float64
        for name in case["columns"]:  # the FP8 columns quantize, within FP8's error
            if name != BASELINE:
                assert 1e-4 < case["columns"][name][key] < 1e-1, (name, key)
    for name in PRIMARY:  # the weights' FP8 codes are the ones the recipe makes per step
        for key in ("rel_err_out", "rel_err_dx"):
            assert case["columns"][f"{name}_primary"][key] == pytest.approx(
                case["columns"][name][key], rel=1e-3)
    out = capsys.readouterr().out
    assert render_moe_table(report) in out
    assert "rel. err dx" in out and "fp8_blockwise" in out


def test_the_reference_is_the_block_in_float64():
    """The float64 loop over experts and the library's block (float32, no recipe) agree, and
    both follow the routing: a token's output is its experts' outputs weighted by probs."""
    import torch

    case = Case("check", num_experts=3, top_k=2, hidden=8, ffn=4, tokens=5)
    inputs = bench_moe._inputs(case, torch.device("cpu"), torch.float32)
    ref_out, ref_dx = bench_moe._reference(inputs)
    out = bench_moe._step(inputs, bench_moe.Column())()
    assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(inputs.x.grad.double(), ref_dx, rtol=1e-5, atol=1e-6)
    # one token by hand: sum_j p_j * fc2_e(silu(gate) * up), gate the first half of fc1
    w1, w2 = inputs.mlp.fc1.weight.double(), inputs.mlp.fc2.weight.double()
    x0 = inputs.x[0].double()
    expected = sum(float(p) * (w2[e] @ (torch.nn.functional.silu(w1[e, :4] @ x0)
                                        * (w1[e, 4:] @ x0)))
                   for p, e in zip(inputs.probs[0].tolist(), inputs.indices[0].tolist()))
    assert torch.allclose(ref_out[0], expected)
    assert torch.allclose(inputs.probs.sum(-1), torch.ones(5))


def test_fp8_primary_copies_carry_no_cached_weights_and_rounds_take_the_median(monkeypatch):
    """An FP8-primary column's module is copied from the block after the FP8 weights an
    earlier column cached are freed (else its peak counts a stale copy of them); an even
    number of rounds reports the median of the middle two."""
    import torch

    case = Case("check", num_experts=4, top_k=2, hidden=64, ffn=32, tokens=64)
    inputs = bench_moe._inputs(case, torch.device("cpu"), torch.float32)
    for column in bench_moe._columns(torch.device("cpu")).values():  # as the suite runs them
        for leaf in inputs.leaves(column):
            leaf.grad = None
        bench_moe._step(inputs, column)()
    assert inputs.primary
    for copy, _ in inputs.primary.values():
        assert copy.fc1._fp8_weights.entry is None and copy.fc2._fp8_weights.entry is None
    columns, calls = len(bench_moe._columns(torch.device("cpu"))), []

    def timed(*args, **kwargs):  # every column 1 s in the first round, 3 s in the second
        calls.append(None)
        return 1.0 if len(calls) <= columns else 3.0

    monkeypatch.setattr(bench_moe, "median_seconds", timed)
    report = bench_moe._measure_case(case, torch.device("cpu"), torch.float32, rounds=2, reps=1)
    assert {c["ms"] for c in report["columns"].values()} == {2000.0}


def test_the_cases_are_the_models_measured():
    assert {(c.name, c.num_experts, c.top_k, c.hidden, c.ffn, c.tokens) for c in CASES} == {
        ("deepseek_v3_ep8", 32, 8, 7168, 2048, 16384),
        ("mixtral_8x7b", 8, 2, 4096, 14336, 16384),
        ("qwen3_30b_a3b", 128, 8, 2048, 768, 16384),
    }


@pytest.mark.parametrize("argv, rounds", [([], 3), (["--rounds", "5"], 5)])
def test_bench_command_picks_the_suite(monkeypatch, argv, rounds):
    calls = []
    monkeypatch.setattr(bench_moe, "run_moe_bench", lambda **kwargs: calls.append(kwargs))
    assert main(["bench", "--suite", "moe", "--device", "cpu", "--json", "x.json",
                 "--reps", "2", *argv]) == 0
    assert calls == [{"device": "cpu", "json_path": "x.json", "reps": 2, "rounds": rounds}]


@pytest.mark.parametrize("flag", ["--shapes", "--plot", "--dtype", "--columns"])
def test_suite_refuses_gemm_only_options(monkeypatch, flag):
    monkeypatch.setattr(bench_moe, "run_moe_bench", lambda **kwargs: pytest.fail("ran"))
    value = {"--shapes": "x", "--plot": "x.png", "--dtype": "bf16", "--columns": "x"}[flag]
    with pytest.raises(SystemExit, match=f"{flag}: not for --suite moe"):
        main(["bench", "--suite", "moe", flag, value])
