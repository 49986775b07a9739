"""The GPU kernels compile for Hopper (sm90), here, without a GPU.

Triton compiles ahead of time for a target it is given: each case builds a kernel with
the pointer dtypes and launch constants its wrapper uses on CUDA (FP8 data, no
interpreter upcasts, every pointer and integer argument a multiple of 16 as on aligned
shapes); the GEMMs must lower their dots to Hopper's warp-group MMA, and those in
``PIPELINED`` must load their main loop's tiles asynchronously (a loop that Triton does not
pipeline runs at a fraction of the tensor cores' speed) into shared buffers that outlast
the copies in flight while the asynchronous MMAs read them (else a later step's copy
overwrites a tile still being read: a race). Compile errors that only a GPU run would
otherwise reveal fail here, in CI. The compiling runs in a child process without
``TRITON_INTERPRET`` (under the interpreter the kernels are not compilable objects);
``python -m tests.kernels.test_compiles_for_sm90`` prints one line per case.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from grouped_linear.kernels import activation as act
from grouped_linear.kernels._gluon import HAS_GLUON
from grouped_linear.kernels._triton import HAS_TRITON
from grouped_linear.kernels.gemm import fp8_fused_gemm as ff
from grouped_linear.kernels.gemm import fp8_gluon_gemm as gg
from grouped_linear.kernels.gemm import fp8_gluon_wgrad as gw
from grouped_linear.kernels.gemm import fp8_triton_gemm as fg
from grouped_linear.kernels.gemm import gluon_gemm as bg
from grouped_linear.kernels.gemm import gluon_wgrad as bwg
from grouped_linear.kernels.gemm import triton_gemm as tg
from grouped_linear.kernels.quantize import blocks as qb
from grouped_linear.kernels.quantize import blocks_gluon as qbg
from grouped_linear.kernels.quantize import folded as qf
from grouped_linear.kernels.quantize import groups as qg
from grouped_linear.kernels.quantize import rows as q
from grouped_linear.kernels.quantize import transpose as tp
from grouped_linear.kernels.quantize import transposed as qt
from grouped_linear.kernels.quantize import transposed_gluon as qtg
from grouped_linear.kernels.routing import capacity, combine
from grouped_linear.kernels.routing import routing_map as routing
from grouped_linear.kernels.routing import rows as layout

if HAS_TRITON:
    import triton
    from triton.backends import backends

    from tests.kernels.sm90 import TARGET, compile_triton, overwritten_buffers, ptxas_notes

pytestmark = pytest.mark.skipif(not HAS_TRITON or "nvidia" not in backends,
                                reason="needs Triton's NVIDIA backend")
MMA = "warp_group_dot"
ASYNC_LOAD = "async_copy_global_to_local"

F8 = "*fp8e4nv"
SM90_SHARED_BYTES = 227 * 1024  # the most one block may allocate on sm90
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _mm_case(reduction_contiguous):
    constants = {"UPCAST": False, "BLOCK_M": 128, "BLOCK_N": fg.BLOCK,
                 "BLOCK_K": fg.MM_BLOCK_K, "BLOCK_G": 16, "NUM_PROGRAMS": 132,
                 "SCALE_BLOCK": fg.BLOCK, "EVEN_K": True}
    if reduction_contiguous:
        constants["stride_br"] = 1
    return (fg._fp8_grouped_mm_kernel,
            {"a_ptr": F8, "b_ptr": F8, "out_ptr": "*bf16", "sizes_ptr": "*i64"}, constants, 8)


def _wgrad_case(tile, block_g: int):
    """The bf16 weight gradient at one of its launch shapes (bias gradient included)."""
    constants = {"HAS_BIAS": True, "PRECISION": "tf32", "UPCAST": False, "BLOCK_G": block_g,
                 **{k.upper(): getattr(tile, k) for k in ("block_m", "block_n", "block_k", "k_run")}}
    return (tg._grouped_wgrad_kernel, {"dy_ptr": "*bf16", "x_ptr": "*bf16", "dw_ptr": "*bf16",
                                       "sizes_ptr": "*i64"}, constants, tile.warps, tile.stages)


# The launch constants the tiled transposed quantization shares across its modes.
TILED_TRANSPOSE = {"FP8_MAX": FP8_MAX, "POW2": False, "ALIGN": 16, "DST_MULTIPLE": 16,
                   "BLOCK_R": qt.TILED_CONFIG.block_r, "BLOCK_C": qt.TILED_CONFIG.block_c,
                   "BLOCK_S": 16, "PIECES": False, "SHIFT_MULTIPLE": 1}

CASES = {
    "fp8 mm blockwise": _mm_case(True),
    "fp8 mm blockwise, reduction strided": _mm_case(False),
    "fp8 blockwise wgrad": (fg._fp8_blockwise_wgrad_kernel,
                            {"dy_ptr": F8, "x_ptr": F8, "dw_ptr": "*bf16", "sizes_ptr": "*i64"},
                            {"UPCAST": False, "GROUP_SCALES": False,
                             "BLOCK_T": fg.WGRAD_CONFIG[2], "BLOCK_N": fg.WGRAD_CONFIG[3],
                             "BLOCK_K": fg.WGRAD_CONFIG[4], "BLOCK_G": 16,
                             "SCALE_BLOCK": fg.BLOCK}, fg.WGRAD_CONFIG[0]),
    "fp8 group-scaled wgrad": (fg._fp8_blockwise_wgrad_kernel,
                               {"dy_ptr": F8, "x_ptr": F8, "dw_ptr": "*bf16", "sizes_ptr": "*i64"},
                               {"UPCAST": False, "GROUP_SCALES": True,
                                "BLOCK_T": fg.GROUP_SCALED_WGRAD_CONFIG[2],
                                "BLOCK_N": fg.GROUP_SCALED_WGRAD_CONFIG[3],
                                "BLOCK_K": fg.GROUP_SCALED_WGRAD_CONFIG[4],
                                "BLOCK_G": 256, "SCALE_BLOCK": fg.BLOCK},
                               fg.GROUP_SCALED_WGRAD_CONFIG[0]),
    **{f"fp8 fused {gemm}, {recipe}": (
        kernel, {"x_ptr": "*bf16", "dy_ptr": "*bf16", "w_ptr": F8, "bias_ptr": "*bf16",
                 "out_ptr": "*bf16", "dx_ptr": "*bf16", "dw_ptr": "*bf16", "sizes_ptr": "*i64"},
        {"BLOCKWISE": recipe == "blockwise", "POW2": False, "UPCAST": False,
         "FP8_MAX": FP8_MAX, "MANT": 3, "MIN_EXP": -6, "BLOCK_G": 16, **extra},
        ff._WARPS[recipe == "blockwise"])
        for recipe in ("rowwise", "tensorwise", "blockwise")
        for gemm, kernel, extra in (
            ("forward", ff._forward_kernel,
             {"HAS_BIAS": True, "SAVE_SCALE": recipe != "blockwise",
              "GROUP_SCALES": recipe == "tensorwise", "BLOCK_M": 64, "BLOCK_N": 128,
              "BLOCK_K": 128 if recipe == "blockwise" else 64, "NUM_PROGRAMS": 132}),
            ("dgrad", ff._dgrad_kernel,
             {"GROUP_SCALES": recipe == "tensorwise", "BLOCK_M": 64, "BLOCK_K": 128,
              "BLOCK_R": 128 if recipe == "blockwise" else 64, "NUM_PROGRAMS": 132}),
            ("wgrad", ff._wgrad_kernel,
             {"HAS_BIAS": True, "GRAD_FP8_MAX": 57344.0, "GRAD_MANT": 2, "GRAD_MIN_EXP": -14,
              "BLOCK_M": 128 if recipe == "blockwise" else 64, "BLOCK_N": 64, "BLOCK_K": 64}))
        if not (gemm == "wgrad" and recipe == "tensorwise")},  # the rowwise kernel
    "bf16 mm": (tg._grouped_mm_kernel,
                {"a_ptr": "*bf16", "b_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                 "sizes_ptr": "*i64"},
                {"HAS_BIAS": True, "PRECISION": "tf32", "UPCAST": False, "BLOCK_M": 64, "BLOCK_N": 128,
                 "BLOCK_K": 64, "BLOCK_G": 16, "NUM_PROGRAMS": 132, "stride_bk": 1}, 4),
    "bf16 wgrad": _wgrad_case(tg.WGRAD_TILE, 16),
    "bf16 wgrad, 512-slot group table": _wgrad_case(tg.WGRAD_TILE, 512),
    "bf16 wgrad, small groups": _wgrad_case(tg.SMALL_GROUPS_TILE, 16),
    "bf16 backward": (
        tg._grouped_backward_kernel,
        {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "dx_ptr": "*bf16",
         "dw_ptr": "*bf16", "sizes_ptr": "*i64"},
        {"HAS_BIAS": True, "PRECISION": "tf32", "UPCAST": False, "DX_BLOCK_M": 64,
         "DX_BLOCK_N": 128, "DX_BLOCK_K": 64, "DW_BLOCK_M": tg.ONE_LAUNCH_TILE.block_m,
         "DW_BLOCK_N": tg.ONE_LAUNCH_TILE.block_n, "DW_BLOCK_K": tg.ONE_LAUNCH_TILE.block_k,
         "DW_K_RUN": tg.ONE_LAUNCH_TILE.k_run, "BLOCK_G": 16, "DX_PROGRAMS": 132, "stride_wk": 1},
        tg.ONE_LAUNCH_TILE.warps, tg.ONE_LAUNCH_TILE.stages),
    "rows": (q._quantize_rows_kernel, {"t_ptr": "*bf16", "q_ptr": F8},
             {"FP8_MAX": FP8_MAX, "POW2": False, "GIVEN_SCALE": False, "PIECES": False,
              "GROUPS": "none", "GROUP_ROWS": 1,
              "SHIFT_MULTIPLE": 1, "BLOCK_R": q.ROWS_CONFIG[0], "BLOCK_C": q.ROWS_CONFIG[1],
              "BLOCK_S": 2}, q.ROWS_CONFIG[2]),
    "rows, scale per group": (q._quantize_rows_kernel,
                              {"t_ptr": "*bf16", "q_ptr": F8, "ends_ptr": "*i32"},
                              {"FP8_MAX": FP8_MAX, "POW2": False, "GIVEN_SCALE": True,
                               "PIECES": False, "GROUPS": "ends", "GROUP_ROWS": 1,
                               "SHIFT_MULTIPLE": 1, "BLOCK_R": q.ROWS_CONFIG[0],
                               "BLOCK_C": q.ROWS_CONFIG[1], "BLOCK_S": 16}, q.ROWS_CONFIG[2]),
    "weight rows, scale per expert": (q._quantize_rows_kernel, {"t_ptr": "*bf16", "q_ptr": F8},
                                      {"FP8_MAX": FP8_MAX, "POW2": False, "GIVEN_SCALE": True,
                                       "PIECES": False, "GROUPS": "uniform", "GROUP_ROWS": 4096,
                                       "SHIFT_MULTIPLE": 1, "BLOCK_R": q.ROWS_CONFIG[0],
                                       "BLOCK_C": q.ROWS_CONFIG[1], "BLOCK_S": 2},
                                      q.ROWS_CONFIG[2]),
    "group amax": (qg._group_amax_kernel, {"t_ptr": "*bf16", "ends_ptr": "*i32"},
                   {"GROUP_ROWS": 0, "BLOCK_R": qg.AMAX_CONFIG[0], "BLOCK_C": qg.AMAX_CONFIG[1],
                    "BLOCK_G": 16}, qg.AMAX_CONFIG[2]),
    "scales from maxima": (qg._scales_kernel, {},
                           {"FP8_MAX": FP8_MAX, "POW2": True, "BLOCK": 16, "BLOCK_W": 256}, 4),
    "rows folded": (qf._quantize_rows_folded_kernel,
                    {"t_ptr": "*bf16", "q_ptr": F8, "ends_ptr": "*i32"},
                    {"FP8_MAX": FP8_MAX, "POW2": False, "ROWS": qf.FOLDED_CONFIG[0],
                     "BLOCK_C": 4096, "BLOCK_G": 16}, 4096 // qf.FOLDED_CONFIG[1]),
    "rows folded, wide": (qf._quantize_rows_folded_kernel,
                          {"t_ptr": "*bf16", "q_ptr": F8, "ends_ptr": "*i32"},
                          {"FP8_MAX": FP8_MAX, "POW2": False, "ROWS": qf.FOLDED_CONFIG[0],
                           "BLOCK_C": qf.WIDE_BLOCK_C, "BLOCK_G": 16, "WIDE": True},
                          qf.WIDE_BLOCK_C // qf.FOLDED_CONFIG[1]),
    "columns scaled": (qf._scale_columns_kernel, {"t_ptr": "*bf16", "q_ptr": F8},
                       {"FP8_MAX": FP8_MAX, "BLOCK_R": qf.SCALE_COLUMNS_CONFIG[0],
                        "BLOCK_C": qf.SCALE_COLUMNS_CONFIG[1]}, qf.SCALE_COLUMNS_CONFIG[2]),
    "byte transpose": (tp._transpose_kernel, {"src_ptr": "*u8", "dst_ptr": "*u8"},
                      {"BLOCK_R": tp.TRANSPOSE_CONFIG[0], "BLOCK_C": tp.TRANSPOSE_CONFIG[1]},
                      tp.TRANSPOSE_CONFIG[2]),
    "rows of pieces": (q._quantize_rows_kernel,
                       {"t_ptr": "*bf16", "q_ptr": F8, "shifts_ptr": "*i64", "ends_ptr": "*i32"},
                       {"FP8_MAX": FP8_MAX, "POW2": False, "GIVEN_SCALE": False, "PIECES": True,
                        "GROUPS": "ends", "GROUP_ROWS": 1, "SHIFT_MULTIPLE": 8, "BLOCK_R": q.ROWS_CONFIG[0],
                        "BLOCK_C": q.ROWS_CONFIG[1], "BLOCK_S": 16}, q.ROWS_CONFIG[2]),
    "column amax (tiled)": (qt._group_column_amax_kernel, {"t_ptr": "*bf16", "ends_ptr": "*i32"},
                            {"BLOCK_R": qt.TILED_CONFIG.block_r, "BLOCK_C": qt.TILED_CONFIG.block_c,
                             "BLOCK_S": 16, "SUB_TILES": qt.TILED_CONFIG.amax_sub_tiles,
                             "SUMS": True, "PIECES": False, "SHIFT_MULTIPLE": 1},
                            qt.TILED_CONFIG.warps),
    "group column sums": (qt._reduce_group_sums_kernel, {"ends_ptr": "*i32"},
                          {"ROWS_PER_TILE": 512, "BLOCK_C": 256, "BLOCK_S": 16}, 4),
    "columns transposed (tiled)": (qt._quantize_columns_t_tiled_kernel,
                                   {"t_ptr": "*bf16", "ends_ptr": "*i32",
                                    "dst_ends_ptr": "*i32", "q_ptr": F8},
                                   {**TILED_TRANSPOSE, "SCALING": "amax", "FACTORS": True},
                                   qt.TILED_CONFIG.warps),
    "codes transposed (tiled)": (qt._quantize_columns_t_tiled_kernel,
                                 {"t_ptr": F8, "ends_ptr": "*i32", "dst_ends_ptr": "*i32",
                                  "q_ptr": F8},
                                 {**TILED_TRANSPOSE, "SCALING": "unit", "FACTORS": False},
                                 qt.TILED_CONFIG.warps),
    "row tiles": (qb._quantize_row_tiles_kernel, {"t_ptr": "*bf16", "q_ptr": F8},
                  {"FP8_MAX": FP8_MAX, "POW2": False, "TILE": 128, "BLOCK_R": 32, "BLOCK_T": 128}, 4),
    "weight blocks": (qb._quantize_weight_blocks_kernel, {"w_ptr": "*bf16", "q_ptr": F8},
                      {"FP8_MAX": FP8_MAX, "POW2": False, "BLOCK": 128, "BLOCK_P": 128}, 8),
    "token blocks": (qb._quantize_token_blocks_kernel,
                     {"t_ptr": "*bf16", "sizes_ptr": "*i64", "q_ptr": F8},
                     {"FP8_MAX": FP8_MAX, "POW2": False, "TILE": 128, "BLOCK_T": 128, "BLOCK_C": 64,
                      "BLOCK_G": 16, "BLOCK_LAYOUT": True, "stride_qm": 1, "stride_tc": 1}, 4),
    **{f"scatter rows{', zeros from group sizes' if gaps else ''}{', sparse slots' * sparse}": (
        layout._scatter_rows_kernel,
        {"src_ptr": "*bf16", "dst_ptr": "*bf16", "map_ptr": "*i64", "token_ptr": "*i64",
         "splits_ptr": "*i64", "counts_ptr": "*i64"},
        {"HAS_WEIGHTS": not gaps, "SLOTS": not gaps, "GAPS": gaps,
         "BLOCK_T": layout.SCATTER_CONFIG[0], "BLOCK_H": layout.SCATTER_CONFIG[1],
         "BLOCK_E": 128 if gaps else 1, "ZERO_ROWS": layout.ZERO_ROWS,
         "PDL": True, "SPARSE": sparse, "K_CHUNK": 32 if sparse else 1}, 4)
        for gaps in (False, True) for sparse in (False, True)},
    **{f"routing phase {phase}, {experts} experts{', bool map' * is_map}": (
        routing._routing_kernel, {"topk_ptr": "*u8" if is_map else "*i64", "row_map_ptr": "*i64",
                                  "token_ptr": "*i64", "splits_ptr": "*i64",
                                  "counts_ptr": "*i64", "work_ptr": "*i32"},
        {"PHASE": phase, "BLOCK": 1024, "RANK_BLOCK": 1024 if experts <= 32 else 32,
         "ONE_HOT": experts <= 32, "BLOCK_E": experts, "BLOCK_P": 64 if experts <= 32 else 32,
         "PDL": True, "MAP": is_map, "MAP_TOKENS": 8192 // experts},
        8 if experts <= 32 else 4)
        for phase in (0, 1, 2) for experts in (8, 256) for is_map in (False, True)},
    **{f"slot dots{' of FP8 rows' if fp8 else ''}": (
        combine._slot_dots_kernel,
        {"src_ptr": F8 if fp8 else "*bf16", "grad_ptr": "*bf16", "map_ptr": "*i64"},
        {"HAS_FACTORS": fp8, "BLOCK_T": combine.SLOT_DOTS_CONFIG[0], "BLOCK_K": 8,
         "BLOCK_H": combine.FP8_TILE if fp8 else combine.SLOT_DOTS_CONFIG[1]},
        combine.SLOT_DOTS_CONFIG[2]) for fp8 in (False, True)},
    **{f"combine rows{', keeping FP8 rows' if keep else ''}{', sparse slots' * sparse}": (
        combine._combine_rows_kernel,
        {"src_ptr": "*bf16", "dst_ptr": "*bf16", "map_ptr": "*i64", "codes_ptr": F8},
        {"HAS_WEIGHTS": True, "KEEP": keep, "FP8_MAX": FP8_MAX, "TILE": combine.FP8_TILE,
         "BLOCK_T": combine.COMBINE_CONFIG[0], "BLOCK_H": combine.COMBINE_CONFIG[1],
         "SPARSE": sparse, "K_CHUNK": 32 if sparse else 1},
        combine.COMBINE_CONFIG[2]) for keep in (False, True) for sparse in (False, True)},
    "slot map": (layout._slot_of_row_kernel, {"map_ptr": "*i64", "slot_ptr": "*i64"},
                 {"BLOCK": 1024}, 4),
    "drop over capacity": (capacity._drop_kernel,
                           {"priority_ptr": "*fp32", "slot_ptr": "*i64", "counts_ptr": "*i64",
                            "keys_ptr": "*i64", "out_ptr": "*i64"},
                           {"BLOCK": capacity._BLOCK, "BLOCK_E": 64}, 8),
    # "weighted": float32 routing probabilities per row (Megatron-Core's), and in backward
    # their gradient's partial sums.
    **{f"bias activation, {'weighted ' if probs else ''}{order} {way}": (
        act._bias_act_kernel, {p: "*bf16" for p in ("h_ptr", "bias_ptr", "grad_a_ptr", "out_ptr")}
        | {"ends_ptr": "*i32", "probs_ptr": "*fp32", "partials_ptr": "*fp32"},
        {"HAS_BIAS": True, "GATED": True, "INTERLEAVED": order == "interleaved",
         "ACT": act.ACTIVATION_KINDS["gpt_oss_swiglu"], "BACKWARD": way == "backward",
         "HAS_PROBS": probs, "PROBS_GRAD": probs and way == "backward",
         **dict(zip(("BLOCK_M", "BLOCK_N"), act.ACT_CONFIG[:2])), "BLOCK_G": 32},
        act.ACT_CONFIG[2]) for probs in (False, True) for order in ("interleaved", "concatenated")
       for way in ("forward", "backward")},
    **{f"bias activation, FP8 rows, {order}": (
        act._bias_act_fp8_kernel, {"h_ptr": "*bf16", "bias_ptr": "*bf16", "ends_ptr": "*i32",
                                   "probs_ptr": "*fp32", "q_ptr": F8, "inv_ptr": "*fp32"},
        {"FP8_MAX": FP8_MAX, "POW2": False, "HAS_BIAS": True, "GATED": True,
         "INTERLEAVED": order == "interleaved", "ACT": act.ACTIVATION_KINDS["swiglu"],
         "HAS_PROBS": True, **dict(zip(("BLOCK_M", "BLOCK_N"), act.ACT_FP8_CONFIG[:2])),
         "BLOCK_G": 32},
        act.ACT_FP8_CONFIG[2]) for order in ("interleaved", "concatenated")},
    "gather rows": (layout._gather_rows_kernel,
                       {"src_ptr": "*bf16", "dst_ptr": "*bf16", "index_ptr": "*i64"},
                       {"HAS_SCALE": True, "BLOCK_R": 16, "BLOCK_H": 256}, 4),
}

PIPELINED = {"fp8 mm blockwise", "fp8 blockwise wgrad", "fp8 group-scaled wgrad",
             "bf16 mm", "bf16 wgrad", "bf16 wgrad, 512-slot group table", "bf16 backward"} | {
                 name for name in CASES if name.startswith("fp8 fused")}
# Kernels whose launch shape was chosen so that ptxas keeps every value in registers.
NO_SPILLS = {name for name in CASES if name.startswith(("fp8 fused", "bf16 "))}
# Streaming kernels whose bf16 loads must stay 16-byte vectors (one read at copy speed).
VECTOR_LOADS = {"rows", "rows of pieces", "columns scaled", "rows, scale per group", "group amax",
                "bias activation, interleaved forward", "bias activation, interleaved backward",
                "bias activation, concatenated forward",
                "bias activation, concatenated backward",
                "bias activation, FP8 rows, concatenated"} | {
    f"bias activation, weighted {order} {way}" for order in ("interleaved", "concatenated")
    for way in ("forward", "backward")}


def _compile_gluon(kernel, pointers, constants, num_warps, maxnreg=None):
    """A Gluon kernel: its ``*_desc`` arguments are TMA descriptors of 128 x 128 FP8 tiles,
    ``*_inv_desc`` ones of 128-float rows of factors, ``t_desc`` of 128 x 128 bf16 tiles
    (FP8 ones where the case names it ``"fp8"``)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = getattr(kernel, "jit_fn", kernel)  # the JIT function under the launch wrapper
    layout = gl.NVMMASharedLayout.get_default_for([gg.BLOCK, gg.BLOCK], gl.float8e4nv)
    descriptor = f"tensordesc<fp8e4nv[{gg.BLOCK}, {gg.BLOCK}],{layout!r}>"
    factors = f"tensordesc<fp32[1, {gg.BLOCK}],{gw._factor_layout()!r}>"  # *_inv_desc
    bf16_tile = f"tensordesc<bf16[{qbg.TILE}, {qbg.TILE}],{qbg._tile_layout()!r}>"  # t_desc
    constants = {**constants, "num_warps": num_warps}
    signature = {}
    for param in kernel.params:
        if param.is_constexpr or param.name in constants:
            signature[param.name] = "constexpr"
        elif param.name in pointers:  # a pointer or a descriptor given by the case
            signature[param.name] = descriptor if pointers[param.name] == "fp8" \
                else pointers[param.name]
        elif param.name.endswith("_inv_desc"):
            signature[param.name] = factors
        elif param.name == "t_desc":
            signature[param.name] = bf16_tile
        elif param.name.endswith("_desc"):
            signature[param.name] = descriptor
        elif param.name.endswith("_ptr"):
            signature[param.name] = pointers.get(param.name, "*fp32")
        else:
            signature[param.name] = "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, param in enumerate(kernel.params)
               if signature[param.name] != "constexpr"
               and not signature[param.name].startswith("tensordesc")}
    source = GluonASTSource(kernel, signature, constants, aligned)
    options = {"num_warps": num_warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=TARGET, options=options)


