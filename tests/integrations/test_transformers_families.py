"""Every experts module of the installed transformers (found by scanning its modeling files
for ``use_experts_implementation``, not by a list) against its own eager forward: outputs and
every gradient in float64, the expert-parallel sentinel, no copy of the weights."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import re
import weakref

import pytest
import torch
from transformers.configuration_utils import PretrainedConfig

import grouped_linear.integrations.transformers as gl_hf
from tests.reference import HOLDS_ARGUMENTS, rel_err, saved_by

_DECORATED = re.compile(r"@use_experts_implementation(?:\([^)]*\))?\s*\nclass (\w+)\(")
# Config attributes shrunk to a tiny model, by the words their names contain.
_SMALL = (("experts_per_tok", 2), ("top_k", 2), ("experts", 8), ("intermediate_size", 24),
          ("hidden_size", 32), ("head_dim", 8), ("vocab_size", 64), ("hidden_layers", 1))
_MAX_PARAMS = 1_000_000
# float64 throughout; some families' eager paths round a piece through float32
TOL = 1e-6


def _experts_classes() -> list[tuple[str, str]]:
    """``(module name, class name)`` of every decorated experts class."""
    models = pathlib.Path(importlib.util.find_spec("transformers.models").origin).parent
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        for name in _DECORATED.findall(path.read_text()):
            found.append((f"transformers.models.{path.parent.name}.{path.stem}", name))
    return found


def _shrink(config: PretrainedConfig) -> PretrainedConfig:
    for key, value in list(vars(config).items()):
        for word, small in _SMALL:
            if word not in key:
                continue
            if value is None:  # an unset MoE size (the family's default is dense)
                setattr(config, key, small)
            elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
                setattr(config, key, min(value, small))
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                setattr(config, key, [min(v, small) for v in value])  # per modality
            break
    return config


def _configs(module) -> list[PretrainedConfig]:
    """Tiny configs of every config class the modeling module names, sub-configs included."""
    classes = [obj for obj in vars(module).values()
               if isinstance(obj, type) and issubclass(obj, PretrainedConfig)
               and obj is not PretrainedConfig]
    configs = []
    for cls in classes:
        try:
            config = cls()
        except Exception:  # noqa: BLE001 (configs that need arguments are skipped)
            continue
        configs.append(_shrink(config))
        for sub in getattr(config, "sub_configs", {}):
            value = getattr(config, sub, None)
            if isinstance(value, PretrainedConfig):
                configs.append(_shrink(value))
    return configs


@functools.cache
def _build(module_name: str, class_name: str):
    """A tiny float64 instance of the experts class, or the reason there is none."""
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    for config in _configs(module):
        # some families pass the expert width (one of several, per modality) explicitly
        sizes = getattr(config, "moe_intermediate_size", None)
        args = (sizes[0],) if isinstance(sizes, list) else ()
        try:
            with torch.device("meta"):
                probe = cls(config, *args)
        except Exception:  # noqa: BLE001 (a config of another part of the model)
            continue
        if not hasattr(probe, "num_experts"):
            continue
        if sum(p.numel() for p in probe.parameters()) > _MAX_PARAMS:
            continue
        torch.manual_seed(0)
        experts = cls(config, *args).double()
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.2)
        return experts
    return None


FAMILIES = _experts_classes()
# Layouts of their own: transposed (Aria), transposed, biased and interleaved (GPT-OSS),
# not gated (NemotronH), a norm after the experts (MuseSpark).
LAYOUTS = {"AriaExperts", "GptOssExperts", "NemotronHExperts", "MuseSparkExperts"}
SENTINEL_FAMILIES = FAMILIES[::7] + [f for f in FAMILIES if f[1] in LAYOUTS
                                     and f not in FAMILIES[::7]]


def test_the_scan_finds_the_families_the_integration_is_measured_on():
    names = {cls for _, cls in FAMILIES}
    assert {"Qwen3MoeExperts", "MixtralExperts", "OlmoeExperts", "DeepseekV3Experts",
            "Qwen2MoeExperts", "GptOssExperts"} <= names
    assert len(FAMILIES) >= 40
    assert LAYOUTS <= names


def _run(experts, implementation, hidden, index, weights):
    experts.config._experts_implementation = implementation
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    for p in experts.parameters():
        p.grad = None
    out = experts(hidden, index, weights)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
    return out.detach(), hidden.grad, weights.grad, grads


def _inputs(experts, tokens=13, k=2, seed=1):
    k = min(k, experts.num_experts)
    generator = torch.Generator().manual_seed(seed)
    hidden_size = next(p for n, p in experts.named_parameters() if "down_proj" in n)
    hidden_size = hidden_size.shape[2] if experts.is_transposed else hidden_size.shape[1]
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:k]
                         for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator, dtype=torch.float64)
    return hidden, index, weights


@pytest.mark.parametrize("module_name, class_name", FAMILIES, ids=[c for _, c in FAMILIES])
def test_matches_the_eager_experts(module_name, class_name):
    gl_hf.register()
    experts = _build(module_name, class_name)
    assert experts is not None, "no tiny config builds this experts module"
    hidden, index, weights = _inputs(experts)
    want = _run(experts, "eager", hidden, index, weights)
    got = _run(experts, gl_hf.NAME, hidden, index, weights)
    for a, b in zip(got[:3], want[:3]):
        assert rel_err(a, b) < TOL
    assert got[3].keys() == want[3].keys()
    for name in want[3]:
        assert rel_err(got[3][name], want[3][name]) < TOL, name


@pytest.mark.parametrize("module_name, class_name", SENTINEL_FAMILIES,
                         ids=[c for _, c in SENTINEL_FAMILIES])
def test_expert_parallel_sentinels_are_dropped_slots(module_name, class_name):
    """Indices ``>= num_experts`` (another rank's experts) contribute nothing: as the same
    slot given weight zero."""
    gl_hf.register()
    experts = _build(module_name, class_name)
    hidden, index, weights = _inputs(experts, seed=2)
    foreign = torch.zeros_like(index, dtype=torch.bool)
    foreign[::3, 0] = True
    experts._is_expert_parallel = True
    try:
        got = _run(experts, gl_hf.NAME, hidden, torch.where(foreign, experts.num_experts + 3,
                                                             index), weights)
    finally:
        experts._is_expert_parallel = False
    want = _run(experts, "eager", hidden, index, weights.masked_fill(foreign, 0))
    assert rel_err(got[0], want[0]) < TOL and rel_err(got[1], want[1]) < TOL
    for name in want[3]:
        assert rel_err(got[3][name], want[3][name]) < TOL, name


@pytest.mark.parametrize("class_name", ["Qwen3MoeExperts", "GptOssExperts", "NemotronHExperts"])
def test_the_entry_computes_on_the_parameters_themselves(monkeypatch, class_name):
    """No copy of the weights: the weights and biases the entry hands grouped_mlp (or
    grouped_linear), and the weights its GEMMs get, lie in the parameters' own memory, as
    ``(E, out, in)`` views (of the stored ``(E, in, out)`` where transposed)."""
    import grouped_linear.ops.mlp as mlp_ops

    linear_ops = importlib.import_module("grouped_linear.ops.grouped_linear")
    gl_hf.register()
    experts = _build(next(m for m, c in FAMILIES if c == class_name), class_name)
    hidden, index, weights = _inputs(experts)
    experts.config._experts_implementation = gl_hf.NAME
    handed, gemm_weights = [], []
    real_mlp, real_linear = gl_hf.grouped_mlp, gl_hf.grouped_linear
    real_gemm = linear_ops.apply_grouped_linear

    def grouped_mlp(x, w1, b1, w2, b2, *args, **kwargs):
        handed.extend([w1, b1, w2, b2])
        return real_mlp(x, w1, b1, w2, b2, *args, **kwargs)

    def grouped_linear(x, weight, bias, *args, **kwargs):  # fc1, then fc2
        handed.extend([weight, bias])
        return real_linear(x, weight, bias, *args, **kwargs)

    def apply_grouped_linear(x, weight, *args, **kwargs):
        gemm_weights.append(weight)
        return real_gemm(x, weight, *args, **kwargs)

    monkeypatch.setattr(gl_hf, "grouped_mlp", grouped_mlp)
    monkeypatch.setattr(gl_hf, "grouped_linear", grouped_linear)
    monkeypatch.setattr(mlp_ops, "apply_grouped_linear", apply_grouped_linear)
    monkeypatch.setattr(linear_ops, "apply_grouped_linear", apply_grouped_linear)
    experts(hidden.requires_grad_(), index, weights).sum().backward()
    params = dict(experts.named_parameters())
    fc1 = "gate_up_proj" if experts.has_gate else "up_proj"
    names = [fc1, fc1 + "_bias", "down_proj", "down_proj_bias"]
    want = [params[name] if experts.has_bias or "bias" not in name else None for name in names]
    want = [p.transpose(1, 2) if p is not None and p.dim() == 3 and experts.is_transposed
            else p for p in want]
    assert len(handed) == 4 and len(gemm_weights) == 2
    for name, got, view in zip(names + names[::2], handed + gemm_weights, want + want[::2]):
        if view is None:
            assert got is None, name
            continue
        assert got.untyped_storage().data_ptr() == view.untyped_storage().data_ptr(), name
        assert (got.data_ptr(), got.shape, got.stride()) == \
            (view.data_ptr(), view.shape, view.stride()), name
    assert all(p.grad is not None for name, p in params.items() if "proj" in name)


@pytest.mark.parametrize("class_name, activation, order", [
    ("Qwen3MoeExperts", "swiglu", "concatenated"), ("MixtralExperts", "swiglu", "concatenated"),
    ("OlmoeExperts", "swiglu", "concatenated"), ("DeepseekV3Experts", "swiglu", "concatenated"),
    ("Qwen2MoeExperts", "swiglu", "concatenated"),
    ("GptOssExperts", "gpt_oss_swiglu", "interleaved")])
def test_the_measured_families_run_a_fused_activation(class_name, activation, order):
    """Their gate is recognised as one of the library's fused activations (the families whose
    gate is their own, a softcap or a squared ReLU, run it unfused and still match above)."""
    module_name = next(m for m, c in FAMILIES if c == class_name)
    fused = gl_hf._fused_activation(_build(module_name, class_name))
    assert fused is not None
    assert (fused["activation"], fused["gate_up_order"]) == (activation, order)
    if activation == "gpt_oss_swiglu":
        experts = _build(module_name, class_name)
        assert (fused["alpha"], fused["limit"]) == (experts.alpha, experts.limit)


@pytest.mark.parametrize("class_name, weighted_inside", [("Qwen3MoeExperts", True),
                                                         ("MixtralExperts", True),
                                                         ("GptOssExperts", False)])
def test_routing_weights_scale_the_activation_where_fc2_has_no_bias(class_name, weighted_inside):
    """Without a down-projection bias or post-expert norm the routing weights scale the
    activation's rows, and backward keeps one ``(rows, H)`` tensor (fc1's input), not also
    the expert outputs for the weights' gradient; GPT-OSS (biased) weighs after fc2."""
    gl_hf.register()
    experts = _build(next(m for m, c in FAMILIES if c == class_name), class_name)
    hidden, index, weights = _inputs(experts)
    experts.config._experts_implementation = gl_hf.NAME
    saved, _ = saved_by(lambda: experts(hidden.requires_grad_(), index,
                                        weights.requires_grad_()))
    rows = (index.shape[0] * index.shape[1], hidden.shape[1])
    copies = {t.untyped_storage().data_ptr() for t in saved if tuple(t.shape) == rows}
    assert len(copies) == (1 if weighted_inside else 2)


