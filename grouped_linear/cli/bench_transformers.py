"""``python -m grouped_linear bench --suite transformers``: transformers' own experts modules,
run by transformers' default ``grouped_mm`` implementation and by this library's entries.

Each case is one family's ``*Experts`` module at a real size (bf16 on CUDA; float32, or
bf16 with ``--dtype bf16``, and sizes divided by 8 on CPU), fed ``T`` tokens routed top-``k`` by random router
logits (softmax weights). Columns: ``transformers`` (its ``grouped_mm`` entry),
``grouped_linear`` (bf16) and, on CUDA, each FP8 entry. Every column times forward +
backward of the same module (parameters and input gradients), in alternating rounds after a
warm-up at sustained clocks; TFLOP/s count the three GEMMs of the block twice more for the
backward: ``3 * 2 * T * k * H * (F_up + F)`` with ``F_up`` the up projection's width (``2F``
gated). Also reported: each column against ``transformers``, peak CUDA memory, and the
relative difference of the output from ``transformers``'.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..integrations import transformers as gl_hf
from .demo import resolve_device
from .timing import format_table, median_seconds, peak_memory_bytes, run_cases, warm_gpu

__all__ = ["CASES", "run_transformers_bench", "render_transformers_table"]

BASELINE = "transformers"
CPU_DIVISOR = 8


@dataclass(frozen=True)
class Case:
    """One experts module: the family's config class and its experts class, sizes."""

    name: str
    family: str  # transformers model type
    experts_class: str
    config: dict  # the config's size fields
    tokens: int
    top_k: int


CASES = (
    Case("qwen3_30b_a3b", "qwen3_moe", "Qwen3MoeExperts",
         dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128), 16384, 8),
    Case("gpt_oss_20b", "gpt_oss", "GptOssExperts",
         dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32), 16384, 4),
    Case("mixtral_8x7b", "mixtral", "MixtralExperts",
         dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8), 16384, 2),
    Case("deepseek_v3_ep8", "deepseek_v3", "DeepseekV3Experts",  # 32 local experts of 256
         dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=32), 16384, 8),
)


def _scaled(case: Case) -> Case:
    config = {k: max(8, v // CPU_DIVISOR) if "size" in k else v for k, v in case.config.items()}
    return Case(case.name, case.family, case.experts_class, config, case.tokens // 64,
                case.top_k)


def _experts(case: Case, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import importlib

    import transformers

    config = transformers.AutoConfig.for_model(case.family, **case.config)
    module = importlib.import_module(
        f"transformers.models.{case.family}.modeling_{case.family}")
    with torch.device(dev):
        experts = getattr(module, case.experts_class)(config).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    return experts


def _flops(experts: torch.nn.Module, case: Case) -> float:
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    down = experts.down_proj
    return 3 * 2 * case.tokens * case.top_k * (up[0].numel() + down[0].numel())


def _columns(dev: torch.device) -> dict[str, str]:
    columns = {BASELINE: "grouped_mm", "grouped_linear": gl_hf.NAME}
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9):
        columns.update({n.removeprefix("grouped_linear_"): n for n in gl_hf.RECIPE_NAMES})
    return columns


def _measure_case(case: Case, dev: torch.device, dtype: torch.dtype, rounds: int,
                  reps: int) -> dict:
    experts = _experts(case, dev, dtype)
    generator = torch.Generator(device=dev).manual_seed(0)
    H = case.config["hidden_size"]
    hidden = torch.randn(case.tokens, H, device=dev, generator=generator).to(dtype)
    logits = torch.randn(case.tokens, experts.num_experts, device=dev, generator=generator)
    weights, index = logits.softmax(-1).topk(case.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    hidden.requires_grad_()
    grad_out = torch.randn(case.tokens, H, device=dev, generator=generator).to(dtype)
    params = list(experts.parameters())

    def step(entry: str):
        def run():
            experts.config._experts_implementation = entry
            out = experts(hidden, index, weights)
            out.backward(grad_out)
            return out
        return run

    columns = _columns(dev)
    outputs = {name: step(entry)().detach().float() for name, entry in columns.items()}
    reference = outputs[BASELINE]
    seconds = {name: [] for name in columns}
    for _ in range(rounds):
        warm_gpu(device=dev)
        for name, entry in columns.items():
            seconds[name].append(median_seconds(step(entry), dev, reps=reps,
                                                grad_to_none=[hidden, *params]))
    flops = _flops(experts, case)
    result = {"case": case.name, "tokens": case.tokens, "top_k": case.top_k, **case.config,
              "columns": {}}
    for name, entry in columns.items():
        median = statistics.median(seconds[name])
        result["columns"][name] = {
            "ms": median * 1e3,
            "tflops": flops / median / 1e12,
            "peak_bytes": peak_memory_bytes(step(entry), dev, grad_to_none=[hidden, *params]),
            "rel_diff": float((outputs[name] - reference).norm() / reference.norm()),
        }
    base = result["columns"][BASELINE]["ms"]
    for column in result["columns"].values():
        column["speedup"] = base / column["ms"]
    return result


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def run_transformers_bench(device: str | torch.device = "auto", json_path: str | None = None,
                           reps: int = 5, rounds: int = 3,
                           cases: tuple[Case, ...] = CASES, dtype: str | None = None) -> dict:
    """Measure every case; prints the table and returns the report (also written as JSON to
    ``json_path``). ``dtype``: ``"bf16"`` or ``"fp32"`` (default bf16 on CUDA, fp32 on CPU)."""
    dev = resolve_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {tuple(DTYPES)}")
    gl_hf.register()
    dtype = DTYPES[dtype] if dtype is not None else (
        torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if dev.type == "cpu":
        cases = tuple(_scaled(case) for case in cases)
    return run_cases(cases, lambda case: _measure_case(case, dev, dtype, rounds, reps),
                     render_transformers_table, dev, dtype, "transformers experts", json_path)


def render_transformers_table(report: dict) -> str:
    """One row per case and column: TFLOP/s, against transformers, peak memory, difference."""
    rows = []
    for case in report["cases"]:
        for name, column in case["columns"].items():
            peak = column["peak_bytes"]
            rows.append([case["case"], name, f"{column['tflops']:.3g}",
                         f"{column['speedup']:.2f}x",
                         "-" if peak is None else f"{peak / 2**30:.2f}",
                         f"{column['rel_diff']:.1e}"])
    title = (f"transformers experts, forward+backward, {report['dtype']} on "
             f"{report['device']}, torch {report['torch']}")
    return format_table(["case", "column", "TFLOP/s", "vs transformers", "peak GiB",
                         "rel. diff"], rows, title=title)