def _bf16_descriptor(rows: int, cols: int, dtype: str = "bf16") -> str:
    from triton.experimental.gluon import language as gl

    gl_dtype = {"bf16": gl.bfloat16, "fp32": gl.float32, "fp8e4nv": gl.float8e4nv}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)
    return f"tensordesc<{dtype}[{rows}, {cols}],{layout!r}>"


def _bf16_mm_case(transposed: bool):
    """The bf16 grouped GEMM at its default launch shape (forward with bias, or dgrad)."""
    if not (HAS_TRITON and HAS_GLUON):
        return None, {}, {}, 4, None
    config = bg.MM_CONFIG
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    pointers = {"a_desc": _bf16_descriptor(bm, bk),
                "b_desc": _bf16_descriptor(*((bk, bn) if transposed else (bn, bk))),
                "out_desc": _bf16_descriptor(bm, bn), "bias_ptr": "*bf16", "out_ptr": "*bf16",
                "ends_ptr": "*i32"}
    constants = {"HAS_BIAS": not transposed, "TRANSPOSED": transposed, "SCALED": False,
                 "TMA_STORE": config.tma_store, "GROUP_M": config.group_m, "BLOCK_G": 32,
                 "NUM_PROGRAMS": 132, "STAGES": config.stages}
    return bg._mm_kernel, pointers, constants, config.warps, None


