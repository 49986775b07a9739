"""Whole tiny transformers models with grouped_linear's experts: logits, gradients and
optimizer steps against transformers' eager experts, one-line enabling, checkpoints."""

from __future__ import annotations

import copy
import functools
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers

import grouped_linear as gl
import grouped_linear.integrations.transformers as gl_hf
from tests.integrations.test_transformers_families import _build, _inputs, _run
from tests.integrations.tiny_models import FAMILIES, tiny_model
from tests.reference import rel_err


def _expert_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if "experts" in n and p.grad is not None}


def _loss(model, ids):
    return model(ids, labels=ids).loss


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_expert_gradients_match_eager(family):
    model = tiny_model(family, torch.float32)
    want_logits = model(IDS).logits.detach()
    _loss(model, IDS).backward()
    want = _expert_grads(model)
    model.zero_grad()
    assert gl_hf.enable(model) is model
    assert model.config._experts_implementation == gl_hf.NAME
    assert rel_err(model(IDS).logits, want_logits) < 1e-5
    _loss(model, IDS).backward()
    got = _expert_grads(model)
    assert got.keys() == want.keys() and want
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-4, name


@pytest.mark.parametrize("family", FAMILIES)
def test_five_sgd_steps_stay_in_step_with_eager(family):
    models = [tiny_model(family, torch.float64), tiny_model(family, torch.float64)]
    gl_hf.enable(models[1])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(5):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            _loss(model, ids).backward()
            optimizer.step()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert rel_err(b, a) < 1e-5, name


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _adamw_update(family: str, implementation: str) -> torch.Tensor:
    """What five AdamW steps (lr 1e-3) add to the parameters of a one-layer fp32 model of
    ``family`` run with ``implementation``, flattened into one vector (one layer: the
    entry's Triton kernels run interpreted on CPU, a few seconds a family)."""
    model = tiny_model(family, torch.float32, num_hidden_layers=1)
    if implementation == gl_hf.NAME:
        gl_hf.enable(model)
    else:
        model.set_experts_implementation(implementation)
    start = _flat(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        _loss(model, ids).backward()
        optimizer.step()
    return _flat(model) - start


@pytest.mark.parametrize("family", FAMILIES)
def test_five_adamw_steps_drift_from_eager_no_more_than_transformers_grouped_mm(family):
    """fp32 AdamW: the entry's update after five steps is as close to eager's as that of
    transformers' own ``grouped_mm``. AdamW divides each gradient by its running size, so a
    rounding difference in a small gradient element becomes a difference of order lr in the
    update; any other summation order drifts too, hence a bound relative to grouped_mm's."""
    want = _adamw_update(family, "eager")
    theirs = rel_err(_adamw_update(family, "grouped_mm"), want)
    ours = rel_err(_adamw_update(family, gl_hf.NAME), want)
    # Measured on six sequences of batches per family: theirs 2e-7..3e-6, ours/theirs
    # 0.8..4.3 (about 2 typically: the entry rounds in another order, e.g. it scales the
    # activation by the routing weights where eager scales fc2's output). c = 4, eps = 1e-6
    # (some 16 float32 roundings of 2**-24) cover the batches where grouped_mm's drift is
    # small; expert outputs off by 1e-5 (random, per element) or 1e-4 (uniformly) break it.
    assert ours <= 4 * theirs + 1e-6, (ours, theirs)


def test_from_pretrained_with_the_entry_and_a_round_trip_of_the_checkpoint(tmp_path):
    model = tiny_model("qwen3_moe", torch.float32)
    keys = set(model.state_dict())
    gl_hf.enable(model)
    model.save_pretrained(tmp_path)
    gl_hf.register()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation=gl_hf.NAME, dtype=torch.float32)
    assert loaded.config._experts_implementation == gl_hf.NAME
    assert set(loaded.state_dict()) == keys
    assert rel_err(loaded(IDS).logits, model(IDS).logits) < 1e-6


