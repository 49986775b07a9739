"""``python -m grouped_linear bench --suite moe``: a whole MoE block, ``gl.permute`` ->
``gl.GroupedMLP`` (SwiGLU, no bias) -> ``gl.unpermute``, in bf16 and under each FP8 recipe.

Each case is one model's expert layer at a real size (bf16 on CUDA; float32, widths divided
by 8 and tokens by 256 on CPU, a smoke test that the emulated FP8 columns keep short), fed
``T`` tokens routed top-``k`` by random router logits (softmax, top-``k``, the ``k`` weights
renormalised to sum to 1: the ``probs`` ``unpermute`` weighs the expert outputs by).
Columns: ``bf16`` (the block in the input dtype, no recipe) and, where FP8 GEMMs exist (CUDA
with compute capability 8.9 or more) or emulated on CPU, ``fp8_rowwise``, ``fp8_tensorwise``
and ``fp8_blockwise``: the same block inside ``gl.autocast(recipe)`` with ``permute`` given
the recipe too (Float8Rowwise: the rows permuted as FP8 codes), the weights quantized
once per step into the module's cache (``is_first_microbatch=True``, as a training step with
one microbatch passes it); ``*_recompute``: the same with ``recompute_activation=True``
(fc2's input rebuilt in backward from fc1's output, nothing of it kept); ``*_primary``: a
copy of the module with its weights stored in FP8 (``gl.to_fp8_weights``: no weight
quantized in the step). Every column runs the same weights on the same inputs; a timed step
is permute, the MLP, unpermute and the backward of a fixed output gradient (gradients of
``x``, ``probs`` and the parameters, reset before every step), in alternating rounds after a
warm-up at sustained clocks, the median over rounds reported. TFLOP/s count the expert
GEMMs only, twice more for the backward: ``6 * T * k * H * (2F + F)``. Also reported: each
column against ``bf16``, peak CUDA memory (without the other columns' module copies), the
memory a forward leaves allocated for its backward (its output not counted; against the
bf16 column's), and the relative error (``||a - b|| / ||b||``) of the block's output and of
``x``'s gradient against a float64 block with the same weights and inputs, computed once
per case by a plain loop over the experts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

import grouped_linear as gl

from ..recipes import Float8Blockwise, Float8Recipe, Float8Rowwise, Float8Tensorwise
from .demo import resolve_device
from .timing import format_table, median_seconds, peak_memory_bytes, run_cases, warm_gpu

__all__ = ["CASES", "Case", "Column", "run_moe_bench", "render_moe_table"]

BASELINE = "bf16"
CPU_DIVISOR = 8
CPU_TOKEN_DIVISOR = 256
INIT_STD = 0.02
RECIPES: dict[str, Float8Recipe] = {
    "fp8_rowwise": Float8Rowwise(),
    "fp8_tensorwise": Float8Tensorwise(),
    "fp8_blockwise": Float8Blockwise(),
}
#: These recipes also run with ``recompute_activation=True`` (``<name>_recompute``) and on
#: FP8 primary weights (``<name>_primary``).
RECOMPUTED = PRIMARY = ("fp8_rowwise", "fp8_blockwise")


@dataclass(frozen=True)
class Column:
    """How one column runs the block: a recipe (``None``: the input dtype), whether fc2's
    input is recomputed in backward, whether the weights are stored in FP8."""

    recipe: Float8Recipe | None = None
    recompute: bool = False
    primary: bool = False


@dataclass(frozen=True)
class Case:
    """One MoE block: experts on this rank, top-k, model and expert widths, tokens."""

    name: str
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    tokens: int


CASES = (
    Case("deepseek_v3_ep8", 32, 8, 7168, 2048, 16384),  # 32 local experts of 256
    Case("mixtral_8x7b", 8, 2, 4096, 14336, 16384),
    Case("qwen3_30b_a3b", 128, 8, 2048, 768, 16384),
)


def _scaled(case: Case) -> Case:
    return replace(case, hidden=max(8, case.hidden // CPU_DIVISOR),
                   ffn=max(8, case.ffn // CPU_DIVISOR), tokens=case.tokens // CPU_TOKEN_DIVISOR)


def _flops(case: Case) -> float:
    return 6 * case.tokens * case.top_k * case.hidden * (2 * case.ffn + case.ffn)


def _columns(dev: torch.device) -> dict[str, Column]:
    columns = {BASELINE: Column()}
    if dev.type == "cpu" or (dev.type == "cuda"
                             and torch.cuda.get_device_capability(dev) >= (8, 9)):
        columns.update({name: Column(recipe) for name, recipe in RECIPES.items()})
        columns.update({f"{name}_recompute": Column(RECIPES[name], recompute=True)
                        for name in RECOMPUTED})
        columns.update({f"{name}_primary": Column(RECIPES[name], primary=True)
                        for name in PRIMARY})
    return columns


@dataclass
class _Inputs:
    """What every column of one case shares: the module, tokens, routing, output gradient;
    the FP8-weight copies of the module, made when a column first asks, and their bytes."""

    mlp: gl.GroupedMLP
    x: torch.Tensor  # (T, H) leaf
    indices: torch.Tensor  # (T, k) experts
    probs: torch.Tensor  # (T, k) float32 leaf, renormalised
    grad_out: torch.Tensor  # (T, H)
    primary: dict[Float8Recipe, tuple[gl.GroupedMLP, int]] = field(default_factory=dict)

    def module(self, column: Column) -> gl.GroupedMLP:
        """The module ``column`` runs."""
        if not column.primary:
            return self.mlp
        if column.recipe not in self.primary:
            self.free_fp8_weights()  # none in the copy
            dev = self.x.device
            before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            copy = gl.to_fp8_weights(deepcopy(self.mlp), column.recipe)
            after = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            self.primary[column.recipe] = (copy, after - before)
        return self.primary[column.recipe][0]

    def free_fp8_weights(self) -> None:
        """Drop the FP8 weights the block's layers cached for an FP8 column."""
        for layer in (self.mlp.fc1, self.mlp.fc2):
            layer._fp8_weights.entry = None

    def leaves(self, column: Column) -> list[torch.Tensor]:
        return [self.x, self.probs, *self.module(column).parameters()]

    def copies(self) -> list[tuple[gl.GroupedMLP, int]]:
        """Every module copy made so far, with the CUDA bytes of its parameters."""
        return [(self.mlp, sum(p.nbytes for p in self.mlp.parameters())),
                *self.primary.values()]

    def drop_grads(self) -> None:
        """Every gradient of every copy freed: one column's peak holds its own alone."""
        params = [p for module, _ in self.copies() for p in module.parameters()]
        for t in (self.x, self.probs, *params):
            t.grad = None

    def other_modules_bytes(self, column: Column) -> int:
        """CUDA bytes of the module copies ``column`` does not run (its peak leaves them
        out)."""
        mine = self.module(column)
        return sum(nbytes for module, nbytes in self.copies() if module is not mine)