def _fp8_rowwise_mm_case():
    """The same kernel on FP8 tiles with the row and column factors and the bias (the
    rowwise GEMM's forward)."""
    if not (HAS_TRITON and HAS_GLUON):
        return None, {}, {}, 4, None
    config = gg.ROWWISE_CONFIG
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    pointers = {"a_desc": _bf16_descriptor(bm, bk, "fp8e4nv"),
                "b_desc": _bf16_descriptor(bn, bk, "fp8e4nv"),
                "out_desc": _bf16_descriptor(bm, bn), "bias_ptr": "*bf16", "out_ptr": "*bf16",
                "ends_ptr": "*i32"}
    constants = {"HAS_BIAS": True, "TRANSPOSED": False, "SCALED": True,
                 "TMA_STORE": config.tma_store, "GROUP_M": config.group_m, "BLOCK_G": 32,
                 "NUM_PROGRAMS": 132, "STAGES": config.stages}
    return bg._mm_kernel, pointers, constants, config.warps, None


def _bf16_wgrad_case(out: str = "bf16"):
    """The bf16 weight gradient with the bias sums (stored in bf16, as the layer's bias
    takes them), at its launch shape for a bf16 or float32 (``main_grad``) output."""
    if not (HAS_TRITON and HAS_GLUON):
        return None, {}, {}, 4, None
    config = bwg.WGRAD_CONFIG
    bn, bk, bt = config.block_n, config.block_k, config.block_t
    pointers = {"dy_desc": _bf16_descriptor(bt, bn), "x_desc": _bf16_descriptor(bt, bk),
                "out_desc": _bf16_descriptor(bn, bk, out), "out_ptr": f"*{out}",
                "bias_grad_ptr": "*bf16", "ends_ptr": "*i32"}
    constants = {"HAS_BIAS": True, "BAND_N": config.band_n, "NUM_PROGRAMS": 132,
                 "STAGES": config.stages, "TMA_STORE": out == "bf16"}
    return bwg._wgrad_kernel, pointers, constants, config.warps, None


