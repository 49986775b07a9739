"""The transformers integration on CUDA: bf16 models and experts modules against float64 and
against transformers' own bf16, the FP8 entries, and torch.compile with Triton kernels."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import grouped_linear as gl  # noqa: E402
import grouped_linear.integrations.transformers as gl_hf  # noqa: E402
from grouped_linear.kernels.gemm import fp8_torch_gemm  # noqa: E402
from grouped_linear.ops.permutation import TRACEABLE  # noqa: E402
from tests.integrations.tiny_models import (  # noqa: E402
    FAMILIES,
    check_bf16_no_further_than_theirs,
    experts_module,
    forward_backward,
    logits_and_expert_grads,
    tiny_model,
)
from tests.reference import rel_err  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
# Sizes at which the Gluon and Triton GEMMs run (not the tiny CPU sizes).
SIZES = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, std=0.02)


def _sizes(family: str) -> dict:
    """SIZES with as many heads as the tiny head size needs (DeepSeek-V3's attention has
    head sizes of its own)."""
    return {**SIZES, "num_attention_heads": 4 if family == "deepseek_v3" else 32}
IDS = torch.randint(0, 64, (4, 96), generator=torch.Generator().manual_seed(3))


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _logits_and_expert_grads(model, run=None):
    return logits_and_expert_grads(model, IDS.to(CUDA), run)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_is_no_further_from_fp32_than_transformers_bf16(family):
    """A whole bf16 model (attention, norms, router and experts in bf16): logits no further
    from the fp32 model's than with transformers' own bf16 experts, expert gradients within
    twice theirs. In a whole model, rounding decides a few routing choices of the later
    layers, differently for any two implementations, and each such token moves its experts'
    gradients: the like-for-like gradient comparison is the experts module's, with the
    routing fixed (below)."""
    check_bf16_no_further_than_theirs(
        tiny_model(family, torch.float32, **_sizes(family)).to(CUDA), IDS.to(CUDA))


def _experts(family, experts_class, dtype, **config):
    return experts_module(family, experts_class, dtype, 0.05, **config)


def _routing(tokens, num_experts, k, hidden_size, generator):
    logits = torch.randn(tokens, num_experts, generator=generator)
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    grad = torch.randn(tokens, hidden_size, generator=generator)
    return hidden, index, weights, grad


EXPERTS = {  # transposed, interleaved, biased GPT-OSS; concatenated Qwen3-MoE
    "gpt_oss": ("GptOssExperts", dict(hidden_size=384, intermediate_size=256,
                                      num_local_experts=16)),
    "qwen3_moe": ("Qwen3MoeExperts", dict(hidden_size=512, moe_intermediate_size=192,
                                          num_experts=32)),
}


@pytest.mark.parametrize("family", EXPERTS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_experts_modules_in_bf16_match_float64(family, expert_parallel):
    """Forward and backward of the experts module at bf16 on CUDA within 1e-2 of the same
    module's eager float64; with expert parallelism, a third of the slots name another
    rank's experts (they equal the slot given weight zero)."""
    gl_hf.register()
    experts_class, config = EXPERTS[family]
    experts = _experts(family, experts_class, torch.float64, **config)
    generator = torch.Generator().manual_seed(1)
    hidden_size = config["hidden_size"]
    hidden, index, weights, grad = _routing(1000, experts.num_experts, 4, hidden_size, generator)
    foreign = torch.zeros_like(index, dtype=torch.bool)
    if expert_parallel:
        foreign[::3, 1] = True
    want = forward_backward(experts, "eager", hidden.double(), index,
                             weights.double().masked_fill(foreign, 0), grad.double())
    experts = experts.to(CUDA, torch.bfloat16)
    inputs = (hidden.to(CUDA, torch.bfloat16), index.to(CUDA),
              weights.to(CUDA, torch.bfloat16), grad.to(CUDA, torch.bfloat16))
    theirs = forward_backward(experts, "grouped_mm", inputs[0], inputs[1],
                               inputs[2].masked_fill(foreign.to(CUDA), 0), inputs[3])
    experts._is_expert_parallel = expert_parallel
    index = torch.where(foreign, experts.num_experts + 1, index)
    got = forward_backward(experts, gl_hf.NAME, inputs[0], index.to(CUDA), *inputs[2:])
    assert len(got) == len(want)
    for a, b, c in zip(got, want, theirs):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) < 1e-2
        assert rel_err(a, b) <= 1.1 * rel_err(c, b) + 1e-4  # transformers' own bf16


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_torch_gemm.available(CUDA),
                    reason="needs the FP8 grouped GEMM (sm90)")
