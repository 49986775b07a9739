"""grouped_linear as an experts implementation of Hugging Face ``transformers`` (5.x).

transformers dispatches every MoE family's ``*Experts`` module through its
``ExpertsInterface``: ``fn(module, hidden_states (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)``, chosen by ``from_pretrained(...,
experts_implementation=name)`` or ``model.set_experts_implementation(name)``.
:func:`register` adds this library's entries; :func:`enable` switches a loaded model::

    import grouped_linear.integrations.transformers as gl_hf
    gl_hf.enable(model)                                   # bf16 / fp32
    gl_hf.enable(model, recipe=gl.recipes.Float8Rowwise())  # FP8 GEMMs

The entries run on the module's own parameters as they are stored (gate/up concatenated or
interleaved, ``(E, out, in)`` or transposed ``(E, in, out)``, with or without biases, gated or
not, a post-expert norm): no copy, checkpoint keys unchanged. Expert-parallel sentinels
(indices ``>= num_experts``, another rank's experts) are dropped slots: no rows, zero output.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .. import recipes
from ..kernels.activation import GATED_KINDS, KIND_PARAMETERS, bias_act_reference
from ..ops.grouped_linear import grouped_linear, reads_fp8_rows
from ..ops.mlp import grouped_mlp
from ..ops.permutation import check_range, permute, unpermute
from . import MissingDependency

__all__ = ["NAME", "RECIPE_NAMES", "experts_forward", "register", "enable"]

NAME = "grouped_linear"
# Entries with an FP8 recipe of their own (the plain entry follows ``gl.autocast``).
RECIPE_NAMES = {
    "grouped_linear_fp8_rowwise": recipes.Float8Rowwise,
    "grouped_linear_fp8_tensorwise": recipes.Float8Tensorwise,
    "grouped_linear_fp8_blockwise": recipes.Float8Blockwise,
}


def _projection(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The module's ``name`` weight as ``(E, out, in)`` (a view where stored transposed) and
    its bias or ``None``."""
    weight = getattr(module, name)
    if module.is_transposed:
        weight = weight.transpose(1, 2)
    bias = getattr(module, name + "_bias") if module.has_bias else None
    return weight, bias


_NON_GATED = ("gelu", "gelu_erf", "relu", "relu2", "silu")
# Where an experts module keeps the fused activation found for its gate, with the gate
# parameters it was found for (probed again when they change).
_ATTRIBUTE = "_grouped_linear_activation"
_GATE_ATTRIBUTES = ("alpha", "swiglu_alpha", "limit", "swiglu_limit")


def _gate_parameters(module: torch.nn.Module) -> list[dict[str, float]]:
    """Every assignment of the clamping gates' parameters the module may use: the values it
    stores under ``alpha`` / ``limit`` (GPT-OSS) or ``swiglu_alpha`` / ``swiglu_limit``
    (others; some modules carry both names, with different values)."""
    values = {}
    for name in ("alpha", "limit"):
        found = [float(value) for value in (getattr(module, attribute, None)
                                            for attribute in (name, "swiglu_" + name))
                 if isinstance(value, (int, float)) and not isinstance(value, bool)]
        values[name] = list(dict.fromkeys(found))
    assignments = [{"alpha": alpha, "limit": limit}
                   for alpha in values["alpha"] for limit in values["limit"]]
    return assignments + [{"limit": limit} for limit in values["limit"]]