def _inputs(case: Case, dev: torch.device, dtype: torch.dtype) -> _Inputs:
    generator = torch.Generator(device=dev).manual_seed(0)
    mlp = gl.GroupedMLP(case.num_experts, case.hidden, case.ffn, activation="swiglu",
                        bias=False, params_dtype=dtype, device=dev)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, INIT_STD, generator=generator)
    x = torch.randn(case.tokens, case.hidden, device=dev, generator=generator).to(dtype)
    logits = torch.randn(case.tokens, case.num_experts, device=dev, generator=generator)
    probs, indices = logits.softmax(-1).topk(case.top_k, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    grad_out = torch.randn(case.tokens, case.hidden, device=dev, generator=generator).to(dtype)
    return _Inputs(mlp, x.requires_grad_(), indices, probs.requires_grad_(), grad_out)


def _forward(inputs: _Inputs, column: Column) -> torch.Tensor:
    """The block's forward as ``column`` says (a column without a recipe first frees the FP8
    weights an earlier column cached: they are no part of the bf16 block)."""
    mlp = inputs.module(column)
    mlp.recompute_activation = column.recompute
    if column.recipe is None or column.primary:
        inputs.free_fp8_weights()
    with gl.autocast(column.recipe):
        rows, m_splits, row_map = gl.permute(inputs.x, inputs.indices, mlp.num_experts,
                                             recipe=column.recipe)
        y = mlp(rows, m_splits, is_first_microbatch=True)
        return gl.unpermute(y, row_map, inputs.probs)


def _step(inputs: _Inputs, column: Column) -> Callable[[], torch.Tensor]:
    """One forward+backward of the block as ``column`` says."""
    def run() -> torch.Tensor:
        out = _forward(inputs, column)
        out.backward(inputs.grad_out)
        return out
    return run


def _saved_bytes(inputs: _Inputs, column: Column, dev: torch.device) -> int | None:
    """CUDA memory the forward leaves allocated for backward, its output not counted (a step
    before fills the module's FP8 weight cache for this column's recipe: module state, held
    across steps, not kept for one backward)."""
    if dev.type != "cuda":
        return None
    _step(inputs, column)()
    inputs.drop_grads()
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    out = _forward(inputs, column)
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev) - before - out.nbytes
    out.backward(inputs.grad_out)
    for leaf in inputs.leaves(column):
        leaf.grad = None
    return held