@pytest.mark.parametrize("name", gl_hf.RECIPE_NAMES)
def test_fp8_entries_stay_within_the_fp8_bound(name):
    """Each FP8 entry: the block's output, its input and weight gradients within 1.2e-1 of
    float64 (two FP8 GEMMs in a chain, each within 6e-2), and not the bf16 result."""
    gl_hf.register()
    experts = _experts("mixtral", "MixtralExperts", torch.float64, hidden_size=512,
                       intermediate_size=768, num_local_experts=8)
    hidden, index, weights, grad = _routing(2048, 8, 2, 512, torch.Generator().manual_seed(4))
    want = forward_backward(experts, "eager", hidden.double(), index, weights.double(),
                             grad.double())
    experts = experts.to(CUDA, torch.bfloat16)
    inputs = (hidden.to(CUDA, torch.bfloat16), index.to(CUDA),
              weights.to(CUDA, torch.bfloat16), grad.to(CUDA, torch.bfloat16))
    bf16 = forward_backward(experts, gl_hf.NAME, *inputs)
    got = forward_backward(experts, name, *inputs)
    assert rel_err(got[0], bf16[0]) > 1e-3  # the recipe ran
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1.2e-1


def test_compiled_model_matches_eager():
    """torch.compile (inductor) of a bf16 Qwen3-MoE model with the entry: logits and expert
    gradients as close to the fp32 model's as eager bf16's; no graph break where dynamo
    traces the permutation."""
    import torch._dynamo.utils

    model = tiny_model("qwen3_moe", torch.float32, **_sizes("qwen3_moe")).to(CUDA)
    want_logits, want_grads = _logits_and_expert_grads(model)
    model = model.to(torch.bfloat16)
    gl_hf.enable(model)
    eager_logits, eager_grads = _logits_and_expert_grads(model)
    torch._dynamo.utils.counters.clear()
    compiled_logits, compiled_grads = _logits_and_expert_grads(model, torch.compile(model))
    if TRACEABLE:
        assert not torch._dynamo.utils.counters["graph_break"]
    eager = rel_err(eager_logits, want_logits)
    assert rel_err(compiled_logits, want_logits) <= 1.25 * eager + 1e-3
    for name, want in want_grads.items():
        eager = rel_err(eager_grads[name], want)
        assert rel_err(compiled_grads[name], want) <= 1.25 * eager + 1e-3, name


def test_the_autocast_recipe_reaches_the_plain_entry():
    """The plain entry under ``gl.autocast(Float8Rowwise())`` computes what the rowwise
    entry does, bit for bit, and not the bf16 result."""
    if not fp8_torch_gemm.available(CUDA):
        pytest.skip("needs the FP8 grouped GEMM (sm90)")
    gl_hf.register()
    experts = _experts("mixtral", "MixtralExperts", torch.float32, hidden_size=512,
                       intermediate_size=768, num_local_experts=8).to(CUDA, torch.bfloat16)
    hidden, index, weights, _ = _routing(1024, 8, 2, 512, torch.Generator().manual_seed(6))
    inputs = (hidden.to(CUDA, torch.bfloat16), index.to(CUDA), weights.to(CUDA, torch.bfloat16))
    with torch.no_grad():
        experts.config._experts_implementation = gl_hf.NAME
        plain = experts(*inputs)
        with gl.autocast(gl.recipes.Float8Rowwise()):
            autocast = experts(*inputs)
        experts.config._experts_implementation = "grouped_linear_fp8_rowwise"
        rowwise = experts(*inputs)
    assert torch.equal(autocast, rowwise)
    assert rel_err(autocast, plain) > 1e-2