@torch.compiler.disable
def _probe(module: torch.nn.Module) -> dict | None:
    """The :func:`~grouped_linear.grouped_mlp` activation arguments that compute the module's
    own gate (``_apply_gate``) or activation (``act_fn``), or ``None`` (then the module's own
    runs unfused). Found by evaluating both on float64 values within 1e-6: every gate value
    of ``[-span, span]`` in steps of 1/16 (``span``: 64, or past twice a finite clamping
    limit) against up values spread over the same range, so that a function clipping or
    bending anywhere in it (ReLU6, a GELU clipped at 10) differs. A module that computes its
    gate in float32 matches, as the fused kernels compute in float32 too, while the kinds
    differ by far more. An ``act_fn`` with parameters of its own (learned: what it computes
    changes in training) or one that cannot take these values (parameters on another device
    or dtype) runs as the module's own."""
    act_fn = getattr(module, "act_fn", None)
    if isinstance(act_fn, torch.nn.Module) and any(True for _ in act_fn.parameters()):
        return None
    assignments = _gate_parameters(module)
    limits = [params["limit"] for params in assignments if math.isfinite(params["limit"])]
    span = max([64.0] + [2 * limit + 2 for limit in limits])
    grid = torch.linspace(-span, span, int(32 * span) + 1, dtype=torch.float64)
    width = 64  # columns of the probe's rows (any number: the kinds act elementwise)
    rows = grid.numel() // width + 1
    gate = torch.cat([grid, grid[: rows * width - grid.numel()]]).view(rows, width)
    ends = torch.tensor([rows], dtype=torch.int32)
    if module.has_gate:
        up = gate.flip(0).flip(1) / 4 + 0.5  # each gate value meets an unrelated up value
        candidates = [(kind, order, params) for kind in GATED_KINDS
                      for order in ("concatenated", "interleaved")
                      for params in ([{}] if kind not in KIND_PARAMETERS else
                                     [p for p in assignments
                                      if set(p) == set(KIND_PARAMETERS[kind])])]
    else:
        candidates = [(kind, "concatenated", {}) for kind in _NON_GATED]
    wants = {}
    for kind, order, params in candidates:
        if order not in wants:  # the module's own, on this order's layout of the values
            values = (gate if not module.has_gate else
                      torch.stack((gate, up), -1).flatten(1) if order == "interleaved" else
                      torch.cat((gate, up), 1))
            try:
                with torch.no_grad():
                    want = (module._apply_gate(values) if module.has_gate
                            else module.act_fn(values))
            except (RuntimeError, TypeError, ValueError):
                return None
            wants[order] = values, want
        values, want = wants[order]
        got = bias_act_reference(values, None, ends, kind, False, order == "interleaved",
                                 **params)
        if got.shape == want.shape and torch.allclose(got, want.to(got.dtype), rtol=1e-6,
                                                      atol=1e-6):
            return {"activation": kind, "gate_up_order": order, **params}
    return None


def _gate_key(module: torch.nn.Module) -> tuple:
    """What the probe's verdict depends on: the gate parameters the module stores (numbers;
    ``None`` for any other value) and the functions it would call (``act_fn``, and
    ``_apply_gate`` where it is the module's own rather than its class's)."""
    values = (getattr(module, name, None) for name in _GATE_ATTRIBUTES)
    numbers = tuple(v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
                    for v in values)
    gate = getattr(module, "_apply_gate", None)
    return numbers, (getattr(module, "act_fn", None), getattr(gate, "__func__", gate))


def _same_key(a: tuple, b: tuple) -> bool:
    """Equal numbers and the very same functions (compared by identity)."""
    return a[0] == b[0] and all(x is y for x, y in zip(a[1], b[1], strict=True))


@torch.compiler.disable
def _remember(module: torch.nn.Module, key: tuple, fused: dict | None) -> None:
    setattr(module, _ATTRIBUTE, (key, fused))


def _lookup(module: torch.nn.Module) -> tuple[dict | None, tuple | None]:
    """The module's fused activation arguments, and the key to remember a fresh probe under
    (``None`` where they were remembered already)."""
    key = _gate_key(module)
    cached = getattr(module, _ATTRIBUTE, None)
    if cached is not None and _same_key(cached[0], key):
        return cached[1], None
    return _probe(module), key


def _fused_activation(module: torch.nn.Module) -> dict | None:
    """The module's fused activation arguments: probed on its first call (eagerly; a model
    switched by :func:`enable` has them before it is compiled) and again after its gate
    parameters (``alpha``, ``limit`` or their ``swiglu_`` names) or functions (``act_fn``,
    ``_apply_gate``) change; remembered on the module."""
    fused, key = _lookup(module)
    if key is not None:
        _remember(module, key, fused)
    return fused


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                    recipe: recipes.Float8Recipe | None = None) -> torch.Tensor:
    """One transformers experts module's forward: ``(T, H)`` tokens, ``(T, k)`` expert indices
    and routing weights -> ``(T, H)``, the routing-weighted sum of each token's experts.
    A gate probed on this call is remembered once the call has gone through (a rejected call
    leaves the module as it was)."""
    fused, key = _lookup(module)
    out = _forward(module, hidden_states, top_k_index, top_k_weights, recipe, fused)
    if key is not None:
        _remember(module, key, fused)
    return out


