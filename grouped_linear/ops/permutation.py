"""Token permutation for Mixture-of-Experts routing, and the weighted combine back.

``permute`` groups the routed copies of the tokens by expert (the layout
:class:`~grouped_linear.GroupedLinear` consumes); ``unpermute`` sums each
token's expert outputs back into token order. On CUDA the routing map (every
slot's row, every row's token, the padded group sizes) is one kernel launch
without host synchronization (:func:`~grouped_linear.kernels.routing.routing_map`),
and the rows move in a second; on CPU it is a stable sort of the slot keys. Data
moves by gathers, or by a copy into unique destinations, so forward and backward
are deterministic.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from grouped_linear.kernels.quantize import rows as quantize_rows
from grouped_linear.kernels.routing import capacity as capacity_kernels
from grouped_linear.kernels.routing import combine as combine_kernels
from grouped_linear.kernels.routing import routing_map as routing
from grouped_linear.kernels.routing import rows as row_kernels
from grouped_linear.ops import routing_inputs as inputs
from grouped_linear.ops.checks import MAX_ROWS, check_int, check_matrix, describe, host_checks
from grouped_linear.ops.fp8.rows import Float8Rows, rows_recipe
from grouped_linear.ops.grouped_linear import reads_fp8_rows
from grouped_linear.ops.splits import SPLIT_DTYPES, debug_checks_enabled
from grouped_linear.recipes import Float8Recipe, check_recipe, current_recipe

__all__ = ["permute", "unpermute"]


def _compute_dtype(y_dtype: torch.dtype, probs_dtype: torch.dtype | None) -> torch.dtype:
    """float32 for half inputs, else the input dtype; widened to the probs' dtype."""
    dtype = torch.float32 if y_dtype in (torch.float16, torch.bfloat16) else y_dtype
    if probs_dtype is not None:
        dtype = torch.promote_types(dtype, probs_dtype)
    return dtype


