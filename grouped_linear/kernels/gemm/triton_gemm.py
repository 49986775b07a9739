"""Grouped GEMMs in Triton: one launch per GEMM, everything around it fused in.

The kernels take the raw ``(G,)`` split sizes (any integer dtype, on the
device) and derive each group's clamped rows themselves, so no ends kernel
runs first; rows past the last group form a "tail" that the forward and dgrad
kernels fill with zeros; the forward adds the per-group bias in its epilogue;
the wgrad kernel also sums the output gradient per group (the bias gradient)
from the tiles it already loads. Small problems, where every launch counts,
are what this backend is for; the plain-PyTorch references are the ``loop``
functions of :mod:`grouped_linear.kernels.gemm.torch_gemm`.

Shapes: ``x`` ``(M, K)``, ``weight`` ``(G, N, K)``, ``bias`` ``(G, N)``,
``grad_out`` ``(M, N)``. All index arithmetic on rows and strides is int64.
"""


from typing import NamedTuple

import torch

from .._groups import group_span, tile_list, tile_masks, tile_origin
from .._triton import LaunchPlan, PlanCache, cdiv, kernel, next_power_of_2, sm_count, tl, triton
from ..bias import bias_grad_reference
from ..ends import group_ends

__all__ = ["forward", "dgrad", "wgrad", "backward", "LinearLaunches", "fits", "MAX_GROUPS",
           "WgradTile", "wgrad_tile", "ONE_LAUNCH_MAX_WEIGHTS"]


