"""FP8 grouped GEMMs for small problems: each kernel quantizes its high-precision operand
as it reads it, so a call is one launch per GEMM, with no quantization pass and no FP8 copy.

The forward, dgrad and weight gradient of the three recipes on a weight already in FP8 (the
forward codes ``(G, N, K)`` and their factors: ``(G, N)`` per output channel or expert, or
``(G, cdiv(N, 128), cdiv(K, 128))`` per block). The operands take the recipes' values bit
for bit (``kernels/quantize/emulate.py``; :func:`forward_reference`, :func:`dgrad_reference`
and :func:`wgrad_reference` run them in plain PyTorch where Triton cannot):

* forward: ``x`` per row (rowwise), per group (tensorwise, the group's scale given) or per
  1x128 tile; the kernel also writes each row's scale, which the weight gradient uses again;
* dgrad: rowwise, ``dy`` times the weight's channel factors, per row, against the codes;
  tensorwise, ``dy`` per group (scale given); blockwise, ``dy`` per 1x128 tile against the
  128x128 blocks;
* wgrad: rowwise and tensorwise, ``dy`` times ``x``'s per-row factors, per (group, column)
  along the group's rows, against ``x``'s forward codes; blockwise, both per column in
  blocks of 128 rows from each group's start.

FP8 values are exact in bf16, so the tensor cores multiply them in bf16 and accumulate in
float32 (the CPU interpreter, whose 16-bit dots are wrong, in float32): the results are an
FP8 GEMM's up to the order of float32 sums. Rounding to FP8 is done in float32 arithmetic
(round to nearest, ties to even, the casts' rule), the same on GPUs and in the interpreter,
whose float32 -> FP8 casts round wrongly. Small problems are bound by host time, not by
the GPU: these kernels trade the FP8 tensor cores' rate for launches (three per step
against the separate routes' 18).
"""

import torch

from .._groups import tile_list, tile_masks, tile_origin, weight_tile
from .._triton import cdiv, kernel, next_power_of_2, sm_count, tl, triton, use_triton
from ..ends import group_ends_reference
from ..quantize import emulate, transposed
from ..quantize.common import (
    amax_to_scale,
    clamp_keeping_nan,
    inverse,
    saturate,
    scale_from_amax,
)
from ..quantize.emulate import dequantize_codes
from ..quantize.folded import ColumnFactors

__all__ = ["forward", "dgrad", "wgrad", "forward_reference", "dgrad_reference",
           "wgrad_reference", "fits", "BLOCK"]

BLOCK = 128  # the blockwise recipe's tile, block and token block
# Warps per program: blockwise keeps a partial product beside the accumulator, which spills
# registers at 4 warps on sm90 (ptxas, tests/kernels/test_compiles_for_sm90.py) and not at 8.
_WARPS = {False: 4, True: 8}
_FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits,
# smallest normal exponent