# Gluon kernels: each block's MMA must stay in flight while the next is issued or the
# previous block's partial product is rescaled (``wgmma.wait_group 1``), operands arrive by
# TMA.
GLUON_CASES = {
    "gluon bf16 mm (bias)": _bf16_mm_case(False),
    "gluon bf16 mm (dgrad)": _bf16_mm_case(True),
    "gluon rowwise fp8 mm": _fp8_rowwise_mm_case(),
    "gluon bf16 wgrad (bias sums)": _bf16_wgrad_case(),
    "gluon bf16 wgrad (float32 out)": _bf16_wgrad_case("fp32"),
    "gluon blockwise mm": (gg._blockwise_mm_kernel if HAS_TRITON and HAS_GLUON else None,
                           {"out_ptr": "*bf16", "sizes_ptr": "*i64"},
                           {"BLOCK_G": 32, "NUM_PROGRAMS": 132, "STAGES": gg.MM_CONFIG[2],
                            "UNROLL": gg.MM_UNROLL},
                           gg.MM_CONFIG[1], None),
    "gluon blockwise wgrad": (
        gw._blockwise_wgrad_kernel if HAS_TRITON and HAS_GLUON else None,
        {"dw_ptr": "*bf16", "sizes_ptr": "*i64"},
        {"BLOCK_G": 32, "STAGES": gw.WGRAD_CONFIG[2], "UNROLL": gg.MM_UNROLL,
         "GROUP_N": gw.WGRAD_GROUP_N, "NUM_PROGRAMS": 132, "GROUP_SCALES": False},
        gw.WGRAD_CONFIG[1], gw.WGRAD_MAXNREG),
    "gluon group-scaled wgrad": (
        gw._blockwise_wgrad_kernel if HAS_TRITON and HAS_GLUON else None,
        {"dw_ptr": "*bf16", "sizes_ptr": "*i64"},
        {"BLOCK_G": 32, "STAGES": gw.WGRAD_CONFIG[2], "UNROLL": gg.MM_UNROLL,
         "GROUP_N": gw.WGRAD_GROUP_N, "NUM_PROGRAMS": 132, "GROUP_SCALES": True},
        gw.WGRAD_CONFIG[1], gw.WGRAD_MAXNREG),
    "gluon row tiles and token blocks": (
        qbg._quantize_both_kernel if HAS_TRITON and HAS_GLUON else None,
        {"sizes_ptr": "*i64", "rq_ptr": F8, "q_ptr": F8},
        {"FP8_MAX": FP8_MAX, "POW2": True, "SLICE_": qbg.SLICE, "BLOCK_G": 32}, qbg.WARPS, None),
    **{f"gluon transposed columns ({scaling}{', factors' if factors else ''})": (
        qtg._columns_t_kernel if HAS_TRITON and HAS_GLUON else None,
        {"ends_ptr": "*i32", "q_ptr": F8,
         **({"t_desc": "fp8"} if scaling == "unit" else {})},
        {"FP8_MAX": FP8_MAX, "POW2": False, "SCALING": scaling, "FACTORS": factors,
         "SLICE_": qtg.SLICE, "BLOCK_G": 32}, qtg.WARPS, None)
       for scaling, factors in (("amax", True), ("amax", False), ("group", False),
                                ("unit", False))},
}
# Gluon kernels without MMAs (the MMA checks do not apply).
GLUON_STREAMING = {"gluon row tiles and token blocks",
                   *(name for name in GLUON_CASES if name.startswith("gluon transposed"))}


