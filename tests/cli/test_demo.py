"""The demo trains: the loss falls from about log(vocab) towards the chain's entropy."""

import math

import pytest

from grouped_linear.cli.demo import DemoConfig, run_demo
from grouped_linear.cli.main import main


@pytest.fixture(autouse=True)
def _plain_cpu_kernels(monkeypatch):
    """Run the CLI as users get it on CPU: PyTorch kernels, not Triton's (slow) interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_short_demo_loss_falls_and_is_deterministic():
    first = run_demo(steps=40, device="cpu", seed=0, quiet=True)
    assert math.isfinite(first["initial_loss"]) and math.isfinite(first["final_loss"])
    assert first["initial_loss"] > 0.9 * math.log(DemoConfig().vocab)
    assert first["final_loss"] < first["initial_loss"] - 0.5
    assert first["floor"] < first["final_loss"]
    assert sum(first["expert_load"]) == pytest.approx(1.0, abs=1e-3)

    again = run_demo(steps=40, device="cpu", seed=0, quiet=True)
    assert again["final_loss"] == first["final_loss"]


def test_demo_command_prints_summary(capsys):
    assert main(["demo", "--steps", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("initial loss", "final loss", "floor", "wall time"):
        assert word in out


def test_demo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        run_demo(steps=0, quiet=True)
    with pytest.raises(ValueError, match="device"):
        run_demo(steps=1, device="tpu", quiet=True)


def test_expert_parallel_demo_over_two_processes_learns():
    result = run_demo(steps=60, device="cpu", seed=0, quiet=True, ep=2)
    assert result["device"].startswith("2 CPU processes")
    assert result["final_loss"] < result["initial_loss"] - 0.5


def test_expert_parallel_demo_rejects_bad_settings():
    with pytest.raises(ValueError, match="ep=3 must divide num_experts=8"):
        run_demo(steps=1, device="cpu", quiet=True, ep=3)
    with pytest.raises(SystemExit, match="--ep must be >= 1, got 0"):
        main(["demo", "--ep", "0"])