@triton.jit
def _round_fp8(values, scale, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
               MIN_EXP: tl.constexpr):
    """``values * scale`` saturated at the format's largest value and rounded to the nearest
    FP8 value (ties to even), in float32: adding and taking away ``1.5 * 2**23`` steps
    rounds a float32 to a multiple of the step, the spacing of FP8 values in its binade."""
    scaled = clamp_keeping_nan(values * scale, FP8_MAX)
    exponent = ((scaled.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exponent = tl.maximum(exponent, MIN_EXP) - MANT
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0
    return (scaled + magic) - magic


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` of FP8 values held in float32."""
    if UPCAST:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@kernel
@triton.jit
def _forward_kernel(x_ptr, w_ptr, w_inv_ptr, bias_ptr, out_ptr, x_scale_ptr, group_scale_ptr,
                    sizes_ptr, M, N, K, G, stride_xm, stride_wg, stride_wn, stride_om,
                    stride_bias, stride_ig, stride_in, BLOCKWISE: tl.constexpr,
                    GROUP_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SAVE_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                    MIN_EXP: tl.constexpr, POW2: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_G: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """``out[rows of g] = q(x) @ codes_g^T`` scaled, ``+ bias[g]``; tail rows zero.
    Persistent over the (group, row tile, column tile) list. Blockwise: ``BLOCK_N`` and
    ``BLOCK_K`` are the recipe's 128. ``GROUP_SCALES``: ``x``'s scale is its group's, given
    (``(G,)`` at ``group_scale_ptr``), instead of each row's own."""
    gs, starts, ends, tile_begin, tile_end, total = tile_list(sizes_ptr, G, M, N, BLOCK_M,
                                                              BLOCK_N, BLOCK_G)
    for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
        g, end, row0, col_tile = tile_origin(tile, gs, starts, ends, tile_begin, tile_end, N,
                                             BLOCK_M, BLOCK_N)
        col0 = col_tile * BLOCK_N
        rows, cols, row_mask, col_mask = tile_masks(end, row0, col0, N, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if g < G:
            x_base = x_ptr + row0.to(tl.int64) * stride_xm
            w_base = w_ptr + g.to(tl.int64) * stride_wg + col0.to(tl.int64) * stride_wn
            if BLOCKWISE:
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_mask = ks < K
                    x = tl.load(x_base + (rows[:, None] * stride_xm + ks[None, :]),
                                mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    x = x.to(tl.float32)
                    scale = amax_to_scale(tl.max(tl.abs(x), axis=1), FP8_MAX, POW2)
                    w = tl.load(w_base + (ks[:, None] + cols[None, :] * stride_wn),
                                mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                    part = _dot(_round_fp8(x, scale[:, None], FP8_MAX, MANT, MIN_EXP),
                                w.to(tl.float32), tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                                UPCAST)
                    factor = tl.load(w_inv_ptr + g.to(tl.int64) * stride_ig
                                     + col_tile * stride_in + k0 // BLOCK_K)
                    acc += part * (inverse(scale) * factor)[:, None]
            else:
                if GROUP_SCALES:
                    scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(group_scale_ptr + g)
                else:
                    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
                    for k0 in range(0, K, BLOCK_K):  # pass 1: each row's amax
                        ks = k0 + tl.arange(0, BLOCK_K)
                        x = tl.load(x_base + (rows[:, None] * stride_xm + ks[None, :]),
                                    mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
                        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
                    scale = amax_to_scale(amax, FP8_MAX, POW2)
                for k0 in range(0, K, BLOCK_K):  # pass 2: quantize and multiply
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_mask = ks < K
                    x = tl.load(x_base + (rows[:, None] * stride_xm + ks[None, :]),
                                mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    w = tl.load(w_base + (ks[:, None] + cols[None, :] * stride_wn),
                                mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                    acc = _dot(_round_fp8(x.to(tl.float32), scale[:, None], FP8_MAX, MANT,
                                          MIN_EXP), w.to(tl.float32), acc, UPCAST)
                w_inv = tl.load(w_inv_ptr + g.to(tl.int64) * stride_ig + col0 + cols,
                                mask=col_mask, other=0.0)
                acc = acc * inverse(scale)[:, None] * w_inv[None, :]
                if SAVE_SCALE:
                    if col_tile == 0:  # one column tile per row tile writes the scales
                        tl.store(x_scale_ptr + row0 + rows, scale, mask=row_mask)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + g.to(tl.int64) * stride_bias + col0 + cols,
                               mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + row0.to(tl.int64) * stride_om + col0 \
            + (rows[:, None] * stride_om + cols[None, :])
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _folded(dy_base, inv_base, rows, ns, row_mask, N, stride_dym):
    """Columns ``ns`` of the tile's ``dy`` rows times the weight's channel factors, float32."""
    n_mask = ns < N
    dy = tl.load(dy_base + (rows[:, None] * stride_dym + ns[None, :]),
                 mask=row_mask[:, None] & n_mask[None, :], other=0.0)
    return dy.to(tl.float32) * tl.load(inv_base + ns, mask=n_mask, other=0.0)[None, :]


@kernel
@triton.jit
def _dgrad_kernel(dy_ptr, w_ptr, w_inv_ptr, dx_ptr, group_scale_ptr, sizes_ptr, M, N, K, G,
                  stride_dym, stride_wg, stride_wn, stride_dxm, stride_ig, stride_in,
                  BLOCKWISE: tl.constexpr, GROUP_SCALES: tl.constexpr,
                  FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                  MIN_EXP: tl.constexpr, POW2: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_G: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """``dx[rows of g] = q(dy) @ codes_g`` scaled; tail rows zero. ``BLOCK_K`` output
    columns, ``BLOCK_R`` of ``N`` per step (blockwise: 128, and ``BLOCK_K`` divides 128).
    ``GROUP_SCALES`` (tensorwise): ``dy``'s scale is its group's, given, and the weight's
    factor, one per expert, multiplies the result instead of ``dy``."""
    gs, starts, ends, tile_begin, tile_end, total = tile_list(sizes_ptr, G, M, K, BLOCK_M,
                                                              BLOCK_K, BLOCK_G)
    for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
        g, end, row0, col_tile = tile_origin(tile, gs, starts, ends, tile_begin, tile_end, K,
                                             BLOCK_M, BLOCK_K)
        k0 = col_tile * BLOCK_K
        rows, ks, row_mask, k_mask = tile_masks(end, row0, k0, K, BLOCK_M, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        if g < G:
            dy_base = dy_ptr + row0.to(tl.int64) * stride_dym
            w_base = w_ptr + g.to(tl.int64) * stride_wg + k0
            if BLOCKWISE:
                for n0 in range(0, N, BLOCK_R):
                    ns = n0 + tl.arange(0, BLOCK_R)
                    n_mask = ns < N
                    dy = tl.load(dy_base + (rows[:, None] * stride_dym + ns[None, :]),
                                 mask=row_mask[:, None] & n_mask[None, :], other=0.0)
                    dy = dy.to(tl.float32)
                    scale = amax_to_scale(tl.max(tl.abs(dy), axis=1), FP8_MAX, POW2)
                    w = tl.load(w_base + (ns.to(tl.int64)[:, None] * stride_wn + ks[None, :]),
                                mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    part = _dot(_round_fp8(dy, scale[:, None], FP8_MAX, MANT, MIN_EXP),
                                w.to(tl.float32), tl.zeros([BLOCK_M, BLOCK_K], tl.float32),
                                UPCAST)
                    factor = tl.load(w_inv_ptr + g.to(tl.int64) * stride_ig
                                     + (n0 // BLOCK_R) * stride_in + k0 // BLOCK_R)
                    acc += part * (inverse(scale) * factor)[:, None]
            else:  # rowwise: dy times the weight's channel factors, one scale per row
                inv_base = w_inv_ptr + g.to(tl.int64) * stride_ig
                if GROUP_SCALES:
                    scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(group_scale_ptr + g)
                else:
                    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
                    for n0 in range(0, N, BLOCK_R):
                        ns = n0 + tl.arange(0, BLOCK_R)
                        amax = tl.maximum(amax, tl.max(tl.abs(_folded(
                            dy_base, inv_base, rows, ns, row_mask, N, stride_dym)), axis=1))
                    scale = amax_to_scale(amax, FP8_MAX, POW2)
                for n0 in range(0, N, BLOCK_R):
                    ns = n0 + tl.arange(0, BLOCK_R)
                    n_mask = ns < N
                    if GROUP_SCALES:
                        dy = tl.load(dy_base + (rows[:, None] * stride_dym + ns[None, :]),
                                     mask=row_mask[:, None] & n_mask[None, :], other=0.0)
                        dy = dy.to(tl.float32)
                    else:
                        dy = _folded(dy_base, inv_base, rows, ns, row_mask, N, stride_dym)
                    w = tl.load(w_base + (ns.to(tl.int64)[:, None] * stride_wn + ks[None, :]),
                                mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    acc = _dot(_round_fp8(dy, scale[:, None], FP8_MAX, MANT, MIN_EXP),
                               w.to(tl.float32), acc, UPCAST)
                acc = acc * inverse(scale)[:, None]
                if GROUP_SCALES:
                    acc = acc * tl.load(inv_base)  # the expert's weight factor
        out = dx_ptr + row0.to(tl.int64) * stride_dxm + k0 \
            + (rows[:, None] * stride_dxm + ks[None, :])
        tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None] & k_mask[None, :])


@kernel
@triton.jit
def _wgrad_kernel(dy_ptr, x_ptr, x_scale_ptr, dw_ptr, db_ptr, sizes_ptr, M, N, K, G,
                  stride_dym, stride_xm, stride_dwg, stride_dwn, BLOCKWISE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, FP8_MAX: tl.constexpr, GRAD_FP8_MAX: tl.constexpr,
                  MANT: tl.constexpr, MIN_EXP: tl.constexpr, GRAD_MANT: tl.constexpr,
                  GRAD_MIN_EXP: tl.constexpr, POW2: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    """Tile (group, N tile, K tile) of ``dw[g] = q(dy)^T q(x)`` scaled and, with
    ``HAS_BIAS``, in the K tile 0, ``db[g]``: float32 sums of ``dy`` over the group's rows.
    Blockwise: ``BLOCK_M`` is the recipe's 128-row block."""
    g, k_tile, start, end, cols_n, cols_k, n_mask, k_mask = weight_tile(
        tl.program_id(0), sizes_ptr, G, M, N, K, BLOCK_N, BLOCK_K, BLOCK_G)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sums = tl.zeros([BLOCK_N], dtype=tl.float32)
    if BLOCKWISE:
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_mask = rows < end
            dy_t = tl.load(dy_ptr + rows.to(tl.int64)[None, :] * stride_dym + cols_n[:, None],
                           mask=n_mask[:, None] & row_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols_k[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            dy_scale = amax_to_scale(tl.max(tl.abs(dy_t), axis=1), GRAD_FP8_MAX, POW2)
            x_scale = amax_to_scale(tl.max(tl.abs(x), axis=0), FP8_MAX, POW2)
            part = _dot(_round_fp8(dy_t, dy_scale[:, None], GRAD_FP8_MAX, GRAD_MANT,
                                   GRAD_MIN_EXP),
                        _round_fp8(x, x_scale[None, :], FP8_MAX, MANT, MIN_EXP),
                        tl.zeros([BLOCK_N, BLOCK_K], tl.float32), UPCAST)
            acc += part * inverse(dy_scale)[:, None] * inverse(x_scale)[None, :]
            if HAS_BIAS:
                sums += tl.sum(dy_t, axis=1)
    else:  # dy times x's per-row factors, one scale per (group, column) along the rows
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_mask = rows < end
            dy_t = tl.load(dy_ptr + rows.to(tl.int64)[None, :] * stride_dym + cols_n[:, None],
                           mask=n_mask[:, None] & row_mask[None, :], other=0.0)
            x_inv = inverse(tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0))
            folded = tl.clamp(dy_t.to(tl.float32) * x_inv[None, :], -3.4028234663852886e38,
                              3.4028234663852886e38)
            amax = tl.maximum(amax, tl.max(tl.abs(folded), axis=1))
            if HAS_BIAS:
                sums += tl.sum(dy_t.to(tl.float32), axis=1)
        dy_scale = amax_to_scale(amax, GRAD_FP8_MAX, POW2)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_mask = rows < end
            dy_t = tl.load(dy_ptr + rows.to(tl.int64)[None, :] * stride_dym + cols_n[:, None],
                           mask=n_mask[:, None] & row_mask[None, :], other=0.0)
            x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0)
            folded = tl.clamp(dy_t.to(tl.float32) * inverse(x_scale)[None, :],
                              -3.4028234663852886e38, 3.4028234663852886e38)
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols_k[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc = _dot(_round_fp8(folded, dy_scale[:, None], GRAD_FP8_MAX, GRAD_MANT,
                                  GRAD_MIN_EXP),
                       _round_fp8(x.to(tl.float32), x_scale[:, None], FP8_MAX, MANT, MIN_EXP),
                       acc, UPCAST)
        acc = acc * inverse(dy_scale)[:, None]
    dw = dw_ptr + g.to(tl.int64) * stride_dwg + cols_n.to(tl.int64)[:, None] * stride_dwn \
        + cols_k[None, :]
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
    if HAS_BIAS:
        if k_tile == 0:
            tl.store(db_ptr + g.to(tl.int64) * N + cols_n, sums, mask=n_mask)


MAX_GROUPS = 4095


def fits(num_groups: int, in_features: int, out_features: int) -> bool:
    """Whether these kernels take the problem (the group schedule is a vector of
    ``num_groups + 1`` slots; offsets inside one expert's weight are int32)."""
    return num_groups <= MAX_GROUPS and in_features * out_features < 2**31


def _format(fp8_dtype: torch.dtype) -> dict:
    mant, min_exp = _FORMATS[fp8_dtype]
    return dict(FP8_MAX=torch.finfo(fp8_dtype).max, MANT=mant, MIN_EXP=min_exp)


def _stored(like: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The CPU interpreter truncates float32 -> 16-bit stores: there the kernels store
    float32 and torch rounds."""
    return torch.float32 if like.is_cpu and dtype != torch.float32 else dtype


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _programs(device: torch.device, rows: int, groups: int, width: int, block_m: int,
              block_n: int) -> int:
    return max(1, min(sm_count(device), (cdiv(rows, block_m) + groups + 1) * cdiv(width, block_n)))


# --------------------------------------------------------------------------- references
def _bounds(sizes: torch.Tensor, num_rows: int) -> list[tuple[int, int]]:
    ends = group_ends_reference(sizes, num_rows).tolist()
    return list(zip([0] + ends[:-1], ends))


def _row_quantized(t: torch.Tensor, sizes: torch.Tensor, blockwise: bool, fp8: torch.dtype,
                   pow2: bool, group_scale: torch.Tensor | None) -> torch.Tensor:
    """The token-side operand's FP8 values (float32): per 1x128 tile, per row, or per group."""
    if blockwise:
        return emulate.fake_quant_column_tiles(t, fp8, pow2)
    if group_scale is None:
        return emulate.fake_quant_rows(t, fp8, pow2)
    rows = emulate.per_row(group_scale, group_ends_reference(sizes, t.shape[0]), t.shape[0])
    return emulate.fake_quant(t.float(), rows[:, None], fp8)


def forward_reference(x, codes, inv, bias, sizes, blockwise, fp8_dtype, power_of_two,
                      save_scale=False, group_scale=None):
    """:func:`forward` in plain PyTorch (the same values, float32 products)."""
    xq = _row_quantized(x, sizes, blockwise, fp8_dtype, power_of_two, group_scale)
    w = dequantize_codes(codes, inv, torch.float32)
    out = x.new_zeros((x.shape[0], codes.shape[1]), dtype=torch.float32)
    for g, (start, end) in enumerate(_bounds(sizes, x.shape[0])):
        out[start:end] = xq[start:end] @ w[g].T + (bias[g].float() if bias is not None else 0)
    scale = None
    if save_scale:  # rows past the groups: 1 (the kernel leaves them unset)
        scale = (emulate.per_row(group_scale, group_ends_reference(sizes, x.shape[0]),
                                 x.shape[0])
                 if group_scale is not None else
                 scale_from_amax(x.float().abs().amax(dim=1), fp8_dtype, power_of_two))
    return out.to(x.dtype), scale


def dgrad_reference(grad_out, codes, inv, sizes, blockwise, fp8_dtype, power_of_two,
                    group_scale=None):
    """:func:`dgrad` in plain PyTorch."""
    bounds = _bounds(sizes, grad_out.shape[0])
    if blockwise or group_scale is not None:
        dyq = _row_quantized(grad_out, sizes, blockwise, fp8_dtype, power_of_two, group_scale)
        w = dequantize_codes(codes, inv, torch.float32)
    else:  # the weight's channel factors moved onto dy
        ends = group_ends_reference(sizes, grad_out.shape[0])
        folded = ColumnFactors.of_groups(inv, ends, grad_out.shape[0]).apply(grad_out)
        dyq, w = emulate.fake_quant_rows(folded, fp8_dtype, power_of_two), codes.float()
    dx = grad_out.new_zeros((grad_out.shape[0], codes.shape[2]), dtype=torch.float32)
    for g, (start, end) in enumerate(bounds):
        dx[start:end] = dyq[start:end] @ w[g]
    return dx.to(grad_out.dtype)


def wgrad_reference(grad_out, x, x_scale, sizes, blockwise, fp8_dtype, grad_fp8_dtype,
                    power_of_two, out_dtype, bias_sums=None):
    """:func:`wgrad` in plain PyTorch."""
    bounds = _bounds(sizes, x.shape[0])
    ends = group_ends_reference(sizes, x.shape[0])
    if blockwise:
        a = emulate.fake_quant_row_tiles(grad_out, ends, grad_fp8_dtype, power_of_two)
        b = emulate.fake_quant_row_tiles(x, ends, fp8_dtype, power_of_two)
    elif x.shape[1] == 0 or grad_out.shape[1] == 0:  # nothing to multiply
        a, b = grad_out.float(), x.float()
    else:  # x's forward codes, its row factors moved onto dy
        scale = x_scale.clone()
        scale[bounds[-1][1] if bounds else 0:] = 1.0  # rows past the groups: unset
        b = saturate(x, scale[:, None], fp8_dtype).float()
        a = emulate.fake_quant_group_columns(transposed.fold_row_factors(grad_out, 1.0 / scale),
                                             ends, grad_fp8_dtype, power_of_two)
    dw = x.new_zeros((sizes.shape[0], grad_out.shape[1], x.shape[1]), dtype=torch.float32)
    for g, (start, end) in enumerate(bounds):
        dw[g] = a[start:end].T @ b[start:end]
        if bias_sums is not None:
            bias_sums[g] = grad_out[start:end].float().sum(0)
    return dw.to(out_dtype)


# --------------------------------------------------------------------------- launches
def forward(x: torch.Tensor, codes: torch.Tensor, inv: torch.Tensor, bias: torch.Tensor | None,
            sizes: torch.Tensor, blockwise: bool, fp8_dtype: torch.dtype, power_of_two: bool,
            save_scale: bool = False, group_scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(M, K) x (G, N, K) -> (M, N)`` in ``x``'s dtype, ``x`` quantized in the kernel, the
    bias added and tail rows zero; with ``save_scale`` (per row) also ``x``'s ``(M,)``
    float32 row scales (rows past the groups unset). ``group_scale`` ``(G,)`` (tensorwise):
    each row takes its group's scale."""
    if not use_triton(x):
        return forward_reference(x, codes, inv, bias, sizes, blockwise, fp8_dtype,
                                 power_of_two, save_scale, group_scale)
    x, sizes = _rows(x), sizes.contiguous()
    M, K = x.shape
    G, N, _ = codes.shape
    out = x.new_empty((M, N), dtype=_stored(x, x.dtype))
    scale = x.new_empty(M, dtype=torch.float32) if save_scale else None
    if M == 0 or N == 0:
        return out.to(x.dtype), scale
    block_m, block_n, block_k = (64, BLOCK, BLOCK) if blockwise else (64, 128, 64)
    programs = _programs(x.device, M, G, N, block_m, block_n)
    _forward_kernel[(programs,)](
        x, codes, inv, bias if bias is not None else out, out,
        scale if scale is not None else out, group_scale if group_scale is not None else out,
        sizes, M, N, K, G, x.stride(0), codes.stride(0), codes.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0, inv.stride(0), inv.stride(1),
        BLOCKWISE=blockwise, GROUP_SCALES=group_scale is not None, HAS_BIAS=bias is not None,
        SAVE_SCALE=save_scale, POW2=power_of_two, UPCAST=x.is_cpu, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=next_power_of_2(G + 1),
        NUM_PROGRAMS=programs, num_warps=_WARPS[blockwise], num_stages=2, **_format(fp8_dtype))
    return out.to(x.dtype), scale


def dgrad(grad_out: torch.Tensor, codes: torch.Tensor, inv: torch.Tensor, sizes: torch.Tensor,
          blockwise: bool, fp8_dtype: torch.dtype, power_of_two: bool,
          group_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(M, N) x (G, N, K) -> (M, K)`` in ``grad_out``'s dtype, ``grad_out`` quantized in
    the kernel (rowwise: times ``inv``, the weight's channel factors, first; with
    ``group_scale`` ``(G,)``, tensorwise, by its group's scale, the expert's factor applied
    to the result); tail rows zero."""
    if not use_triton(grad_out):
        return dgrad_reference(grad_out, codes, inv, sizes, blockwise, fp8_dtype, power_of_two,
                               group_scale)
    grad_out, sizes = _rows(grad_out), sizes.contiguous()
    M, N = grad_out.shape
    G, _, K = codes.shape
    dx = grad_out.new_empty((M, K), dtype=_stored(grad_out, grad_out.dtype))
    if M == 0 or K == 0:
        return dx.to(grad_out.dtype)
    block_m, block_k, block_r = (64, BLOCK, BLOCK) if blockwise else (64, 128, 64)
    programs = _programs(grad_out.device, M, G, K, block_m, block_k)
    _dgrad_kernel[(programs,)](
        grad_out, codes, inv, dx, group_scale if group_scale is not None else dx, sizes, M, N,
        K, G, grad_out.stride(0), codes.stride(0), codes.stride(1), dx.stride(0), inv.stride(0),
        inv.stride(1), BLOCKWISE=blockwise, GROUP_SCALES=group_scale is not None,
        POW2=power_of_two, UPCAST=grad_out.is_cpu, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_R=block_r, BLOCK_G=next_power_of_2(G + 1), NUM_PROGRAMS=programs,
        num_warps=_WARPS[blockwise], num_stages=2, **_format(fp8_dtype))
    return dx.to(grad_out.dtype)


def wgrad(grad_out: torch.Tensor, x: torch.Tensor, x_scale: torch.Tensor | None,
          sizes: torch.Tensor, blockwise: bool, fp8_dtype: torch.dtype,
          grad_fp8_dtype: torch.dtype, power_of_two: bool, out_dtype: torch.dtype,
          bias_sums: torch.Tensor | None = None) -> torch.Tensor:
    """``(G, N, K)`` weight gradient in ``out_dtype``, both operands quantized in the kernel
    (rowwise: ``x`` with its forward row scales ``x_scale``, ``dy`` times their factors);
    empty groups give zeros. ``bias_sums``: a ``(G, N)`` float32 tensor filled with the
    groups' sums of ``grad_out``."""
    if not use_triton(x):
        return wgrad_reference(grad_out, x, x_scale, sizes, blockwise, fp8_dtype,
                               grad_fp8_dtype, power_of_two, out_dtype, bias_sums)
    grad_out, x, sizes = _rows(grad_out), _rows(x), sizes.contiguous()
    M, N = grad_out.shape
    K = x.shape[1]
    G = sizes.shape[0]
    if N == 0 or K == 0:  # nothing to multiply; the bias sums still cover the groups' rows
        return wgrad_reference(grad_out, x, x_scale, sizes, blockwise, fp8_dtype,
                               grad_fp8_dtype, power_of_two, out_dtype, bias_sums)
    dw = x.new_empty((G, N, K), dtype=_stored(x, out_dtype))
    block_m, block_n, block_k = (BLOCK, 64, 64) if blockwise else (64, 64, 64)
    grad_format = {f"GRAD_{key}": value for key, value in _format(grad_fp8_dtype).items()}
    _wgrad_kernel[(G * cdiv(N, block_n) * cdiv(K, block_k),)](
        grad_out, x, x_scale if x_scale is not None else dw, dw,
        bias_sums if bias_sums is not None else dw, sizes, M, N, K, G, grad_out.stride(0),
        x.stride(0), dw.stride(0), dw.stride(1), BLOCKWISE=blockwise,
        HAS_BIAS=bias_sums is not None, POW2=power_of_two, UPCAST=x.is_cpu, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=next_power_of_2(G + 1),
        num_warps=_WARPS[blockwise], num_stages=2, **_format(fp8_dtype), **grad_format)
    return dw.to(out_dtype)