def _check_gluon(name: str) -> str:
    kernel, pointers, constants, num_warps, maxnreg = GLUON_CASES[name]
    try:
        compiled = _compile_gluon(kernel, pointers, constants, num_warps, maxnreg)
    except Exception as error:  # noqa: BLE001 (reported per case)
        return f"compile error: {type(error).__name__}: {str(error)[:500]}"
    ptx = compiled.asm["ptx"]
    if not compiled.asm.get("cubin"):
        return "no cubin"
    if compiled.metadata.shared > SM90_SHARED_BYTES:
        return f"needs {compiled.metadata.shared} bytes of shared memory"
    if name in GLUON_STREAMING:
        if "cp.async.bulk.tensor" not in ptx:
            return "the tile is not loaded by TMA"
        return "ok" if "st.global.v4" in ptx else "the FP8 stores are not 16-byte vectors"
    if "wgmma.wait_group.sync.aligned 1;" not in ptx:
        return "no MMA stays in flight across a rescale"
    if "cp.async.bulk.tensor" not in ptx:
        return "the operands are not loaded by TMA"
    if maxnreg is not None and "setmaxnreg" not in ptx:
        return "no register split between warp-specialized partitions"
    # ptxas serializes the asynchronous MMAs when registers run short or an in-flight
    # accumulator is copied (notes C7512-C7515): the kernel would lose its overlap silently
    notes = ptxas_notes(ptx)
    if "wgmma.mma_async instructions are serialized" in notes:
        return "ptxas serializes the MMAs: " + notes.split("Potential Performance Loss:")[-1][:200]
    if " 0 bytes spill stores" not in notes:
        return "register spills"
    return "ok"


