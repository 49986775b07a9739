"""The expert MLP's activation with fc1's per-group bias folded in: ``a = f(h + b[g])``
(``g`` the row's group) for every kind of :mod:`.activation_reference`, which gives the
formulas, the names and the plain-PyTorch reference.

With ``probs`` (one routing probability per row, ``(M,)``) the output is ``probs[:, None] * a``
(Megatron-Core's weighted activation): one more load per row. Its backward also gives the
gradient of ``probs``, ``sum over columns of a * grad_a`` per row, from the same pass: each
program stores the partial sum over its columns, and a ``(M, column programs)`` float32 sum
follows (deterministic, no atomics).

For a ``Float8Rowwise`` fc2 the forward can write ``a`` as FP8 codes per row with their
factors instead (:func:`bias_act_forward_fp8`: each program over whole rows, the row amax
first, then the codes), the bytes of ``a`` once, in FP8, with no pass to quantize it.

Rows past ``ends[-1]`` give zero. One read of ``h`` and one write of ``a`` forward; backward
recomputes from ``h`` (nothing else saved) in one read of ``h`` and ``grad_a`` and one write
of ``grad_h``, in ``h``'s column layout. Float32 math for every I/O dtype. A Triton kernel
each way, the PyTorch reference beside it (float64 inputs run it in float64); on the CPU
the reference runs over blocks of rows (:data:`CPU_BLOCK_BYTES`).
"""

import torch

from ._groups import row_group
from ._triton import cdiv, kernel, next_power_of_2, tl, triton, use_triton
from .activation_reference import (
    ACTIVATION_KINDS,
    CLAMPED_SWIGLU_LIMIT,
    GATED_KINDS,
    GPT_OSS_ALPHA,
    GPT_OSS_LIMIT,
    KIND_PARAMETERS,
    bias_act_backward_reference,
    bias_act_reference,
)
from .quantize.common import amax_to_scale, clamp_keeping_nan, finish, fp8_buffer, inverse
from .quantize.rows import quantize_rows_reference

__all__ = ["ACTIVATION_KINDS", "ACT_CONFIG", "GATED_KINDS", "GPT_OSS_ALPHA", "GPT_OSS_LIMIT",
           "CLAMPED_SWIGLU_LIMIT", "KIND_PARAMETERS", "bias_act_forward", "bias_act_forward_fp8",
           "bias_act_backward", "bias_act_reference", "bias_act_backward_reference"]


# --------------------------------------------------------------------------- Triton
@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * tl.sigmoid(2.0 * inner)  # 0.5 * x * (1 + tanh(inner))
    elif ACT == 2:
        return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACT == 6:
        r = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return r * r
    else:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(x)
        return s + x * s * (1.0 - s)
    elif ACT == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
    elif ACT == 2:
        return (x > 0.0).to(tl.float32)
    elif ACT == 6:
        return 2.0 * tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        return (0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
                + x * 0.3989422804014327 * tl.exp(-0.5 * x * x))


@triton.jit
def _clamped(gate, up, limit):
    """``min(gate, limit)`` and ``clamp(up, -limit, limit)`` (NaN stays NaN)."""
    g = tl.where(gate > limit, limit, gate)
    u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return g, u


@triton.jit
def _glu(gate, up, alpha, limit, ACT: tl.constexpr):
    if ACT == 4:
        g, u = _clamped(gate, up, limit)
        return (u + 1.0) * g * tl.sigmoid(alpha * g)
    elif ACT == 5:
        g, u = _clamped(gate, up, limit)
        return _act(g, 0) * u
    else:
        return _act(gate, ACT) * up


@triton.jit
def _glu_grads(gate, up, grad_a, alpha, limit, ACT: tl.constexpr):
    if ACT == 4:
        g, u = _clamped(gate, up, limit)
        s = tl.sigmoid(alpha * g)
        grad_gate = tl.where(gate <= limit,
                             grad_a * (u + 1.0) * (s + alpha * g * s * (1.0 - s)), 0.0)
        grad_up = tl.where((up >= -limit) & (up <= limit), grad_a * g * s, 0.0)
        return grad_gate, grad_up
    elif ACT == 5:
        g, u = _clamped(gate, up, limit)
        grad_gate = tl.where(gate <= limit, grad_a * u * _act_grad(g, 0), 0.0)
        grad_up = tl.where((up >= -limit) & (up <= limit), grad_a * _act(g, 0), 0.0)
        return grad_gate, grad_up
    else:
        return grad_a * up * _act_grad(gate, ACT), grad_a * _act(gate, ACT)