def test_fp8_entry_runs_the_recipe_and_stays_close():
    model = tiny_model("mixtral", torch.float32)
    want = model(IDS).logits.detach()
    gl_hf.enable(model, recipe=gl.recipes.Float8Rowwise())
    assert model.config._experts_implementation == "grouped_linear_fp8_rowwise"
    got = model(IDS).logits
    error = rel_err(got, want)
    assert 1e-6 < error < 6e-2  # quantized, within the FP8 bound
    with gl.autocast(gl.recipes.Float8Blockwise()):  # the plain entry follows gl.autocast
        gl_hf.enable(model)
        assert 1e-6 < rel_err(model(IDS).logits, want) < 6e-2


def _logits_and_grads(model):
    model.zero_grad()
    out = model(IDS, labels=IDS)
    out.loss.backward()
    return out.logits.detach(), _expert_grads(model)


@functools.cache
def _mixtral_references():
    """Logits and expert gradients of the tiny fp32 Mixtral model: eager's, and the entry's
    under the default rowwise recipe."""
    model = tiny_model("mixtral", torch.float32)
    eager = _logits_and_grads(model)
    gl_hf.enable(model)
    with gl.autocast(gl.recipes.Float8Rowwise()):
        return eager, _logits_and_grads(model)


@pytest.mark.parametrize("name, recipe", [
    ("grouped_linear_fp8_tensorwise", gl.recipes.Float8Tensorwise()),
    ("grouped_linear_fp8_blockwise", gl.recipes.Float8Blockwise()),
    (None, gl.recipes.Float8Rowwise(fp8_format="hybrid")),  # by enable(model, recipe=...)
], ids=["tensorwise", "blockwise", "enable_rowwise_hybrid"])
def test_each_fp8_entry_runs_its_recipe_and_stays_close(name, recipe):
    """The FP8 entries by name, and ``enable`` with a recipe of other settings: the result
    of the plain entry under ``gl.autocast(recipe)``, bit for bit (that recipe ran, not the
    default rowwise one: hybrid's E5M2 gradients differ), within the FP8 bounds of eager."""
    eager, rowwise = _mixtral_references()
    model = tiny_model("mixtral", torch.float32)
    gl_hf.enable(model)
    with gl.autocast(recipe):
        want_logits, want_grads = _logits_and_grads(model)
    if name is None:
        gl_hf.enable(model, recipe=recipe)
        name = f"grouped_linear_{recipe!r}"
    else:
        model.set_experts_implementation(name)
    assert model.config._experts_implementation == name
    logits, grads = _logits_and_grads(model)
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys() == eager[1].keys() and grads
    assert 1e-6 < rel_err(logits, eager[0]) < 6e-2  # quantized, within the FP8 bound
    for key, grad in grads.items():
        assert torch.equal(grad, want_grads[key]), key
        # two FP8 GEMMs in a chain for the weight gradients: 1.2e-1, as on CUDA
        assert 1e-3 < rel_err(grad, eager[1][key]) < 1.2e-1, key
        assert rel_err(grad, rowwise[1][key]) > 1e-3, key


def test_fp8_entry_combines_as_under_autocast_where_the_weights_scale_the_combine():
    """GPT-OSS (fc2 biased: the routing weights scale the combine, not the activation): the
    named rowwise entry gives the plain entry's results under ``gl.autocast`` bit for bit,
    the routing weights' gradient included (the combine keeps its input in that recipe's
    FP8 codes), and leaves no recipe set behind."""
    gl_hf.register()
    experts = copy.deepcopy(_build("transformers.models.gpt_oss.modeling_gpt_oss",
                                   "GptOssExperts")).float()
    hidden, index, weights = (t.float() if t.is_floating_point() else t
                              for t in _inputs(experts))
    recipe = gl.recipes.Float8Rowwise()
    with gl.autocast(recipe):
        want = _run(experts, gl_hf.NAME, hidden, index, weights)
    got = _run(experts, "grouped_linear_fp8_rowwise", hidden, index, weights)
    assert gl.recipes.current_recipe() is None
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    for name in want[3]:
        assert torch.equal(got[3][name], want[3][name]), name
    plain = _run(experts, gl_hf.NAME, hidden, index, weights)  # no recipe: no FP8 at all
    assert not torch.equal(plain[2], want[2])