def _reference(inputs: _Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output and ``x``'s gradient in float64, one expert at a time: each token's
    ``k`` slots gathered by expert, ``silu(x W_gate^T) * (x W_up^T) @ W_down^T`` (fc1's weight
    ``(E, 2F, H)``, its gate half first; fc2's ``(E, H, F)``), weighted by ``probs`` and
    summed per token."""
    mlp = inputs.mlp
    ffn = mlp.ffn_hidden_size
    w1 = mlp.fc1.weight.detach().double()
    w2 = mlp.fc2.weight.detach().double()
    probs = inputs.probs.detach().double()
    x = inputs.x.detach().double().requires_grad_()
    out = torch.zeros_like(x)
    for e in range(mlp.num_experts):
        token, slot = (inputs.indices == e).nonzero(as_tuple=True)
        rows = x[token]
        gate, up = rows @ w1[e, :ffn].T, rows @ w1[e, ffn:].T
        y = (F.silu(gate) * up) @ w2[e].T
        out = out.index_add(0, token, probs[token, slot, None] * y)
    out.backward(inputs.grad_out.double())
    return out.detach(), x.grad


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _measure_case(case: Case, dev: torch.device, dtype: torch.dtype, rounds: int,
                  reps: int) -> dict:
    inputs = _inputs(case, dev, dtype)
    ref_out, ref_dx = _reference(inputs)
    columns = _columns(dev)
    errors = {}
    for name, column in columns.items():  # also each column's first, untimed run
        for leaf in inputs.leaves(column):
            leaf.grad = None
        out = _step(inputs, column)()
        errors[name] = (_rel_err(out.detach(), ref_out), _rel_err(inputs.x.grad, ref_dx))
    seconds: dict[str, list[float]] = {name: [] for name in columns}
    for _ in range(rounds):
        warm_gpu(device=dev)
        for name, column in columns.items():
            seconds[name].append(median_seconds(_step(inputs, column), dev, reps=reps,
                                                grad_to_none=inputs.leaves(column)))
    flops = _flops(case)
    result = {"case": case.name, "tokens": case.tokens, "top_k": case.top_k,
              "num_experts": case.num_experts, "hidden": case.hidden, "ffn": case.ffn,
              "flops": flops, "columns": {}}
    for name, column in columns.items():
        median = statistics.median(seconds[name])
        saved = _saved_bytes(inputs, column, dev)  # after a step: this column's weight cache
        inputs.drop_grads()
        peak = peak_memory_bytes(_step(inputs, column), dev,
                                 grad_to_none=inputs.leaves(column))
        result["columns"][name] = {
            "ms": median * 1e3,
            "tflops": flops / median / 1e12,
            "peak_bytes": None if peak is None else peak - inputs.other_modules_bytes(column),
            "saved_bytes": saved,
            "rel_err_out": errors[name][0],
            "rel_err_dx": errors[name][1],
        }
    base = result["columns"][BASELINE]
    for column in result["columns"].values():
        column["speedup"] = base["ms"] / column["ms"]
        column["saved_ratio"] = (None if column["saved_bytes"] is None
                                 else column["saved_bytes"] / base["saved_bytes"])
    return result


def run_moe_bench(device: str | torch.device = "auto", json_path: str | None = None,
                  reps: int = 5, rounds: int = 3, cases: tuple[Case, ...] = CASES) -> dict:
    """Measure every case; prints the table and returns the report (also written as JSON to
    ``json_path``)."""
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        cases = tuple(_scaled(case) for case in cases)
    return run_cases(cases, lambda case: _measure_case(case, dev, dtype, rounds, reps),
                     render_moe_table, dev, dtype, "MoE block", json_path)


def render_moe_table(report: dict) -> str:
    """One row per case and column: TFLOP/s, against bf16, peak memory, errors."""
    rows = []
    for case in report["cases"]:
        for name, column in case["columns"].items():
            peak, saved = column["peak_bytes"], column["saved_bytes"]
            rows.append([case["case"], name, f"{column['tflops']:.3g}",
                         f"{column['speedup']:.2f}x",
                         "-" if peak is None else f"{peak / 2**30:.2f}",
                         "-" if saved is None else f"{saved / 2**30:.2f}",
                         "-" if saved is None else f"{column['saved_ratio']:.2f}x",
                         f"{column['rel_err_out']:.1e}", f"{column['rel_err_dx']:.1e}"])
    title = (f"MoE block (permute -> GroupedMLP -> unpermute), forward+backward, "
             f"{report['dtype']} on {report['device']}, torch {report['torch']}")
    return format_table(["case", "column", "TFLOP/s", "vs bf16", "peak GiB", "saved GiB",
                         "saved vs bf16", "rel. err out", "rel. err dx"], rows, title=title)