def _gather_rows(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``out[r] = src[index[r]]`` where ``valid[r]``, else a zero row (one pass).

    ``index`` may hold anything (negative, past the end) where ``valid`` is
    false, so no access is out of bounds.
    """
    return row_kernels.gather_rows(src, torch.where(valid, index, index.new_full((), -1)))


def _combine(y: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j probs[t, j] * y[row_map[t, j]]`` over slots with a row in ``y``."""
    if _compute_dtype(y.dtype, None if probs is None else probs.dtype) == torch.float32:
        return combine_kernels.combine_rows(y, row_map, probs)  # one fused pass where it can
    tokens, k = row_map.shape
    flat = row_map.reshape(-1)
    valid = (flat >= 0) & (flat < y.shape[0])
    rows = _gather_rows(y, flat.clamp(min=0), valid).view(tokens, k, *y.shape[1:])
    acc = _compute_dtype(y.dtype, None if probs is None else probs.dtype)
    if probs is not None:
        weights = probs.to(acc).masked_fill(~valid.view(tokens, k), 0)
        rows = rows.to(acc) * weights.unsqueeze(-1)
    if k == 1:
        return rows[:, 0].to(y.dtype)
    return rows.sum(dim=1, dtype=acc).to(y.dtype)


class _PermuteRows(torch.autograd.Function):
    """Gather token rows into the expert-grouped layout; backward sums them back."""

    @staticmethod
    def forward(ctx, x, token_of_row, row_map, m_splits, counts):  # type: ignore[override]
        ctx.save_for_backward(row_map)
        # each x row read once; the padding rows located from the group sizes
        return row_kernels.scatter_rows(x, row_map, token_of_row, (m_splits, counts))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (row_map,) = ctx.saved_tensors
        return _combine(grad, row_map, None), None, None, None, None


class _PermuteFp8Rows(torch.autograd.Function):
    """:class:`_PermuteRows` for rows quantized per token beforehand: the codes and factors
    move, the result is their :class:`~grouped_linear.ops.fp8.rows.Float8Rows`."""

    @staticmethod
    def forward(ctx, x, codes, inv, recipe, token_of_row, row_map, m_splits,  # type: ignore[override]
                counts):
        ctx.save_for_backward(row_map)
        groups = (m_splits, counts)
        rows = row_kernels.scatter_rows(codes.view(torch.uint8), row_map, token_of_row, groups)
        factors = row_kernels.scatter_rows(inv.view(-1, 1), row_map, token_of_row, groups)
        # rows no slot holds: zero codes with a unit factor, as quantizing a zero row gives
        factors = factors.view(-1).masked_fill_(token_of_row < 0, 1.0)
        return Float8Rows(rows.view(codes.dtype), factors, recipe, x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        (row_map,) = ctx.saved_tensors
        return _combine(grad, row_map, None), None, None, None, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_map, probs, keep_fp8):  # type: ignore[override]
        # y only for the probabilities' gradient (without it the rows are not kept); under
        # an FP8 recipe as codes and 128-column tile factors, written by the combine's read.
        ctx.rows_and_dtype = (y.shape[0], y.dtype)
        if not ctx.needs_input_grad[2]:
            ctx.save_for_backward(None, row_map, probs, None)
            return _combine(y, row_map, probs)
        if keep_fp8 is not None and _compute_dtype(y.dtype, probs.dtype) == torch.float32:
            out, codes, factors = combine_kernels.combine_rows_keeping_fp8(y, row_map, probs,
                                                                       keep_fp8)
            ctx.save_for_backward(codes, row_map, probs, factors)
            return out
        ctx.save_for_backward(y, row_map, probs, None)
        return _combine(y, row_map, probs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        y, row_map, probs, factors = ctx.saved_tensors
        num_rows, y_dtype = ctx.rows_and_dtype
        acc = _compute_dtype(y_dtype, None if probs is None else probs.dtype)
        grad_y = grad_probs = None
        if ctx.needs_input_grad[0]:
            # Slot (t, j) sends probs[t, j] * grad_out[t] to row row_map[t, j] (valid rows
            # are distinct); rows no slot holds get zeros: each token row read once and
            # scattered to its slots' rows (an inverse slot map finds the unheld rows).
            if probs is None or acc == torch.float32:
                weights = probs.to(acc) if probs is not None else None
                grad_y = row_kernels.spread_rows(grad_out.contiguous(), row_map, num_rows,
                                                    weights)
            else:  # wide dtypes: plain PyTorch
                grad_y = row_kernels.spread_rows_reference(grad_out, row_map, num_rows,
                                                              probs.to(acc)).to(y_dtype)
        if probs is not None and ctx.needs_input_grad[2]:
            # Per slot, its row of y dotted with the token's gradient (one pass on GPUs).
            grad_probs = combine_kernels.slot_dots(y, grad_out.contiguous(), row_map, acc,
                                               factors=factors).to(probs.dtype)
        return grad_y, None, grad_probs, None


def _check_integer_matrix(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is {type(t).__name__}: expected an integer torch.Tensor")
    if t.dtype not in SPLIT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}: expected an integer tensor")
    if t.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected a 2-D tensor (T, k)")
    return t



def check_range(values: torch.Tensor, high: int, name: str, allowed: str) -> None:
    """Raise ValueError naming the first ``(t, j)`` outside ``[-1, high)`` (host sync).

    Compared in int64: in a narrow dtype ``-1`` and ``high`` would wrap (uint8 has no -1,
    int8 no 200)."""
    if values.numel() == 0 or row_kernels.within(values, -1, high):  # the common case
        return
    wide = values.to(torch.int64)
    bad = (wide < -1) | (wide >= high)
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}[{t}, {j}] is {int(wide[t, j])}: {allowed}")


def permute(
    x: torch.Tensor,
    topk_indices: torch.Tensor,
    num_experts: int,
    multiple: int = 1,
    *,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    capacity: int | float | None = None,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
    recipe: Float8Recipe | None = None,
) -> tuple[torch.Tensor, ...]:
    """Group the routed copies of the tokens by expert.

    Args:
        x: ``(T, H)`` token rows.
        topk_indices: the routing, on ``x``'s device, in one of three forms:

            - ``(T, k)`` integer tensor (any integer dtype; its values are compared
              as int64): the expert of slot ``(t, j)``, or ``-1`` to drop that slot.
              On CPU any other value outside ``[0, num_experts)`` is a ValueError; on
              CUDA, and while ``torch.compile`` traces, such slots are dropped (on
              CUDA checked only with ``GROUPED_LINEAR_DEBUG=1``, which syncs). Where
              they are checked, a ``(T, E)`` integer tensor of only 0 and 1 (``E >= 3``:
              every row would name an expert twice) is taken for a 0/1 routing map given
              as integers: ValueError (pass ``.bool()``).
            - ``(T,)`` integer tensor: top-1 indices, taken as ``(T, 1)``.
            - ``(T, E)`` bool routing map (``E = num_experts``): slot ``(t, e)`` is
              expert ``e`` where set, dropped elsewhere (so ``k = E``).
        num_experts: ``E >= 1``.
        multiple: every expert's group is padded with zero rows to a multiple
            of this: an int >= 1 with ``T*k + E*(multiple-1)`` within a tensor
            dimension (``2**63 - 1``).
        probs: optional floating routing probabilities of ``topk_indices``' shape
            (``(T, k)``, ``(T,)`` or dense ``(T, E)`` for a map). When given, the
            result has a fourth entry, the permuted probabilities.
        num_out_tokens: optional int in ``[0, T*k]``: only the first
            ``num_out_tokens`` slots of the expert-sorted order (the layout's order
            below, after any capacity drop) are kept, the rest dropped (TE's
            ``num_out_tokens``); ``N`` is then at most ``num_out_tokens`` (the bound
            below on CUDA), but for ``pad_to_capacity``, whose groups hold exactly
            ``capacity`` rows whatever is kept. Needs ``multiple=1`` (ValueError
            otherwise).
        capacity: optional per-expert limit: an int ``>= 1``, or a float factor
            ``f > 0`` giving ``ceil(f * T * k / E)`` (computed exactly; index routing
            only, as a map's ``k`` is not known without reading it: with a map pass a
            count). Each expert keeps at most ``capacity`` slots, the others are
            dropped. Without ``pad_to_capacity`` any capacity above ``T*k`` (``2**70``, a
            factor of ``1e19``) keeps every slot and is taken as ``T*k``; with it, a
            capacity whose ``E * capacity`` rows pass ``2**63 - 1`` is a ValueError.
        drop_policy: which slots an expert over capacity keeps: ``"probs"`` (the
            default; needs ``probs``) the highest-probability ones, ties to the lower
            slot ``t*k + j``; ``"position"`` the earliest slots ``t*k + j``.
        pad_to_capacity: with a ``capacity``, pad every group to exactly
            ``capacity`` rows (``capacity`` must be a multiple of ``multiple``):
            ``N = E * capacity`` on every device.
        recipe: the FP8 recipe of the layer that reads ``x_perm`` (or ``None``). With
            ``Float8Rowwise``, where that layer's calls take the FP8 GEMM route
            (``fp8_scaled_mm``: sm90, bf16, calls past the fused route's size; judged for
            an ``H -> H`` layer of ``num_experts`` groups), each token is quantized once
            and its codes copied into its rows: ``x_perm`` is then a ``Float8Rows`` tensor
            (its FP8 codes and per-row factors; shape and dtype as without), which a
            ``grouped_linear``/``GroupedLinear``/``GroupedMLP`` of that recipe reads as it
            is: half the bytes written, and no second read to quantize. Any other use of
            it sees the dequantized values, as that layer would. Elsewhere, and for the
            recipes that scale by groups of rows (known only after permuting), ``x_perm``
            is plain. An enclosing ``gl.autocast`` does not change ``x_perm`` (rows may go
            elsewhere first, e.g. to an all-to-all).

    Returns:
        ``(x_perm, m_splits, row_map)``, and ``permuted_probs`` after them when
        ``probs`` is given:

        - ``x_perm`` ``(N, H)``: the rows of the routed slots, expert by expert
          in expert order, slots in ascending order ``t*k + j`` within an
          expert, each group followed by its zero padding rows. On CPU
          ``N = sum(m_splits)``; on CUDA nothing synchronizes and ``N`` is the
          upper bound ``min(T*k, E*capacity, num_out_tokens) + E*(multiple-1)``
          (the terms of the options given), rows past the data being zero
          (so too on CPU while ``torch.compile`` traces: nothing is read on the host).
        - ``m_splits`` ``(E,)`` int64 on ``x``'s device: the padded group sizes.
        - ``row_map`` int64 of the routing's shape (``(T, k)``, ``(T, 1)`` for
          top-1, ``(T, E)`` for a map): the row of ``x_perm`` holding each slot, or
          ``-1`` for a dropped slot.
        - ``permuted_probs`` ``(N,)`` in ``probs``' dtype: each row's slot
          probability, 0 in padding rows; differentiable in ``probs`` (a scatter
          into unique rows, its gradient a gather: deterministic).

    Differentiable in ``x``: ``grad_x[t] = sum_j grad_x_perm[row_map[t, j]]``
    (a gather, summed in float32 for half dtypes).
    """
    x = check_matrix(x, "x")
    topk_indices = inputs.check_routing(topk_indices, x.shape[0], x.device)
    num_experts = check_int("num_experts", num_experts)
    multiple = check_int("multiple", multiple)
    is_map = topk_indices.dtype == torch.bool
    if is_map and topk_indices.shape[1] != num_experts:
        raise ValueError(
            f"topk_indices is a bool routing map of shape {tuple(topk_indices.shape)}: "
            f"expected (T, num_experts) = ({x.shape[0]}, {num_experts})"
        )
    probs = inputs.check_probs(probs, topk_indices, x.device)
    tokens = topk_indices.shape[0]
    k = topk_indices.shape[1] if topk_indices.dim() == 2 else 1
    slots = tokens * k
    num_out_tokens = inputs.check_num_out_tokens(num_out_tokens, slots, multiple)
    capacity = inputs.check_capacity(capacity, tokens, k, num_experts, is_map,
                                      pad_to_capacity)
    drop_policy = inputs.check_drop_policy(drop_policy, capacity, probs)
    padded = inputs.check_pad_to_capacity(pad_to_capacity, capacity, num_experts, multiple)
    recipe = check_recipe(recipe, x.device)
    # The upper bound of the rows, and with it every padded size and row index, is an int64.
    num_rows = slots + num_experts * (multiple - 1)
    if num_rows > MAX_ROWS:
        raise ValueError(
            f"multiple is {multiple}: padding the groups of {num_experts} experts to it may take "
            f"up to {num_rows} rows, more than a tensor holds ({MAX_ROWS})"
        )
    fp8 = rows_recipe(recipe, x)
    if fp8 is not None and reads_fp8_rows(num_experts, x.shape[1], x.shape[1], fp8, num_rows,
                                          x.dtype, x.device) is None:
        fp8 = None  # the experts' calls take another route (their geometry judged H -> H)
    exact = x.device.type == "cpu" and host_checks()
    if not is_map and host_checks() and (exact or debug_checks_enabled()):
        check_range(
            topk_indices.view(tokens, k),
            num_experts,
            "topk_indices",
            f"expert indices must be in [-1, {num_experts - 1}] (num_experts={num_experts})",
        )
        inputs.check_not_mask(topk_indices, num_experts)

    with torch.no_grad():
        # Before the routing kernel: the row scatter, launched right after it, may read its
        # source while the routing finishes.
        codes = inv = None
        if fp8 is not None:
            codes, inv = quantize_rows.quantize_rows(x.contiguous(), fp8.forward_dtype,
                                                     fp8.power_of_two_scales)
        experts = topk_indices  # a (T, E) map as it is: the routing kernel reads it so
        if topk_indices.dim() == 1:
            experts = inputs.slot_experts(topk_indices, num_experts)
        kept = slots  # the most slots kept: the rows of the layout before padding
        if capacity is not None:
            kept = min(kept, num_experts * capacity)
        if num_out_tokens is not None:
            kept = min(kept, num_out_tokens)
        if capacity is not None and drop_policy == "probs":
            drop = (capacity_kernels.drop_over_capacity_reference if x.device.type == "cpu"
                    else capacity_kernels.drop_over_capacity)
            experts = drop(inputs.slot_experts(experts, num_experts) if is_map else experts,
                           probs.detach(), num_experts, capacity)
        # capacity by position, num_out_tokens and the fixed groups: thresholds on the ranks
        # in slot order, taken by the routing map itself
        layout = {"capacity": capacity, "keep": num_out_tokens,
                  "group_rows": capacity if padded else None}
        num_rows = num_experts * capacity if padded else kept + num_experts * (multiple - 1)
        if exact:  # exact size: N = sum(m_splits), read on the host
            m_splits, row_map, token_of_row, counts = routing.routing_map_reference(
                experts, num_experts, multiple, None, **layout)
        elif x.device.type == "cpu":  # traced: no host read, N is the upper bound
            m_splits, row_map, token_of_row, counts = routing.routing_map_reference(
                experts, num_experts, multiple, num_rows, **layout)
        else:  # one kernel, no sync: N is the upper bound
            m_splits, row_map, token_of_row, counts = routing.routing_map(
                experts, num_experts, multiple, num_rows, **layout)

    if fp8 is not None:
        x_perm = _PermuteFp8Rows.apply(x, codes, inv, fp8, token_of_row, row_map, m_splits,
                                       counts)
    else:
        x_perm = _PermuteRows.apply(x, token_of_row, row_map, m_splits, counts)
    if probs is None:
        return x_perm, m_splits, row_map
    return x_perm, m_splits, row_map, inputs.permute_probs(probs, row_map, x_perm.shape[0])


def unpermute(
    y_perm: torch.Tensor,
    row_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine the expert outputs back into token order.

    Args:
        y_perm: ``(N, H)`` rows in the layout :func:`permute` produced.
        row_map: ``(T, k)`` integer tensor from :func:`permute` (``(T, E)`` when
            it routed a bool map, ``(T, 1)`` for top-1): the row of ``y_perm`` of
            slot ``(t, j)``, ``-1`` for a dropped slot (any integer dtype; compared
            as int64). Its non-negative entries must be distinct (checked on CPU).
            On CPU entries outside ``[-1, N)`` are a ValueError; on CUDA, and while
            ``torch.compile`` traces (nothing is read on the host then), they count
            as dropped.
        probs: optional floating weights (e.g. the router's probabilities);
            ``None`` means a plain sum. Either one per slot, of ``row_map``'s shape
            (dense ``(T, E)`` for a map's ``(T, E)`` row map; ``(T,)`` for a
            ``(T, 1)`` top-1 row map), or, with ``topk_indices``, dense ``(T, E)``
            probabilities gathered at each slot's expert.
        topk_indices: the routing given to :func:`permute` (``(T, k)``, ``(T,)`` or
            a bool ``(T, E)`` map), used only to gather dense ``(T, E)`` ``probs``:
            slot ``(t, j)`` weighs ``probs[t, topk_indices[t, j]]`` (without ``probs``
            a ValueError). On CPU an index outside ``[-1, E)`` is a ValueError; on
            CUDA its slot weighs 0.

    Returns:
        ``(T, H)`` in ``y_perm``'s dtype:
        ``out[t] = sum_j probs[t, j] * y_perm[row_map[t, j]]`` over the
        non-dropped slots. Products and the k-way sum are computed in float32
        for float16/bfloat16 ``y_perm`` (else in its dtype), widened to
        ``probs``' dtype when that is wider, and rounded once to ``y_perm``'s
        dtype. ``probs`` may have a different dtype from ``y_perm``; its
        gradient comes back in ``probs``' dtype.

    Differentiable in ``y_perm`` and ``probs``; the backward is deterministic
    (a copy into unique rows, and per-slot dot products), and dropped slots
    get zero gradient. Only ``probs``' gradient needs ``y_perm``: it is kept for
    backward only when ``probs`` requires a gradient, and inside
    ``gl.autocast(recipe)`` (neither ``y_perm`` nor ``probs`` float64) as the
    recipe's forward FP8 codes with one factor per 128-column tile, written by the
    combine's own read: half the bytes of bf16, each product of ``probs``' gradient
    within half an E4M3 step; ``out`` and ``y_perm``'s gradient are unchanged.
    """
    y_perm = check_matrix(y_perm, "y_perm")
    row_map = _check_integer_matrix(row_map, "row_map")
    if row_map.device != y_perm.device:
        raise ValueError(f"row_map is on {row_map.device} but y_perm is on {y_perm.device}")
    experts = None
    if probs is None and topk_indices is not None:
        given = (f"shape {tuple(topk_indices.shape)}" if isinstance(topk_indices, torch.Tensor)
                 else describe(topk_indices))
        raise ValueError(
            f"topk_indices is given ({given}) without probs: it serves only to gather dense "
            "(T, E) probs at each slot's expert (a plain sum needs neither)"
        )
    if probs is not None:
        if not isinstance(probs, torch.Tensor):
            raise TypeError(f"probs is {type(probs).__name__}: expected a torch.Tensor or None")
        if not probs.is_floating_point():
            raise TypeError(f"probs has dtype {probs.dtype}: expected a floating-point tensor")
        if not y_perm.is_floating_point():  # weighted sums of integers would be truncated
            raise TypeError(f"y_perm has dtype {y_perm.dtype}: weighting by probs needs "
                            "floating-point rows")
        if probs.device != y_perm.device:
            raise ValueError(f"probs is on {probs.device} but y_perm is on {y_perm.device}")
        if topk_indices is not None:
            experts = _check_dense_routing(topk_indices, probs, row_map, y_perm.device)
        elif probs.shape == row_map.shape[:1] and row_map.shape[1:] == (1,):
            probs = probs.unsqueeze(1)  # top-1: one weight per token
        elif probs.shape != row_map.shape:
            raise ValueError(
                f"probs has shape {tuple(probs.shape)} but row_map has shape "
                f"{tuple(row_map.shape)}: expected one weight per slot (dense (T, E) probs "
                "of (T, k) index routing need topk_indices to be gathered)"
            )
    num_rows = y_perm.shape[0]
    if host_checks() and (y_perm.device.type == "cpu" or debug_checks_enabled()):
        check_range(
            row_map,
            num_rows,
            "row_map",
            f"entries must be -1 (dropped) or a row of y_perm in [0, {num_rows})",
        )
        # slots per row (-1 counted apart, at 0): one count, where a sort would find repeats
        held = torch.bincount(row_map.reshape(-1).to(torch.int64) + 1, minlength=num_rows + 1)
        if num_rows > 0 and int(held[1:].max()) > 1:
            row = int(held[1:].argmax())
            (t0, j0), (t1, j1) = (row_map == row).nonzero()[:2].tolist()
            raise ValueError(
                f"row_map[{t0}, {j0}] and row_map[{t1}, {j1}] are both {row}: each row of "
                "y_perm may be held by at most one slot (as permute produces)"
            )
        if experts is not None and topk_indices.dtype != torch.bool:
            high = probs.shape[1]
            check_range(topk_indices.view(row_map.shape), high, "topk_indices",
                         f"expert indices must be in [-1, {high - 1}] (probs has {high} columns)")
            inputs.check_not_mask(topk_indices, high)
    if experts is not None:
        probs = inputs.gather_dense_probs(probs, inputs.slot_experts(topk_indices, probs.shape[1]))
    recipe = current_recipe()
    return _Unpermute.apply(y_perm, row_map.to(torch.int64), probs,
                            None if recipe is None else recipe.forward_dtype)


def _check_dense_routing(topk_indices: object, probs: torch.Tensor, row_map: torch.Tensor,
                         device: torch.device) -> torch.Tensor:
    """``topk_indices`` once it is a routing of ``row_map``'s slots and ``probs`` is dense
    ``(T, E)`` (a map's ``E`` its column count)."""
    tokens = row_map.shape[0]
    topk_indices = inputs.check_routing(topk_indices, tokens, device, against="row_map")
    slot_shape = topk_indices.shape if topk_indices.dim() == 2 else (tokens, 1)
    if tuple(slot_shape) != tuple(row_map.shape):
        raise ValueError(
            f"topk_indices has shape {tuple(topk_indices.shape)} but row_map has shape "
            f"{tuple(row_map.shape)}: expected the routing permute was given"
        )
    if probs.dim() != 2 or probs.shape[0] != tokens:
        raise ValueError(
            f"probs has shape {tuple(probs.shape)}: with topk_indices, expected dense "
            f"probabilities (T, E) with T = {tokens}"
        )
    if topk_indices.dtype == torch.bool and probs.shape != topk_indices.shape:
        raise ValueError(
            f"probs has shape {tuple(probs.shape)} but the routing map topk_indices has shape "
            f"{tuple(topk_indices.shape)}: expected the same (T, E)"
        )
    return topk_indices


# torch.compile before torch 2.13 traces the two autograd functions above to zero input
# gradients (seen on 2.11): there they run eagerly, a graph break (an error with fullgraph).
TRACEABLE = torch.__version__ >= "2.13"
if not TRACEABLE:
    permute = torch.compiler.disable(permute)
    unpermute = torch.compiler.disable(unpermute)