def _bad_calls(hidden, index, weights, num_experts):
    """(label, (hidden_states, top_k_index, top_k_weights), error, message pattern)."""
    return [
        ("width", (torch.randn(hidden.shape[0], hidden.shape[1] + 1, dtype=hidden.dtype),
                   index, weights), ValueError,
         rf"hidden_states has shape \({hidden.shape[0]}, {hidden.shape[1] + 1}\)"),
        ("3-D hidden", (hidden[None], index, weights), ValueError, "hidden_states has shape"),
        ("list hidden", (hidden.tolist(), index, weights), TypeError, "hidden_states is list"),
        ("weights k+1", (hidden, index, torch.rand(hidden.shape[0], index.shape[1] + 1,
                                                   dtype=weights.dtype)),
         ValueError, "top_k_weights has shape"),
        ("index rows", (hidden, index[:-1], weights[:-1]), ValueError, "top_k_index has shape"),
        ("int weights", (hidden, index, torch.ones_like(index)), TypeError,
         "top_k_weights has dtype torch.int64"),
        ("float index", (hidden, index.double(), weights), TypeError,
         "top_k_index has dtype torch.float64"),
        ("index past the experts", (hidden, index + num_experts, weights), ValueError,
         rf"top_k_index\[0, 0\] is {int(index[0, 0]) + num_experts}: .*_is_expert_parallel"),
    ]


@pytest.mark.parametrize("family, class_name", [("qwen3_moe", "Qwen3MoeExperts"),
                                                ("gpt_oss", "GptOssExperts")])
def test_bad_calls_are_named_by_the_entry_arguments(family, class_name):
    """Each bad argument is refused by transformers' name for it (not the names of the ops
    the entry runs), with its value, before the module changes."""
    gl_hf.register()
    experts = copy.deepcopy(_build(f"transformers.models.{family}.modeling_{family}",
                                   class_name))
    experts.__dict__.pop(gl_hf._ATTRIBUTE, None)
    experts.config._experts_implementation = gl_hf.NAME
    hidden, index, weights = _inputs(experts)
    for label, args, error, pattern in _bad_calls(hidden, index, weights, experts.num_experts):
        with pytest.raises(error, match=pattern):
            experts(*args)
        assert not hasattr(experts, gl_hf._ATTRIBUTE), label
        assert all(p.grad is None for p in experts.parameters()), label


def test_fp8_entry_follows_the_optimizer_updates():
    """After optimizer steps the FP8 entry computes from the updated weights: the trained
    model's logits equal those of a fresh model given its weights (nothing quantized from
    the old weights is reused)."""
    recipe = gl.recipes.Float8Rowwise()
    model = tiny_model("qwen3_moe", torch.float32)
    gl_hf.enable(model, recipe=recipe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model(IDS).logits.detach()
    for _ in range(2):
        optimizer.zero_grad()
        _loss(model, IDS).backward()
        optimizer.step()
    fresh = tiny_model("qwen3_moe", torch.float32)
    fresh.load_state_dict(model.state_dict())
    gl_hf.enable(fresh, recipe=recipe)
    with torch.no_grad():
        after, want = model(IDS).logits, fresh(IDS).logits
    assert rel_err(after, before) > 1e-3  # the steps changed the model
    assert torch.equal(after, want)


def test_gradient_checkpointing():
    model = tiny_model("olmoe", torch.float64)
    _loss(model, IDS).backward()
    want = _expert_grads(model)
    model.zero_grad()
    gl_hf.enable(model)
    model.gradient_checkpointing_enable()
    model.train()
    _loss(model, IDS).backward()
    got = _expert_grads(model)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-10, name


def test_enable_rejects_what_is_not_a_transformers_model():
    with pytest.raises(TypeError, match="model is Linear"):
        gl_hf.enable(torch.nn.Linear(2, 2))
    with pytest.raises((TypeError, ValueError), match="recipe"):
        gl_hf.enable(tiny_model("olmoe"), recipe="fp8")
    # a transformers model without experts modules: refused, left as it was
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48)
    dense = transformers.AutoModelForCausalLM.from_config(config)
    before = dense.config._experts_implementation
    with pytest.raises(ValueError, match="model is a LlamaForCausalLM without experts modules"):
        gl_hf.enable(dense)
    assert dense.config._experts_implementation == before