def _check_call(module: torch.nn.Module, hidden_states: object, top_k_index: object,
                top_k_weights: object, features: int) -> None:
    """The entry's arguments, by transformers' names: ``(T, H)`` floating hidden states of
    the module's width, ``(T, k)`` integer indices and ``(T, k)`` floating weights; on CPU
    (outside tracing) indices in ``[-1, num_experts)`` unless the module is expert-parallel."""
    for name, value in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} is {type(value).__name__}: expected a torch.Tensor")
    if not hidden_states.is_floating_point() or not top_k_weights.is_floating_point():
        name, value = (("hidden_states", hidden_states) if not hidden_states.is_floating_point()
                       else ("top_k_weights", top_k_weights))
        raise TypeError(f"{name} has dtype {value.dtype}: expected a floating-point tensor")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index has dtype {top_k_index.dtype}: expected integer expert "
                        "indices")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != features:
        raise ValueError(f"hidden_states has shape {tuple(hidden_states.shape)}: expected "
                         f"(tokens, {features}) for this experts module")
    tokens = hidden_states.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens:
        raise ValueError(f"top_k_index has shape {tuple(top_k_index.shape)}: expected "
                         f"({tokens}, top_k), one row per token of hidden_states")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights has shape {tuple(top_k_weights.shape)}: expected "
                         f"top_k_index's {tuple(top_k_index.shape)}")
    if (module._is_expert_parallel or top_k_index.device.type != "cpu"
            or top_k_index.numel() == 0 or torch.compiler.is_compiling()):
        return
    check_range(top_k_index, module.num_experts, "top_k_index",
                f"expert indices must be in [0, {module.num_experts}) (-1: no expert); indices "
                "past the experts are other ranks' only in an expert-parallel module "
                "(_is_expert_parallel)")


def _forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor, recipe: recipes.Float8Recipe | None,
             fused: dict | None) -> torch.Tensor:
    num_experts = module.num_experts
    w1, b1 = _projection(module, "gate_up_proj" if module.has_gate else "up_proj")
    w2, b2 = _projection(module, "down_proj")
    _check_call(module, hidden_states, top_k_index, top_k_weights, w1.shape[2])
    if module._is_expert_parallel:  # another rank's experts: a dropped slot
        top_k_index = torch.where(top_k_index < num_experts, top_k_index,
                                  top_k_index.new_full((), -1))
    # rows permuted as FP8 codes where fc1 reads them (its route, its geometry)
    rows_recipe = reads_fp8_rows(num_experts, w1.shape[1], w1.shape[2], recipe,
                                 hidden_states.shape[0] * top_k_index.shape[1],
                                 hidden_states.dtype, hidden_states.device)
    weighted_inside = fused is not None and b2 is None and not module.has_post_expert_norm
    if weighted_inside:
        # sum_j w_j * fc2(a_j) = sum_j fc2(w_j * a_j) without fc2 bias or norm: the weights
        # scale the activation's rows in its kernel, and the unweighted sum keeps no copy of
        # the expert outputs for their gradient (rows x H of memory, one pass in backward).
        x_perm, m_splits, row_map, row_weights = permute(
            hidden_states, top_k_index, num_experts, probs=top_k_weights, recipe=rows_recipe)
    else:
        x_perm, m_splits, row_map = permute(hidden_states, top_k_index, num_experts,
                                            recipe=rows_recipe)
    # fc1 takes the only reference to the permuted rows: they are freed once it has read
    # them (an FP8 fc1 keeps copies of its own for backward), before fc2 allocates. (Plain
    # keyword arguments: a call with ``**`` holds its positional arguments until it returns.)
    rows = [x_perm]
    del x_perm
    if fused is not None:
        kind, order = fused["activation"], fused["gate_up_order"]
        alpha, limit = fused.get("alpha"), fused.get("limit")
    if weighted_inside:
        out = grouped_mlp(rows.pop(), w1, b1, w2, None, m_splits, recipe=recipe,
                          probs=row_weights, activation=kind, gate_up_order=order,
                          alpha=alpha, limit=limit)
        return unpermute(out, row_map).to(hidden_states.dtype)
    if fused is not None:  # fc1, the bias and the activation in one pass, fc2
        out = grouped_mlp(rows.pop(), w1, b1, w2, b2, m_splits, recipe=recipe, activation=kind,
                          gate_up_order=order, alpha=alpha, limit=limit)
    else:  # a gate of the module's own
        h = grouped_linear(rows.pop(), w1, b1, m_splits, recipe=recipe)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        out = grouped_linear(h, w2, b2, m_splits, recipe=recipe)
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    # the combine keeps its input for the weights' gradient as the recipe's FP8 codes:
    # an entry's own recipe, as gl.autocast's would
    with (recipes.autocast(recipe) if recipe is not None else contextlib.nullcontext()):
        return unpermute(out, row_map, top_k_weights).to(hidden_states.dtype)


