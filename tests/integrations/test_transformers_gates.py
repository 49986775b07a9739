"""Which fused activation the transformers entry finds for each family's gate: the clamping
gates by their stored parameters, gates computed in float32, limits beyond the usual probe
range, and the clamped gates against the module's own when the limit binds."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.activations import ACT2FN

import grouped_linear.integrations.transformers as gl_hf
from tests.integrations.test_transformers_families import FAMILIES, _build, _inputs, _run
from tests.reference import rel_err

# Gates the fused kernels do not compute: a softcap of the gate's own.
OWN_GATES = {"Inkling2Experts", "Inkling2LoopExperts"}


def _experts(class_name: str) -> torch.nn.Module:
    module_name = next(m for m, c in FAMILIES if c == class_name)
    experts = _build(module_name, class_name)
    if experts is None:
        pytest.skip(f"no tiny configuration builds {class_name}")
    return copy.deepcopy(experts)  # the built instance is shared with other tests


def _limit_attribute(experts: torch.nn.Module) -> str:
    return "limit" if hasattr(experts, "limit") else "swiglu_limit"


@pytest.mark.parametrize("class_name, activation, order, names", [
    ("MiniMaxM3VLExperts", "gpt_oss_swiglu", "concatenated", ("swiglu_alpha", "swiglu_limit")),
    ("DeepseekV4Experts", "clamped_swiglu", "concatenated", (None, "limit")),
    ("Glm5NextTextExperts", "clamped_swiglu", "concatenated", (None, "swiglu_limit")),
    ("HYV4Experts", "clamped_swiglu", "concatenated", (None, "swiglu_limit")),
    ("HYV4VLExperts", "clamped_swiglu", "concatenated", (None, "swiglu_limit")),
    ("BeamExperts", "swiglu", "concatenated", (None, None)),
    ("NemotronHExperts", "relu2", "concatenated", (None, None)),
])
def test_gates_found_with_their_stored_parameters(class_name, activation, order, names):
    experts = _experts(class_name)
    fused = gl_hf._probe(experts)
    assert fused is not None
    assert (fused["activation"], fused["gate_up_order"]) == (activation, order)
    alpha_name, limit_name = names
    assert fused.get("alpha") == (getattr(experts, alpha_name) if alpha_name else None)
    assert fused.get("limit") == (getattr(experts, limit_name) if limit_name else None)


def test_every_family_but_its_own_gates_runs_fused():
    unfused = set()
    for module_name, class_name in FAMILIES:
        experts = _build(module_name, class_name)
        if experts is not None and gl_hf._probe(experts) is None:
            unfused.add(class_name)
    assert unfused <= OWN_GATES, unfused - OWN_GATES


@pytest.mark.parametrize("class_name", ["DeepseekV4Experts", "GptOssExperts"])
def test_a_limit_past_the_default_probe_range_is_still_told_apart(class_name):
    """At limit 40 a clamped gate equals the plain one up to 40: the probe spans twice the
    module's limit, so the clamp is seen."""
    experts = _experts(class_name)
    setattr(experts, _limit_attribute(experts), 40.0)
    fused = gl_hf._probe(experts)
    assert fused is not None and fused["limit"] == 40.0
    assert fused["activation"] in ("clamped_swiglu", "gpt_oss_swiglu")


@pytest.mark.parametrize("class_name", ["DeepseekV4Experts", "Glm5NextTextExperts",
                                        "MiniMaxM3VLExperts", "NemotronHExperts"])
def test_fused_gates_match_the_eager_module_where_the_limit_binds(class_name):
    """Outputs and every gradient against the module's own eager forward, with a limit small
    enough that most gate and up values are clamped."""
    gl_hf.register()
    experts = _experts(class_name)
    if class_name != "NemotronHExperts":
        setattr(experts, _limit_attribute(experts), 0.05)
    assert gl_hf._probe(experts) is not None
    hidden, index, weights = _inputs(experts)
    hidden = hidden * 4
    got = _run(experts, gl_hf.NAME, hidden, index, weights)
    want = _run(experts, "eager", hidden, index, weights)
    tol = 1e-6
    assert rel_err(got[0], want[0]) < tol and rel_err(got[1], want[1]) < tol
    assert rel_err(got[2], want[2]) < tol
    for name in want[3]:
        assert rel_err(got[3][name], want[3][name]) < tol, name