def test_enable_switches_a_subclass_transformers_would_not():
    """A model class subclassed in a user's script or notebook, whose source transformers
    cannot read (its switch then leaves the config alone): enable() still switches every
    experts module, and the model then matches eager."""
    model = tiny_model("qwen3_moe")
    want = model(IDS).logits.detach()
    user_class = type("UserQwen3Moe", (type(model),), {
        "__module__": "builtins", "_can_set_experts_implementation_cached_value": False})
    model.__class__ = user_class
    gl_hf.register()
    model.set_experts_implementation(gl_hf.NAME)
    assert model.config._experts_implementation == "eager"  # transformers' own switch: none
    calls = []
    original = gl_hf._forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gl_hf, "_forward", lambda *a, **k: calls.append(1) or original(*a, **k))
        gl_hf.enable(model)
        got = model(IDS).logits
    assert model.config._experts_implementation == gl_hf.NAME
    assert len(calls) == model.config.num_hidden_layers
    assert rel_err(got, want) < 1e-10


def test_enable_probes_every_gate_again():
    """An ``act_fn`` replaced on every experts module is found by enable() (and the model then
    matches eager with the new activation)."""
    from transformers.activations import ACT2FN

    model = tiny_model("qwen3_moe")
    gl_hf.enable(model)
    experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]
    assert experts and all(gl_hf._fused_activation(m)["activation"] == "swiglu"
                           for m in experts)
    for module in experts:
        module.act_fn = ACT2FN["gelu_pytorch_tanh"]
    gl_hf.enable(model)
    assert all(getattr(m, gl_hf._ATTRIBUTE)[1]["activation"] == "geglu" for m in experts)
    got = model(IDS).logits
    model.set_experts_implementation("eager")
    assert rel_err(got, model(IDS).logits) < 1e-10


def test_a_rejected_call_leaves_the_module_unprobed():
    """Indices past the experts (not expert-parallel) and a dtype mismatch are refused on the
    module's first call; the gate it probed is not remembered."""
    gl_hf.register()
    experts = copy.deepcopy(_build("transformers.models.qwen3_moe.modeling_qwen3_moe",
                                   "Qwen3MoeExperts"))
    experts.__dict__.pop(gl_hf._ATTRIBUTE, None)  # the shared instance may have run already
    hidden, index, weights = _inputs(experts)
    experts.config._experts_implementation = gl_hf.NAME
    with pytest.raises(ValueError, match="top_k_index"):
        experts(hidden, index + experts.num_experts, weights)
    with pytest.raises(TypeError, match="dtype"):
        experts(hidden.float(), index, weights.float())
    assert not hasattr(experts, gl_hf._ATTRIBUTE)
    experts(hidden, index, weights)
    assert getattr(experts, gl_hf._ATTRIBUTE)[1]["activation"] == "swiglu"


def compiled_matches_eager() -> None:
    """A tiny Qwen3-MoE model with the entry, compiled: no graph break, eager's logits and
    expert gradients (the gates are probed by enable(), outside the compiled region)."""
    import torch._dynamo.utils

    model = tiny_model("qwen3_moe", torch.float32)
    want = model(IDS).logits.detach()
    _loss(model, IDS).backward()
    want_grads = _expert_grads(model)
    model.zero_grad()
    gl_hf.enable(model)
    torch._dynamo.utils.counters.clear()
    out = torch.compile(model, backend="aot_eager")(IDS, labels=IDS)
    out.loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    assert rel_err(out.logits, want) < 1e-5
    for name, grad in _expert_grads(model).items():
        assert rel_err(grad, want_grads[name]) < 1e-4, name


def test_torch_compile_of_the_model_without_graph_breaks():
    """Run in a child process without TRITON_INTERPRET, as users run on CPU: dynamo cannot
    trace Triton's interpreter, which the rest of the suite runs kernels under."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", "from tests.integrations.test_transformers_models import "
         "compiled_matches_eager as check; check()"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