class WgradTile(NamedTuple):
    """Launch shape of the weight-gradient programs (:func:`wgrad`, and the one-launch
    :func:`backward`, whose whole launch takes its warps and stages): rows of ``dy`` and
    ``x`` per step, the ``N`` and ``K`` columns of the output tile one program writes, warps
    and pipeline stages, and ``K`` tiles per program (written one after the other, the
    group looked up once)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    k_run: int = 1


# Small groups' weight gradients are bound by their programs' latency (G x N x K outputs from
# a few rows each). ``benchmarks/backend_choice.py --part fine-backward`` (H100, 40 cells of
# 64-256 groups of 8-32 rows): two launches, runs of four K tiles per program, 16-row
# unpipelined steps up to 16 rows a group on average, 64-row steps in two stages above, took
# 0.53-0.64x the one-launch backward's time (its 255 registers left a weight-gradient
# program 1-2 slots per SM) and ran at 0.93-1.19x torch's two grouped GEMMs' speed.
SMALL_GROUPS_TILE = WgradTile(16, 64, 64, 4, 1, k_run=4)
WGRAD_TILE = WgradTile(64, 64, 64, 4, 2, k_run=4)
# The one-launch backward, kept for weight gradients of at most this many weights: there
# the launch it saves is the host time that sets a step's pace (docs/design.md, "Small
# problems"), with the launch shape it was measured at.
ONE_LAUNCH_MAX_WEIGHTS = 2**24
ONE_LAUNCH_TILE = WgradTile(64, 64, 64, 4, 3)


def wgrad_tile(num_rows: int, num_groups: int) -> WgradTile:
    """The weight gradient's launch shape for ``num_rows`` rows over ``num_groups`` groups."""
    return SMALL_GROUPS_TILE if num_rows <= 16 * num_groups else WGRAD_TILE


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST`` multiplies in float32 (Triton's CPU interpreter
    gets 16-bit dots wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mm_tiles(first_tile, a_ptr, b_ptr, bias_ptr, out_ptr, sizes_ptr, M, N, K, G,
              stride_am, stride_bg, stride_bk, stride_bn, stride_om, stride_bias,
              HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_G: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """``out[rows of g] = a[rows of g] @ B_g (+ bias[g])``; tail rows get zeros.

    ``B_g[k, n]`` lives at ``b_ptr + g*stride_bg + k*stride_bk + n*stride_bn``.
    Persistent: the caller's program walks the (group, row tile, column tile) list from
    ``first_tile`` in steps of ``NUM_PROGRAMS``.
    """
    gs, starts, ends, tile_begin, tile_end, total = tile_list(sizes_ptr, G, M, N, BLOCK_M,
                                                              BLOCK_N, BLOCK_G)
    for tile in range(first_tile, total, NUM_PROGRAMS):
        g, end, row0, col_tile = tile_origin(tile, gs, starts, ends, tile_begin, tile_end, N,
                                             BLOCK_M, BLOCK_N)
        col0 = col_tile * BLOCK_N
        rows, cols, row_mask, col_mask = tile_masks(end, row0, col0, N, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if g < G:
            a_base = a_ptr + row0.to(tl.int64) * stride_am
            b_base = b_ptr + g.to(tl.int64) * stride_bg + col0.to(tl.int64) * stride_bn
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                a = tl.load(a_base + (rows[:, None] * stride_am + ks[None, :]),
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_base + (ks[:, None] * stride_bk + cols[None, :] * stride_bn),
                            mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc = _mma(a, b, acc, PRECISION, UPCAST)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + g.to(tl.int64) * stride_bias + col0 + cols, mask=col_mask,
                               other=0.0).to(tl.float32)[None, :]
        out = out_ptr + (row0.to(tl.int64) * stride_om + col0) + (rows[:, None] * stride_om + cols[None, :])
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@kernel
@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, bias_ptr, out_ptr, sizes_ptr, M, N, K, G,
                       stride_am, stride_bg, stride_bk, stride_bn, stride_om, stride_bias,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_G: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """The forward (and dgrad): :func:`_mm_tiles` on ``NUM_PROGRAMS`` programs."""
    _mm_tiles(tl.program_id(0), a_ptr, b_ptr, bias_ptr, out_ptr, sizes_ptr, M, N, K, G,
              stride_am, stride_bg, stride_bk, stride_bn, stride_om, stride_bias, HAS_BIAS,
              PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_G, NUM_PROGRAMS)


@triton.jit
def _dy_rows_t(dy_ptr, m0, end, cols_n, n_mask, stride_dym, BLOCK_M: tl.constexpr):
    """``dy[m0 : m0 + BLOCK_M, cols_n]`` transposed, ``(BLOCK_N, BLOCK_M)``, zeros past
    ``end``. An int64 scalar base (``m0`` runs over the int64 group rows) and int32 offsets
    within the block: 64-bit pointer tensors cost 10-20 registers a program."""
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < (end - m0).to(tl.int32)
    return tl.load(dy_ptr + m0 * stride_dym + (rows[None, :] * stride_dym + cols_n[:, None]),
                   mask=n_mask[:, None] & row_mask[None, :], other=0.0)


@triton.jit
def _wgrad_tile(pid, dy_ptr, x_ptr, dw_ptr, db_ptr, sizes_ptr, M, N, K, G,
                stride_dym, stride_xm, stride_dwg, stride_dwn,
                HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_G: tl.constexpr, K_RUN: tl.constexpr):
    """Program ``pid`` (numbered group, N tile, run of ``K_RUN`` K tiles): those tiles of
    ``dw[g] = dy[rows of g]^T @ x[rows of g]`` one after the other (the group looked up
    once) and, with ``HAS_BIAS``, the program of the first run ``db[g] = sum of dy[rows of g]``
    (float32 sums) in a pass of its own.

    Not from the products' ``dy`` tiles: with that second reader Triton 3.6's pipeliner kept
    one buffer too few for ``dy`` on sm90, a race (docs/design.md, "Determinism")."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_runs = tl.cdiv(k_tiles, K_RUN)
    g = pid // (n_tiles * k_runs)
    n_tile = (pid // k_runs) % n_tiles
    k_run = pid % k_runs
    start, end = group_span(g, sizes_ptr, G, M, BLOCK_G)
    cols_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols_n < N
    if HAS_BIAS:
        if k_run == 0:
            sums = tl.zeros([BLOCK_N], dtype=tl.float32)
            for m0 in range(start, end, BLOCK_M):
                dy_t = _dy_rows_t(dy_ptr, m0, end, cols_n, n_mask, stride_dym, BLOCK_M)
                sums += tl.sum(dy_t.to(tl.float32), axis=1)
            tl.store(db_ptr + g.to(tl.int64) * N + cols_n, sums.to(db_ptr.dtype.element_ty),
                     mask=n_mask)
    for k_tile in range(k_run * K_RUN, tl.minimum(k_run * K_RUN + K_RUN, k_tiles)):
        cols_k = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = cols_k < K
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            dy_t = _dy_rows_t(dy_ptr, m0, end, cols_n, n_mask, stride_dym, BLOCK_M)
            rows = tl.arange(0, BLOCK_M)
            row_mask = rows < (end - m0).to(tl.int32)
            x = tl.load(x_ptr + m0 * stride_xm
                        + (rows[:, None] * stride_xm + cols_k[None, :]),
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc = _mma(dy_t, x, acc, PRECISION, UPCAST)
        dw = dw_ptr + (g.to(tl.int64) * stride_dwg + (n_tile * BLOCK_N).to(tl.int64) * stride_dwn
                       + k_tile * BLOCK_K)
        tl.store(dw + (tl.arange(0, BLOCK_N)[:, None] * stride_dwn + tl.arange(0, BLOCK_K)[None, :]),
                 acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


@kernel
@triton.jit
def _grouped_wgrad_kernel(dy_ptr, x_ptr, dw_ptr, db_ptr, sizes_ptr, M, N, K, G,
                          stride_dym, stride_xm, stride_dwg, stride_dwn,
                          HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, K_RUN: tl.constexpr):
    """The weight (and bias) gradient: :func:`_wgrad_tile` per program."""
    _wgrad_tile(tl.program_id(0), dy_ptr, x_ptr, dw_ptr, db_ptr, sizes_ptr, M, N, K, G,
                stride_dym, stride_xm, stride_dwg, stride_dwn, HAS_BIAS, PRECISION, UPCAST,
                BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_G, K_RUN)


@kernel
@triton.jit
def _grouped_backward_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, db_ptr, sizes_ptr,
                             M, N, K, G, stride_dym, stride_xm, stride_wg, stride_wn,
                             stride_wk, stride_dxm, stride_dwg, stride_dwn,
                             HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                             UPCAST: tl.constexpr, DX_BLOCK_M: tl.constexpr,
                             DX_BLOCK_N: tl.constexpr, DX_BLOCK_K: tl.constexpr,
                             DW_BLOCK_M: tl.constexpr, DW_BLOCK_N: tl.constexpr,
                             DW_BLOCK_K: tl.constexpr, DW_K_RUN: tl.constexpr,
                             BLOCK_G: tl.constexpr, DX_PROGRAMS: tl.constexpr):
    """The whole backward in one launch: programs below ``DX_PROGRAMS`` compute
    ``dx = dy @ W_g`` per group (persistent, tail rows zero), the others one weight (and
    bias) gradient program each. Small problems are bound by launches, not by the GPU."""
    pid = tl.program_id(0)
    if pid < DX_PROGRAMS:
        _mm_tiles(pid, dy_ptr, w_ptr, dy_ptr, dx_ptr, sizes_ptr, M, K, N, G,
                  stride_dym, stride_wg, stride_wn, stride_wk, stride_dxm, 0, False, PRECISION,
                  UPCAST, DX_BLOCK_M, DX_BLOCK_N, DX_BLOCK_K, BLOCK_G, DX_PROGRAMS)
    else:
        _wgrad_tile(pid - DX_PROGRAMS, dy_ptr, x_ptr, dw_ptr, db_ptr, sizes_ptr, M, N, K, G,
                    stride_dym, stride_xm, stride_dwg, stride_dwn, HAS_BIAS, PRECISION,
                    UPCAST, DW_BLOCK_M, DW_BLOCK_N, DW_BLOCK_K, BLOCK_G, DW_K_RUN)


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _upcast(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype != torch.float32


def _stored(like: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel stores a ``dtype`` result in: the CPU interpreter truncates
    float32 -> bfloat16 stores, so there the kernels store float32 and torch rounds."""
    return torch.float32 if like.is_cpu and dtype == torch.bfloat16 else dtype


def _block_g(num_groups: int) -> int:
    return next_power_of_2(num_groups + 1)


MAX_GROUPS = 4095


def fits(num_groups: int, in_features: int, out_features: int) -> bool:
    """Whether these kernels take this problem: the group schedule is a vector of
    ``num_groups + 1`` slots, and ends inside one expert's weight are int32."""
    return num_groups <= MAX_GROUPS and in_features * out_features < 2**31


def _rows_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# Launch plans (see :class:`~._triton.LaunchPlan`) of the forward and backward kernels, by a
# key that fixes every integer and constexpr argument and every tensor's dtype and device:
# a training step's small GEMMs then launch without Triton's argument binding.
_PLANS = PlanCache()


def _launch(kernel, grid, args, meta, plan_key: tuple | None) -> None:
    """``kernel[grid](*args, **meta)``; with ``plan_key``, through a launch plan then kept
    under that key for the next calls of the same geometry."""
    if plan_key is None:
        kernel[grid](*args, **meta)
    else:
        _PLANS.keep(plan_key, kernel.launch_planned(grid, args, meta))


def _mm_launch(a, b_tensor, b_strides, bias, sizes, out, reduction):
    """``(grid, args, meta)`` of :func:`_grouped_mm_kernel` writing ``out`` (rows of ``a``
    and ``bias`` with unit column stride, an output with rows and columns)."""
    M, width = out.shape
    G = sizes.shape[0]
    block_m, block_n, block_k = 64, 128, 64
    upper_tiles = (cdiv(M, block_m) + G + 1) * cdiv(width, block_n)
    programs = max(1, min(sm_count(a.device), upper_tiles))
    stride_bg, stride_bk, stride_bn = b_strides
    args = (a, b_tensor, bias if bias is not None else out, out, sizes, M, width, reduction, G,
            a.stride(0), stride_bg, stride_bk, stride_bn, out.stride(0),
            bias.stride(0) if bias is not None else 0)
    meta = dict(HAS_BIAS=bias is not None, PRECISION=_precision(a.dtype), UPCAST=_upcast(a),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=_block_g(G),
                NUM_PROGRAMS=programs, num_warps=4, num_stages=3)
    return (programs,), args, meta


def _launch_mm(a, b_tensor, b_strides, bias, sizes, out, reduction, plan_key=None):
    rows_a, rows_bias = _rows_contiguous(a), _rows_contiguous(bias)
    if rows_a is not a or rows_bias is not bias:
        plan_key = None  # the plan would stand for the copies' strides, not the inputs'
    a, bias = rows_a, rows_bias
    if out.shape[0] == 0 or out.shape[1] == 0:
        return out
    grid, args, meta = _mm_launch(a, b_tensor, b_strides, bias, sizes, out, reduction)
    _launch(_grouped_mm_kernel, grid, args, meta, plan_key)
    return out


def _forward_key(x, weight, bias, sizes) -> tuple:
    return ("forward", x.shape, x.stride(), x.dtype, weight.shape, weight.stride(), weight.dtype,
            sizes.shape, sizes.dtype, x.get_device(), _precision(x.dtype),
            None if bias is None else (bias.stride(), bias.dtype))


def _planned_forward(plan: LaunchPlan, x, weight, bias, sizes) -> torch.Tensor | None:
    """The forward launched from ``plan``, or ``None`` where the plan cannot launch it."""
    out = x.new_empty((x.shape[0], weight.shape[1]), dtype=_stored(x, x.dtype))
    return _in_dtype(out, x.dtype) if plan(x, weight, out if bias is None else bias, out,
                                           sizes) else None


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            sizes: torch.Tensor) -> torch.Tensor:
    """``(M, K) x (G, N, K) -> (M, N)`` with the bias added and tail rows zero."""
    sizes = sizes.contiguous()  # read as a dense vector
    key = _forward_key(x, weight, bias, sizes)
    plan = _PLANS.get(key)
    if plan is not None:
        out = _planned_forward(plan, x, weight, bias, sizes)
        if out is not None:
            return out
    out = x.new_empty((x.shape[0], weight.shape[1]), dtype=_stored(x, x.dtype))
    strides = (weight.stride(0), weight.stride(2), weight.stride(1))
    out = _launch_mm(x, weight, strides, bias, sizes, out, x.shape[1],
                     plan_key=key if plan is None else None)
    return _in_dtype(out, x.dtype)


def dgrad(grad_out: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``(M, N) x (G, N, K) -> (M, K)``: the input gradient, tail rows zero."""
    sizes = sizes.contiguous()
    out = torch.empty(grad_out.shape[0], weight.shape[2], device=grad_out.device,
                      dtype=_stored(grad_out, grad_out.dtype))
    strides = (weight.stride(0), weight.stride(1), weight.stride(2))
    out = _launch_mm(grad_out, weight, strides, None, sizes, out, grad_out.shape[1])
    return _in_dtype(out, grad_out.dtype)


def _wgrad_programs(G: int, N: int, K: int, tile: WgradTile) -> int:
    """Weight-gradient programs: one per (group, N tile, run of ``tile.k_run`` K tiles)."""
    return G * cdiv(N, tile.block_n) * cdiv(cdiv(K, tile.block_k), tile.k_run)


def _wgrad_buffers(x: torch.Tensor, G: int, N: int, K: int, with_bias: bool,
                   out_dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(G, N, K)`` weight gradient and, with ``with_bias``, the ``(G, N)`` bias sums.
    The CPU interpreter truncates float32 -> 16-bit stores: there the sums stay float32
    and torch rounds them (and a bfloat16 weight gradient, see :func:`_stored`)."""
    grad_w = x.new_empty((G, N, K), dtype=_stored(x, out_dtype or x.dtype))
    sums_dtype = torch.float32 if x.is_cpu else x.dtype
    grad_b = x.new_empty((G, N), dtype=sums_dtype) if with_bias else None
    return grad_w, grad_b


def wgrad(grad_out: torch.Tensor, x: torch.Tensor, sizes: torch.Tensor, with_bias: bool,
          out_dtype: torch.dtype | None = None, *, tile: WgradTile | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(G, N, K)`` weight gradient in ``out_dtype`` (default ``x``'s; float32 accumulation
    either way) and, with ``with_bias``, the ``(G, N)`` bias gradient (summed in float32,
    stored in ``x``'s dtype), in one launch; empty groups give zeros. ``tile``: the launch
    shape (default :func:`wgrad_tile`'s)."""
    grad_out, x, sizes = _rows_contiguous(grad_out), _rows_contiguous(x), sizes.contiguous()
    M, N = grad_out.shape
    K = x.shape[1]
    G = sizes.shape[0]
    grad_w, grad_b = _wgrad_buffers(x, G, N, K, with_bias, out_dtype)
    if N == 0 or K == 0:
        # Nothing to multiply; the bias sums still cover each group's (clamped) rows.
        if grad_b is not None:
            grad_b = bias_grad_reference(grad_out, group_ends(sizes, M), x.dtype)
        return _in_dtype(grad_w.zero_(), out_dtype or x.dtype), grad_b
    tile = tile or wgrad_tile(M, G)
    grid = (_wgrad_programs(G, N, K, tile),)
    _grouped_wgrad_kernel[grid](
        grad_out, x, grad_w, grad_b if grad_b is not None else grad_w, sizes, M, N, K, G,
        grad_out.stride(0), x.stride(0), grad_w.stride(0), grad_w.stride(1),
        HAS_BIAS=with_bias, PRECISION=_precision(x.dtype), UPCAST=_upcast(x),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, BLOCK_G=_block_g(G),
        K_RUN=tile.k_run, num_warps=tile.warps, num_stages=tile.stages,
    )
    return _in_dtype(grad_w, out_dtype or x.dtype), _in_dtype(grad_b, x.dtype)


def _backward_key(grad_out, x, weight, sizes, with_bias, tile) -> tuple:
    return ("backward", grad_out.shape, grad_out.stride(), grad_out.dtype, x.shape, x.stride(),
            x.dtype, weight.shape, weight.stride(), weight.dtype, sizes.shape, sizes.dtype,
            x.get_device(), _precision(x.dtype), with_bias, tile)


def _planned_backward(plan: LaunchPlan, grad_out, x, weight, sizes, with_bias):
    """:func:`backward` launched from ``plan``, or ``None`` where the plan cannot launch it."""
    M, N = grad_out.shape
    K = x.shape[1]
    grad_x = grad_out.new_empty((M, K), dtype=_stored(x, grad_out.dtype))
    grad_w, grad_b = _wgrad_buffers(x, sizes.shape[0], N, K, with_bias)
    if plan(grad_out, x, weight, grad_x, grad_w, grad_w if grad_b is None else grad_b, sizes):
        return (_in_dtype(grad_x, grad_out.dtype), _in_dtype(grad_w, x.dtype),
                _in_dtype(grad_b, x.dtype))
    return None


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, sizes: torch.Tensor,
             with_bias: bool, *, one_launch: bool | None = None,
             tile: WgradTile | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`dgrad` and :func:`wgrad`: ``(grad_x (M, K), grad_w (G, N, K), grad_b (G, N) or
    None)``, in one launch where the weight gradient has at most
    :data:`ONE_LAUNCH_MAX_WEIGHTS` weights (``one_launch`` decides when given), else as the
    two calls; the same values either way. ``tile``: the weight gradient's launch shape."""
    G, N, K = weight.shape
    if not (one_launch if one_launch is not None else G * N * K <= ONE_LAUNCH_MAX_WEIGHTS):
        return (dgrad(grad_out, weight, sizes), *wgrad(grad_out, x, sizes, with_bias,
                                                       tile=tile))
    tile = tile or ONE_LAUNCH_TILE
    sizes = sizes.contiguous()
    key = _backward_key(grad_out, x, weight, sizes, with_bias, tile)
    plan = _PLANS.get(key)
    if plan is not None:
        grads = _planned_backward(plan, grad_out, x, weight, sizes, with_bias)
        if grads is not None:
            return grads
    rows_grad, rows_x = _rows_contiguous(grad_out), _rows_contiguous(x)
    if rows_grad is not grad_out or rows_x is not x:
        key = None  # the plan would stand for the copies' strides, not the inputs'
    grad_out, x = rows_grad, rows_x
    M = grad_out.shape[0]
    if M == 0 or N == 0 or K == 0:
        return (dgrad(grad_out, weight, sizes), *wgrad(grad_out, x, sizes, with_bias))
    grad_x = grad_out.new_empty((M, K), dtype=_stored(x, grad_out.dtype))
    grad_w, grad_b = _wgrad_buffers(x, G, N, K, with_bias)
    dx_programs = sm_count(x.device)  # fixed: one binary whatever M is
    grid = (dx_programs + _wgrad_programs(G, N, K, tile),)
    args = (grad_out, x, weight, grad_x, grad_w, grad_b if grad_b is not None else grad_w, sizes,
            M, N, K, G, grad_out.stride(0), x.stride(0), weight.stride(0), weight.stride(1),
            weight.stride(2), grad_x.stride(0), grad_w.stride(0), grad_w.stride(1))
    meta = dict(HAS_BIAS=with_bias, PRECISION=_precision(x.dtype), UPCAST=_upcast(x),
                DX_BLOCK_M=64, DX_BLOCK_N=128, DX_BLOCK_K=64, DW_BLOCK_M=tile.block_m,
                DW_BLOCK_N=tile.block_n, DW_BLOCK_K=tile.block_k, DW_K_RUN=tile.k_run,
                BLOCK_G=_block_g(G),
                DX_PROGRAMS=dx_programs, num_warps=tile.warps, num_stages=tile.stages)
    _launch(_grouped_backward_kernel, grid, args, meta, key if plan is None else None)
    return (_in_dtype(grad_x, grad_out.dtype), _in_dtype(grad_w, x.dtype),
            _in_dtype(grad_b, x.dtype))


class LinearLaunches:
    """:func:`forward` and :func:`backward` for a caller that keeps one of these per geometry.

    :func:`forward` and :func:`backward` find their launch plans under keys of every shape,
    stride and dtype involved (11 and 15 items, built at each call). A caller whose own
    cache already tells geometries apart (the layer's fast path: one object per shape,
    stride, dtype and device of ``x``, ``weight``, ``bias`` and ``sizes``) calls these
    methods instead: each finds its plan once, through the keyed function, and then
    launches from it; the backward also checks the gradient's strides and dtype, which the
    caller's key cannot know. Each launch still falls back to the keyed function where the
    plan cannot launch (another current device, an unaligned tensor, launch hooks), and
    float32 always takes it (its precision follows ``allow_tf32``, a global setting).
    """

    __slots__ = ("_forward", "_backward")

    def __init__(self) -> None:
        self._forward = None  # a LaunchPlan, False (none to be had) or None (not looked up)
        self._backward = {}  # with_bias -> (plan, grad_out strides, grad_out dtype) or ()

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                sizes: torch.Tensor) -> torch.Tensor:
        """:func:`forward`."""
        sizes = sizes.contiguous()
        plan = self._forward
        if plan:
            out = _planned_forward(plan, x, weight, bias, sizes)
            if out is not None:
                return out
        out = forward(x, weight, bias, sizes)
        if plan is None and x.dtype != torch.float32:
            self._forward = _PLANS.get(_forward_key(x, weight, bias, sizes)) or False
        return out

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 sizes: torch.Tensor, with_bias: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:func:`backward`, for the ``x``, ``weight`` and ``sizes`` of :meth:`forward`."""
        sizes = sizes.contiguous()
        entry = self._backward.get(with_bias)
        if entry and grad_out.stride() == entry[1] and grad_out.dtype == entry[2]:
            grads = _planned_backward(entry[0], grad_out, x, weight, sizes, with_bias)
            if grads is not None:
                return grads
        grads = backward(grad_out, x, weight, sizes, with_bias)
        if entry is None and x.dtype != torch.float32:
            plan = _PLANS.get(_backward_key(grad_out, x, weight, sizes, with_bias, ONE_LAUNCH_TILE))
            self._backward[with_bias] = (plan, grad_out.stride(), grad_out.dtype) if plan else ()
        return grads


def _in_dtype(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)