def _entry(recipe: recipes.Float8Recipe):
    """The experts forward with ``recipe`` fixed (``gl.autocast`` does not change it)."""

    def forward(module, hidden_states, top_k_index, top_k_weights):
        return experts_forward(module, hidden_states, top_k_index, top_k_weights, recipe=recipe)

    forward.__name__ = f"experts_forward_{type(recipe).__name__}"
    return forward


def _experts_interface():
    """transformers' ``ExpertsInterface``; :class:`~grouped_linear.integrations.MissingDependency`
    where transformers is missing or older than 5."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:
        raise MissingDependency(
            "grouped_linear.integrations.transformers needs transformers 5 or later (its "
            f"ExpertsInterface): pip install 'transformers>=5' ({error})"
        ) from error
    return ExpertsInterface


def register() -> None:
    """Add ``"grouped_linear"`` and the FP8 entries of :data:`RECIPE_NAMES` to transformers'
    ``ExpertsInterface`` (idempotent). Without transformers 5 or later:
    :class:`~grouped_linear.integrations.MissingDependency` (an ``ImportError``)."""
    ExpertsInterface = _experts_interface()
    ExpertsInterface.register(NAME, experts_forward)
    for name, recipe_class in RECIPE_NAMES.items():
        ExpertsInterface.register(name, _entry(recipe_class()))


def enable(model: torch.nn.Module, recipe: recipes.Float8Recipe | None = None) -> torch.nn.Module:
    """Register the entries and switch ``model`` (a transformers ``PreTrainedModel``) to them:
    the plain entry without ``recipe`` (it follows ``gl.autocast``), else the entry of that
    recipe (:data:`RECIPE_NAMES` for the default settings, ``"grouped_linear_<recipe>"`` for
    others). Every experts module's gate is probed again, and every experts module's config
    switched (also where transformers' own switch skips a subclass of a model class defined
    in a script or notebook). Returns ``model``; a model without experts modules that
    transformers dispatches is a ``ValueError``."""
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(
            f"model is {type(model).__name__}: expected a transformers PreTrainedModel "
            "(transformers 5 or later)"
        )
    recipe = recipes.check_recipe(recipe)
    experts = [module for module in model.modules()
               if hasattr(module, "_is_expert_parallel") and hasattr(module, "num_experts")]
    if not experts:
        raise ValueError(
            f"model is a {type(model).__name__} without experts modules that transformers "
            "dispatches (classes decorated with @use_experts_implementation): nothing to enable"
        )
    register()
    for module in experts:  # probe every gate now, outside any compiled region
        _remember(module, _gate_key(module), _probe(module))
    name = NAME
    if recipe is not None:
        name = next((n for n, cls in RECIPE_NAMES.items() if recipe == cls()),
                    f"grouped_linear_{recipe!r}")
        if name not in RECIPE_NAMES:
            _experts_interface().register(name, _entry(recipe))
    model.set_experts_implementation(name)
    # transformers switches a config only where the model class's source file shows the
    # decorator: a subclass defined elsewhere (a script, a notebook) keeps its old entry.
    configs = (getattr(m, "config", None) for m in experts)
    for config in {id(c): c for c in configs if c is not None}.values():
        if config._experts_implementation != name:
            config._experts_implementation = name
    return model