@triton.jit
def _load_input(h_ptr, bias_ptr, rows, cols, groups, in_group, mask, stride_h, stride_bias,
                HAS_BIAS: tl.constexpr):
    value = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
    if HAS_BIAS:
        value += tl.load(bias_ptr + groups.to(tl.int64)[:, None] * stride_bias + cols[None, :],
                         mask=mask & in_group[:, None], other=0.0).to(tl.float32)
    return value


@triton.jit
def _gate_up(h_ptr, bias_ptr, rows, block, groups, in_group, M, F, stride_h, stride_bias,
             HAS_BIAS: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gate and up values (the input twice where not gated) of output columns
    ``block * BLOCK_N + [0, BLOCK_N)`` of ``rows``, bias added, float32."""
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    if INTERLEAVED:  # one contiguous (BLOCK_M, 2 * BLOCK_N) tile of h, split into gate, up
        pair_cols = block * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        pair_mask = (rows < M)[:, None] & (pair_cols < 2 * F)[None, :]
        pairs = _load_input(h_ptr, bias_ptr, rows, pair_cols, groups, in_group, pair_mask,
                            stride_h, stride_bias, HAS_BIAS)
        gate, up = tl.split(tl.reshape(pairs, (BLOCK_M, BLOCK_N, 2)))
    else:
        gate = _load_input(h_ptr, bias_ptr, rows, cols, groups, in_group, mask, stride_h,
                           stride_bias, HAS_BIAS)
        up = gate
        if GATED:
            up = _load_input(h_ptr, bias_ptr, rows, cols + F, groups, in_group, mask,
                             stride_h, stride_bias, HAS_BIAS)
    return gate, up


@kernel
@triton.jit
def _bias_act_kernel(h_ptr, bias_ptr, ends_ptr, grad_a_ptr, out_ptr, probs_ptr, partials_ptr,
                     M, F, G, stride_h, stride_bias, stride_grad_a, stride_out, alpha, limit,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                     ACT: tl.constexpr, BACKWARD: tl.constexpr, HAS_PROBS: tl.constexpr,
                     PROBS_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    groups = row_group(ends_ptr, rows, G, BLOCK_G)
    in_group = groups < G
    keep = in_group[:, None]
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out
    gate, up = _gate_up(h_ptr, bias_ptr, rows, tl.program_id(1), groups, in_group, M, F,
                        stride_h, stride_bias, HAS_BIAS, GATED, INTERLEAVED, BLOCK_M, BLOCK_N)
    if HAS_PROBS:  # one probability per row, as a (BLOCK_M, 1) column
        probs = tl.load(probs_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    if not BACKWARD:
        if GATED:
            result = _glu(gate, up, alpha, limit, ACT)
        else:
            result = _act(gate, ACT)
        if HAS_PROBS:
            result = result * probs
        tl.store(out_rows + cols[None, :], tl.where(keep, result, 0.0).to(
            out_ptr.dtype.element_ty), mask=mask)
    else:
        grad_a = tl.load(grad_a_ptr + rows.to(tl.int64)[:, None] * stride_grad_a + cols[None, :],
                         mask=mask, other=0.0).to(tl.float32)
        grad_a = tl.where(keep, grad_a, 0.0)
        if HAS_PROBS:
            if PROBS_GRAD:  # this program's columns of sum(act * grad_a) per row
                if GATED:
                    value = _glu(gate, up, alpha, limit, ACT)
                else:
                    value = _act(gate, ACT)
                tl.store(partials_ptr + rows.to(tl.int64) * tl.num_programs(1)
                         + tl.program_id(1), tl.sum(value * grad_a, axis=1), mask=rows < M)
            grad_a = grad_a * probs
        if GATED:
            grad_gate, grad_up = _glu_grads(gate, up, grad_a, alpha, limit, ACT)
            if INTERLEAVED:  # gate and up gradients joined back into h's column order
                pair_cols = tl.program_id(1) * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
                pair_mask = (rows < M)[:, None] & (pair_cols < 2 * F)[None, :]
                grad_h = tl.reshape(tl.join(grad_gate, grad_up), (BLOCK_M, 2 * BLOCK_N))
                tl.store(out_rows + pair_cols[None, :], grad_h.to(out_ptr.dtype.element_ty),
                         mask=pair_mask)
            else:
                tl.store(out_rows + cols[None, :], grad_gate.to(out_ptr.dtype.element_ty),
                         mask=mask)
                tl.store(out_rows + (cols + F)[None, :], grad_up.to(out_ptr.dtype.element_ty),
                         mask=mask)
        else:
            tl.store(out_rows + cols[None, :], (grad_a * _act_grad(gate, ACT)).to(
                out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _output_tile(h_ptr, bias_ptr, probs_ptr, rows, block, groups, in_group, M, F, stride_h,
                 stride_bias, alpha, limit, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_PROBS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's output on column block ``block`` as the plain kernel stores it (rows
    past the groups zero, rounded to ``h``'s dtype), in float32."""
    gate, up = _gate_up(h_ptr, bias_ptr, rows, block, groups, in_group, M, F, stride_h,
                        stride_bias, HAS_BIAS, GATED, INTERLEAVED, BLOCK_M, BLOCK_N)
    if GATED:
        result = _glu(gate, up, alpha, limit, ACT)
    else:
        result = _act(gate, ACT)
    if HAS_PROBS:
        result *= tl.load(probs_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    return tl.where(in_group[:, None], result, 0.0).to(h_ptr.dtype.element_ty).to(tl.float32)


@kernel
@triton.jit
def _bias_act_fp8_kernel(h_ptr, bias_ptr, ends_ptr, probs_ptr, q_ptr, inv_ptr, M, F, G,
                         stride_h, stride_bias, stride_q, alpha, limit, FP8_MAX: tl.constexpr,
                         POW2: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                         INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
                         HAS_PROBS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """The forward with its output quantized per row: each program's rows twice over their
    columns (the second read mostly from L2), the row amax of the output as the plain kernel
    stores it, then its codes, and the row factors."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    groups = row_group(ends_ptr, rows, G, BLOCK_G)
    in_group = groups < G
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for block in range(0, tl.cdiv(F, BLOCK_N)):  # pass 1: row amax
        result = _output_tile(h_ptr, bias_ptr, probs_ptr, rows, block, groups, in_group, M, F,
                              stride_h, stride_bias, alpha, limit, HAS_BIAS, GATED,
                              INTERLEAVED, ACT, HAS_PROBS, BLOCK_M, BLOCK_N)
        amax = tl.maximum(amax, tl.max(tl.abs(result), axis=1))
    scale = amax_to_scale(amax, FP8_MAX, POW2)
    for block in range(0, tl.cdiv(F, BLOCK_N)):  # pass 2: scale, saturate, round
        result = _output_tile(h_ptr, bias_ptr, probs_ptr, rows, block, groups, in_group, M, F,
                              stride_h, stride_bias, alpha, limit, HAS_BIAS, GATED,
                              INTERLEAVED, ACT, HAS_PROBS, BLOCK_M, BLOCK_N)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        scaled = clamp_keeping_nan(result * scale[:, None], FP8_MAX)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :],
                 scaled.to(q_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (cols < F)[None, :])
    tl.store(inv_ptr + rows, inverse(scale), mask=row_mask)


# Launch shape: (rows, output columns, warps) per program.
ACT_CONFIG = (32, 64, 4)
# The FP8 output's: a program loops over whole rows.
ACT_FP8_CONFIG = (16, 128, 4)


def _launch(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor, kind: str,
            interleaved: bool, alpha: float, limit: float, grad_a: torch.Tensor | None,
            out: torch.Tensor, width: int, probs: torch.Tensor | None = None,
            partials: torch.Tensor | None = None) -> torch.Tensor:
    M = h.shape[0]
    G = ends.shape[0]
    block_m, block_n, warps = ACT_CONFIG
    grid = (cdiv(M, block_m), cdiv(width, block_n))
    gated = kind in GATED_KINDS
    _bias_act_kernel[grid](
        h, bias if bias is not None else h, ends, grad_a if grad_a is not None else h, out,
        probs if probs is not None else h, partials if partials is not None else out,
        M, width, G, h.stride(0), bias.stride(0) if bias is not None else 0,
        grad_a.stride(0) if grad_a is not None else 0, out.stride(0), float(alpha), float(limit),
        HAS_BIAS=bias is not None, GATED=gated, INTERLEAVED=gated and interleaved,
        ACT=ACTIVATION_KINDS[kind], BACKWARD=grad_a is not None, HAS_PROBS=probs is not None,
        PROBS_GRAD=partials is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_G=min(64, next_power_of_2(G)), num_warps=warps,
    )
    return out


def _triton_ok(*tensors: torch.Tensor | None) -> bool:
    return use_triton(tensors[0]) and all(
        t is None or (t.dtype != torch.float64 and t.stride(-1) == 1) for t in tensors)


# --------------------------------------------------------------------------- CPU
#: The CPU route runs the reference over blocks of rows whose float32 copy of ``h`` is about
#: this many bytes: its temporaries then stay in cache and are reused from the allocator's
#: free lists, where whole-tensor ones (tens of MiB at real sizes) are mapped and faulted in
#: at every call (a SwiGLU of 4096 x 3584 bf16, forward+backward on two cores: 25.7-26.9 ms
#: whole, 12.9-14.9 in blocks of 292 rows; torch's two bf16 ops, rounding twice: 8.2-10.5).
CPU_BLOCK_BYTES = 1 << 22


def _cpu_blocks(h: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` row blocks for the CPU route (one block where blocking does
    not apply: another device, or few rows)."""
    M = h.shape[0]
    if h.device.type != "cpu":
        return [(0, M)]
    rows = max(64, CPU_BLOCK_BYTES // (4 * max(1, h.shape[1])))
    return [(start, min(start + rows, M)) for start in range(0, M, rows)]


def _block_ends(ends: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Group ends of rows ``start:stop`` counted from ``start`` (earlier groups end at 0)."""
    return (ends - start).clamp_(0, stop - start)


def _blocked_forward(h, bias, ends, kind, zero_tail, interleaved, alpha, limit, probs, width):
    blocks = _cpu_blocks(h)
    if len(blocks) == 1:
        return bias_act_reference(h, bias, ends, kind, zero_tail, interleaved, alpha, limit,
                                  probs)
    out = torch.empty(h.shape[0], width, device=h.device, dtype=h.dtype)
    for start, stop in blocks:
        out[start:stop] = bias_act_reference(
            h[start:stop], bias, _block_ends(ends, start, stop), kind, zero_tail, interleaved,
            alpha, limit, None if probs is None else probs[start:stop])
    return out


def _blocked_backward(grad_a, h, bias, ends, kind, interleaved, alpha, limit, probs,
                      probs_grad):
    blocks = _cpu_blocks(h)
    if len(blocks) == 1:
        return bias_act_backward_reference(grad_a, h, bias, ends, kind, interleaved, alpha,
                                           limit, probs, probs_grad)
    grad_h = torch.empty_like(h)
    grad_probs = probs.new_empty(h.shape[0]) if probs_grad else None
    for start, stop in blocks:
        part_h, part_probs = bias_act_backward_reference(
            grad_a[start:stop], h[start:stop], bias, _block_ends(ends, start, stop), kind,
            interleaved, alpha, limit, None if probs is None else probs[start:stop], probs_grad)
        grad_h[start:stop] = part_h
        if grad_probs is not None:
            grad_probs[start:stop] = part_probs
    return grad_h, grad_probs


# --------------------------------------------------------------------------- public
def bias_act_forward(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor,
                     kind: str, zero_tail: bool, interleaved: bool = False,
                     alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT,
                     probs: torch.Tensor | None = None) -> torch.Tensor:
    """``(M, W)`` fc1 output (``W = 2F`` gated, else ``F``) -> ``(M, F)`` activation.

    ``bias`` is ``(G, W)`` or ``None``, in ``h``'s column layout; rows past ``ends[-1]``
    give zero (always in the Triton kernel; with ``zero_tail`` in the reference).
    ``interleaved``: gate and up columns alternate (gated kinds); ``alpha``, ``limit``: the
    clamping kinds' parameters (the other kinds ignore them; the defaults are
    ``gpt_oss_swiglu``'s, ``clamped_swiglu`` callers pass its limit); ``probs``: ``(M,)``
    contiguous, each row's factor (any floating dtype) or ``None``.
    """
    width = h.shape[1] // 2 if kind in GATED_KINDS else h.shape[1]
    if h.shape[0] == 0 or not _triton_ok(h, bias, probs):
        with torch.no_grad():
            return _blocked_forward(h, bias, ends, kind, zero_tail, interleaved, alpha, limit,
                                    probs, width)
    out = torch.empty(h.shape[0], width, device=h.device, dtype=h.dtype)
    return _launch(h, bias, ends, kind, interleaved, alpha, limit, None, out, width, probs)


def bias_act_forward_fp8(h: torch.Tensor, bias: torch.Tensor | None, ends: torch.Tensor,
                         kind: str, fp8_dtype: torch.dtype, power_of_two: bool,
                         interleaved: bool = False, alpha: float = GPT_OSS_ALPHA,
                         limit: float = GPT_OSS_LIMIT, probs: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`bias_act_forward`'s output quantized per row, written by the activation itself:
    FP8 codes ``(M, F)`` and float32 factors ``(M,)``, those of quantizing that output (rows
    past ``ends[-1]``: zero codes, factor 1)."""
    width = h.shape[1] // 2 if kind in GATED_KINDS else h.shape[1]
    if h.shape[0] == 0 or not _triton_ok(h, bias, probs):
        a = bias_act_forward(h, bias, ends, kind, True, interleaved, alpha, limit, probs)
        return quantize_rows_reference(a, fp8_dtype, power_of_two)
    M, G = h.shape[0], ends.shape[0]
    codes = fp8_buffer((M, width), h.device, fp8_dtype)
    inv = torch.empty(M, device=h.device, dtype=torch.float32)
    block_m, block_n, warps = ACT_FP8_CONFIG
    gated = kind in GATED_KINDS
    _bias_act_fp8_kernel[(cdiv(M, block_m),)](
        h, bias if bias is not None else h, ends, probs if probs is not None else h, codes, inv,
        M, width, G, h.stride(0), bias.stride(0) if bias is not None else 0, codes.stride(0),
        float(alpha), float(limit), FP8_MAX=torch.finfo(fp8_dtype).max, POW2=power_of_two,
        HAS_BIAS=bias is not None, GATED=gated, INTERLEAVED=gated and interleaved,
        ACT=ACTIVATION_KINDS[kind], HAS_PROBS=probs is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_G=min(64, next_power_of_2(G)), num_warps=warps,
    )
    return finish(codes, fp8_dtype), inv


def bias_act_backward(grad_a: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None,
                      ends: torch.Tensor, kind: str, zero_tail: bool, interleaved: bool = False,
                      alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT,
                      probs: torch.Tensor | None = None, probs_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(M, F)`` gradient of the activation -> ``(M, W)`` gradient of fc1's output, and with
    ``probs_grad`` the ``(M,)`` gradient of ``probs`` in its dtype (else ``None``).

    Recomputes from ``h`` (and ``bias``); rows past ``ends[-1]`` get zero.
    """
    width = h.shape[1] // 2 if kind in GATED_KINDS else h.shape[1]
    probs_grad = probs_grad and probs is not None
    if h.shape[0] == 0 or not _triton_ok(h, bias, grad_a, probs):
        return _blocked_backward(grad_a, h, bias, ends, kind, interleaved, alpha, limit, probs,
                                 probs_grad)
    out = torch.empty_like(h)
    partials = None
    if probs_grad:
        partials = torch.empty(h.shape[0], cdiv(width, ACT_CONFIG[1]), device=h.device,
                               dtype=torch.float32)
    _launch(h, bias, ends, kind, interleaved, alpha, limit, grad_a, out, width, probs, partials)
    return out, (partials.sum(1).to(probs.dtype) if partials is not None else None)