def _check(name: str) -> str:
    if name in GLUON_CASES:
        return _check_gluon(name)
    kernel, pointers, constants, num_warps, *stages = CASES[name]
    try:
        compiled = compile_triton(kernel, pointers, constants, num_warps, *stages)
    except Exception as error:  # noqa: BLE001 (reported per case)
        return f"compile error: {type(error).__name__}: {str(error)[:500]}"
    if not compiled.asm.get("cubin"):
        return "no cubin"
    if name.startswith(("fp8 ", "bf16 ")) and MMA not in compiled.asm["ttgir"]:
        return "the dot is not lowered to warp-group MMA"
    if name in PIPELINED and ASYNC_LOAD not in compiled.asm["ttgir"]:
        return "the main loop is not software-pipelined"
    # A copy of a later step landing in the buffer a step's MMA is still reading: a race
    # (wrong products now and then), from a pipeliner that gave an operand too few buffers.
    overwritten = overwritten_buffers(compiled.asm["ttgir"])
    if overwritten:
        return "a copy in flight overwrites what the MMA reads: " + "; ".join(overwritten)
    if name in NO_SPILLS and " 0 bytes spill stores" not in ptxas_notes(compiled.asm["ptx"]):
        return "register spills"
    if name in VECTOR_LOADS and ("ld.global.b16" in compiled.asm["ptx"]
                                 or "ld.global.v4" not in compiled.asm["ptx"]):
        return "the bf16 loads are not 16-byte vectors"
    return "ok"


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-m", "tests.kernels.test_compiles_for_sm90", "--json"],
                           capture_output=True, text=True, env=env, timeout=900,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES) + list(GLUON_CASES))
def test_kernel_compiles_for_sm90(results, name):
    assert results[name] == "ok", results[name]


if __name__ == "__main__":
    outcome = {name: _check(name) for name in list(CASES) + list(GLUON_CASES)}
    if "--json" in sys.argv:
        print(json.dumps(outcome))
    else:
        for name, result in outcome.items():
            print(f"{name:40s} {result}")