@pytest.mark.parametrize("class_name", ["Qwen3MoeExperts", "GptOssExperts"])
def test_the_permuted_rows_are_freed_once_fc1_has_read_them(monkeypatch, class_name):
    """Inference: the permuted rows are gone before fc2 runs (the entry keeps no reference
    of its own); in training fc1's weight gradient keeps them."""
    import grouped_linear.ops.mlp as mlp_ops

    gl_hf.register()
    experts = _build(next(m for m, c in FAMILIES if c == class_name), class_name)
    hidden, index, weights = _inputs(experts)
    experts.config._experts_implementation = gl_hf.NAME
    permuted, seen = [], []
    real_permute, real_linear = gl_hf.permute, mlp_ops.apply_grouped_linear

    def permute(*args, **kwargs):
        out = real_permute(*args, **kwargs)
        permuted.append(weakref.ref(out[0]))
        return out

    def linear(rows, *args, **kwargs):
        seen.append(permuted[-1]() is not None)
        return real_linear(rows, *args, **kwargs)

    monkeypatch.setattr(gl_hf, "permute", permute)
    monkeypatch.setattr(mlp_ops, "apply_grouped_linear", linear)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            got = experts(hidden, index, weights)
        assert seen[-2:] == [True, grad or HOLDS_ARGUMENTS]
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        assert rel_err(got.detach(), experts(hidden, index, weights)) < TOL