def test_a_limit_changed_after_the_first_call_is_followed():
    """The entry probes the gate again when the module's gate parameters change: after the
    first call at the default limit, a binding limit gives the eager result."""
    gl_hf.register()
    experts = _experts("DeepseekV4Experts")
    hidden, index, weights = _inputs(experts)
    hidden = hidden * 4
    _run(experts, gl_hf.NAME, hidden, index, weights)
    assert gl_hf._fused_activation(experts)["limit"] == experts.limit
    experts.limit = 0.05
    got = _run(experts, gl_hf.NAME, hidden, index, weights)
    want = _run(experts, "eager", hidden, index, weights)
    assert gl_hf._fused_activation(experts)["limit"] == 0.05
    assert rel_err(got[0], want[0]) < 1e-6 and rel_err(got[1], want[1]) < 1e-6


def test_without_transformers_the_entry_and_the_suite_say_what_to_install(monkeypatch, capsys):
    """``register`` (and so ``enable``) raises the integration's ImportError naming the
    package; the bench suite ends with a usage message instead of a traceback."""
    import sys

    from grouped_linear.cli.main import main
    from grouped_linear.integrations import MissingDependency

    monkeypatch.setitem(sys.modules, "transformers.integrations.moe", None)
    with pytest.raises(MissingDependency, match=r"transformers 5 or later"):
        gl_hf.register()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--suite", "transformers", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "transformers 5 or later" in capsys.readouterr().err


def _matches_eager(experts: torch.nn.Module, scale: float) -> None:
    """The entry's output and every gradient against the module's own eager forward, with
    the inputs scaled by ``scale`` (pre-activations far from zero)."""
    hidden, index, weights = _inputs(experts)
    hidden = hidden * scale
    got = _run(experts, gl_hf.NAME, hidden, index, weights)
    want = _run(experts, "eager", hidden, index, weights)
    assert rel_err(got[0], want[0]) < 1e-6 and rel_err(got[1], want[1]) < 1e-6
    assert rel_err(got[2], want[2]) < 1e-6
    for name in want[3]:
        assert rel_err(got[3][name], want[3][name]) < 1e-6, name


@pytest.mark.parametrize("class_name, act, clip", [
    ("NemotronHExperts", "relu6", 6.0),  # non-gated: relu up to 6
    ("Qwen3MoeExperts", "gelu_10", 10.0),  # gated: erf-GELU up to 10
])
def test_an_activation_that_departs_from_a_kind_late_is_not_taken_for_it(class_name, act,
                                                                           clip):
    """Activations equal to a fused kind near zero but clipped further out run the module's
    own (unfused), and the entry matches eager where the clip binds."""
    gl_hf.register()
    experts = _experts(class_name)
    experts.act_fn = ACT2FN[act]
    assert gl_hf._probe(experts) is None
    hidden, index, _ = _inputs(experts)
    _matches_eager(experts, scale=4 * clip / float(hidden.abs().max()))


def test_a_replaced_activation_function_is_probed_again():
    """After the first call, a new ``act_fn`` (SiLU -> exact GELU) is found again, by the
    next call and by enable(), and the output follows it."""
    gl_hf.register()
    experts = _experts("Qwen3MoeExperts")
    _matches_eager(experts, scale=4.0)
    assert gl_hf._fused_activation(experts)["activation"] == "swiglu"
    experts.act_fn = ACT2FN["gelu"]
    _matches_eager(experts, scale=4.0)
    assert gl_hf._fused_activation(experts)["activation"] == "geglu_erf"


class _CudaOnly(torch.nn.Module):
    """SiLU that refuses CPU values, as an activation holding CUDA parameters would."""

    def forward(self, x):
        if x.device.type == "cpu" and x.dtype == torch.float64:
            raise RuntimeError("Expected all tensors to be on the same device")
        return torch.nn.functional.silu(x)


def test_learned_or_unprobeable_activations_run_as_the_modules_own():
    """An ``act_fn`` with parameters (PReLU: trained, so it changes) or one that cannot take
    the probe's values is not fused; the entry still matches eager."""
    gl_hf.register()
    for act_fn in (torch.nn.PReLU(dtype=torch.float64), _CudaOnly()):
        experts = _experts("NemotronHExperts")
        experts.act_fn = act_fn
        assert gl_hf._probe(experts) is None
    experts = _experts("NemotronHExperts")
    experts.act_fn = torch.nn.PReLU(dtype=torch.float64)
    _matches_eager(experts, scale=4.0)
