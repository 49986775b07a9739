"""Tiny random transformers causal-LM models of the MoE families the integration is
measured on, shared by the CPU and the CUDA tests."""

from __future__ import annotations

import torch
import transformers

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=48,
            num_experts_per_tok=2, max_position_embeddings=64)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=16),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "mixtral": dict(num_local_experts=8),
    "olmoe": dict(num_experts=8),
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=16, first_k_dense_replace=0,
                        n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        num_key_value_heads=4),
    "gpt_oss": dict(num_local_experts=8, intermediate_size=16, layer_types=None),
}


def tiny_model(family: str, dtype: torch.dtype = torch.float64, implementation: str = "eager",
               std: float = 0.1, **sizes) -> transformers.PreTrainedModel:
    """A 2-layer model of ``family`` (``sizes`` override the tiny config) with weights drawn
    from N(0, ``std``), in ``dtype``."""
    config = transformers.AutoConfig.for_model(family, **{**TINY, **FAMILIES[family], **sizes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation=implementation).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def experts_module(family: str, experts_class: str, dtype: torch.dtype = torch.float64,
                   std: float = 0.1, **config) -> torch.nn.Module:
    """One ``experts_class`` module of ``family`` built from ``config`` (sizes), its weights
    drawn from N(0, ``std``) with seed 0, in ``dtype``."""
    import importlib

    config = transformers.AutoConfig.for_model(family, **config)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(0)
    experts = getattr(module, experts_class)(config).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, std)
    return experts


def forward_backward(experts: torch.nn.Module, implementation: str, hidden: torch.Tensor,
                     index: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor) -> list:
    """The experts module's output, its input's gradient and every parameter's gradient under
    ``implementation`` (a transformers experts implementation name)."""
    experts.config._experts_implementation = implementation
    hidden = hidden.detach().requires_grad_()
    for p in experts.parameters():
        p.grad = None
    out = experts(hidden, index, weights)
    out.backward(grad)
    return [out, hidden.grad] + [p.grad for p in experts.parameters()]


def logits_and_expert_grads(model: transformers.PreTrainedModel, ids: torch.Tensor,
                            run=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """float32 logits and expert-weight gradients of one language-model step of ``model`` on
    ``ids`` (run by ``run``, e.g. its compiled form, when given)."""
    model.zero_grad()
    out = (model if run is None else run)(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()
             if "experts" in n and p.grad is not None}
    return out.logits.float(), grads


def check_bf16_no_further_than_theirs(model: transformers.PreTrainedModel, ids: torch.Tensor
                                      ) -> None:
    """``model`` (float32) cast to bf16 with this library's experts entry: logits no further
    from the float32 model's than with transformers' own bf16 ``grouped_mm`` experts (within
    1.25x + 1e-3), expert-weight gradients within twice theirs + 1e-3 (rounding decides a
    few routing choices, differently for any two implementations)."""
    import grouped_linear.integrations.transformers as gl_hf
    from tests.reference import rel_err

    want_logits, want_grads = logits_and_expert_grads(model, ids)
    model = model.to(torch.bfloat16)
    model.set_experts_implementation("grouped_mm")
    theirs_logits, theirs_grads = logits_and_expert_grads(model, ids)
    gl_hf.enable(model)
    ours_logits, ours_grads = logits_and_expert_grads(model, ids)
    assert model.dtype == torch.bfloat16
    theirs, ours = rel_err(theirs_logits, want_logits), rel_err(ours_logits, want_logits)
    assert ours <= 1.25 * theirs + 1e-3, (ours, theirs)
    assert ours_grads.keys() == want_grads.keys() and want_grads
    for name, want in want_grads.items():
        theirs, ours = rel_err(theirs_grads[name], want), rel_err(ours_grads[name], want)
        assert ours <= 2 * theirs + 1e-3, (name, ours, theirs)
