"""Which implementation runs a grouped linear call: one table, one function.

:func:`choose_route` maps what a call asks for (the ``backend`` argument, the FP8 recipe)
and what it is (device, dtype, feature sizes, rows, groups) to one route:

================  ===============================================================
route             runs
================  ===============================================================
``triton``        this library's Triton grouped GEMMs (bias, tail and clamping fused)
``grouped``       the Gluon bf16/fp16 GEMMs on Hopper, torch's ``grouped_mm`` elsewhere
                  (on CUDA at most :data:`TORCH_GROUPED_MAX_GROUPS` groups)
``loop``          one ``torch.matmul`` per group
``fp8_scaled_mm`` FP8 rowwise/tensorwise on ``torch._scaled_grouped_mm`` (sm90, at most
                  :data:`TORCH_GROUPED_MAX_GROUPS` groups)
``fp8_blockwise`` FP8 block scaling on this library's Gluon/Triton GEMMs
``fp8_fused``     FP8 on small calls: one launch per GEMM, quantizing inside
``fp8_emulated``  FP8 numerics as quantize -> dequantize in float32 (any device)
================  ===============================================================

The README's backend table describes the same rules. The plain high-precision call (a CUDA
tensor, a CUDA split tensor, no recipe) is host-bound on small problems, so its verdict is
cached per call signature (:func:`cached_verdict`): the table runs once per signature.
"""

from __future__ import annotations

import torch

from .. import _tuning
from ..kernels._triton import HAS_TRITON, interpreting
from ..kernels.gemm import fp8_fused_gemm, fp8_torch_gemm, triton_gemm
from ..kernels.gemm.triton_gemm import LinearLaunches
from ..recipes import Float8Blockwise, Float8Recipe, Float8Rowwise, Float8Tensorwise, check_recipe
from .splits import SPLIT_DTYPES

__all__ = ["BACKEND_CHOICES", "TORCH_GROUPED_MAX_GROUPS", "check_backend", "resolve_backend",
           "fp8_route", "choose_route", "cached_verdict"]

BACKEND_CHOICES = ("auto", "grouped", "loop", "triton")
_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The most groups torch's CUDA grouped GEMMs take: its CUTLASS kernels behind ``grouped_mm``
#: (bf16) and ``_scaled_grouped_mm`` check ``group_count < 1024``. The ``grouped`` route keeps
#: to it on CUDA for every dtype and kernel (on Hopper the Gluon GEMMs hand the operands they
#: do not take to torch's); torch's CPU grouped GEMM is a loop without the limit.
TORCH_GROUPED_MAX_GROUPS = 1023


def _torch_grouped_takes(device: torch.device, num_groups: int) -> bool:
    """Whether torch's grouped GEMM takes ``num_groups`` groups on ``device``."""
    return device.type != "cuda" or num_groups <= TORCH_GROUPED_MAX_GROUPS


def check_backend(backend: object) -> str:
    """``backend`` if it is one of :data:`BACKEND_CHOICES`, else ``ValueError`` naming it."""
    if not isinstance(backend, str) or backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} is not one of {BACKEND_CHOICES}")
    return backend


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, in_features: int,
                    out_features: int, num_rows: int = 0, num_groups: int = 1) -> str:
    """The high-precision route for ``backend`` (``"auto"`` included), or ``ValueError``
    where the backend asked for by name cannot take the call.

    ``auto`` on CUDA, bf16/fp16: the Triton kernels up to
    :attr:`~grouped_linear._tuning.Tuning.triton_auto_max_rows` rows (one launch per GEMM,
    bias and tail fused, where launches dominate), the grouped GEMMs above (sync-free in
    bf16); past :data:`TORCH_GROUPED_MAX_GROUPS` groups the Triton kernels at any row count,
    past theirs the loop. On CPU, fp32 and bf16: the grouped GEMM (torch's C++ loop over the
    groups, a few percent faster than the Python one) where its 16-byte rows allow; a bf16
    bias joins the forward's products by ``addmm`` per group (one rounding), the backward's
    GEMMs have none to add. Everywhere else the per-group loop:
    for fp32 on CUDA it honours
    ``torch.backends.cuda.matmul.allow_tf32``; torch's grouped GEMM has no float64.
    """
    check_backend(backend)
    if backend == "triton":
        if not (HAS_TRITON and (device.type == "cuda" or (interpreting() and device.type == "cpu"))):
            raise ValueError(
                f"backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                f"got device {device.type}, triton {'installed' if HAS_TRITON else 'missing'}"
            )
        if dtype not in _TRITON_DTYPES:
            raise ValueError(f"backend='triton' does not support dtype {dtype}; use 'loop'")
        if not triton_gemm.fits(num_groups, in_features, out_features):
            raise ValueError(
                f"backend='triton' takes at most {triton_gemm.MAX_GROUPS} groups of fewer than "
                f"2**31 weights each; got {num_groups} groups of {out_features}x{in_features}"
            )
        return backend
    if backend == "grouped":
        if not (dtype in (torch.bfloat16, torch.float16, torch.float32)
                and (device.type == "cuda" or dtype != torch.float16)):
            raise ValueError(
                f"backend='grouped' does not support dtype {dtype} on {device.type}; use 'loop'"
            )
        row_alignment = 16 // dtype.itemsize  # torch's grouped GEMM: 16-byte row strides
        if in_features % row_alignment or out_features % row_alignment:
            raise ValueError(
                f"backend='grouped' needs in_features and out_features that are multiples of "
                f"{row_alignment} for {dtype} (16-byte rows); got in_features={in_features}, "
                f"out_features={out_features}; use 'loop' or 'auto'"
            )
        if not _torch_grouped_takes(device, num_groups):
            raise ValueError(
                f"backend='grouped' takes at most {TORCH_GROUPED_MAX_GROUPS} groups on CUDA "
                f"(the limit of torch's grouped GEMM); got {num_groups} groups; use 'auto', "
                f"'triton' (up to {triton_gemm.MAX_GROUPS} groups) or 'loop'"
            )
        return backend
    if backend == "loop":
        return backend
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        triton_fits = HAS_TRITON and triton_gemm.fits(num_groups, in_features, out_features)
        if triton_fits and num_rows <= _tuning.current().triton_auto_max_rows:
            return "triton"
        grouped_takes = _torch_grouped_takes(device, num_groups)
        if grouped_takes and in_features % 8 == 0 and out_features % 8 == 0:
            return "grouped"
        if triton_fits and not grouped_takes:
            return "triton"  # more groups than torch's grouped GEMM takes
    if device.type == "cpu" and in_features > 0 and out_features > 0:
        row_alignment = 16 // dtype.itemsize
        takes = in_features % row_alignment == 0 and out_features % row_alignment == 0
        if takes and dtype in (torch.float32, torch.bfloat16):
            return "grouped"
    return "loop"


def _fp8_gemms_on(device: torch.device) -> bool:
    """Whether ``device`` has FP8 matrix units the Triton kernels can use (sm89+)."""
    if device.type != "cuda" or not HAS_TRITON:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_route(recipe: Float8Recipe, device: torch.device, dtype: torch.dtype, in_features: int,
              out_features: int, num_groups: int, num_rows: int | None = None) -> str:
    """The FP8 route of a call with ``recipe`` (``num_rows=None``: of a large call):

    * ``"fp8_fused"``: any recipe, bf16 or fp16, CUDA, at most
      ``fp8_fused_max_work`` (:mod:`grouped_linear._tuning`) for ``num_rows`` x
      ``in_features`` x ``out_features`` and ``fp8_fused_max_weights`` (blockwise:
      ``fp8_fused_max_block_weights``) for ``num_groups`` x ``in_features`` x
      ``out_features``: one launch per GEMM, where the other routes' quantization passes
      make a small call's host time (past the weight bound too where neither GEMM route
      below takes the call);
    * ``"fp8_blockwise"``: ``Float8Blockwise``, E4M3, bf16, a GPU with FP8 tensor cores;
    * ``"fp8_scaled_mm"``: ``Float8Rowwise``/``Float8Tensorwise``, bf16, sm90, features that
      are multiples of 16, a format pair and a group count (at most
      :data:`TORCH_GROUPED_MAX_GROUPS`) ``torch._scaled_grouped_mm`` takes;
    * ``"fp8_emulated"``: everything else.
    """
    tuning = _tuning.current()
    max_weights = (tuning.fp8_fused_max_block_weights if isinstance(recipe, Float8Blockwise)
                   else tuning.fp8_fused_max_weights)
    small = (num_rows is not None and dtype in (torch.bfloat16, torch.float16)
             and device.type == "cuda"
             and HAS_TRITON and fp8_fused_gemm.fits(num_groups, in_features, out_features)
             and num_rows * in_features * out_features <= tuning.fp8_fused_max_work)
    if small and num_groups * in_features * out_features <= max_weights:
        return "fp8_fused"
    if (isinstance(recipe, Float8Blockwise) and recipe.fp8_format == "e4m3"
            and dtype == torch.bfloat16 and _fp8_gemms_on(device)
            and triton_gemm.fits(num_groups, in_features, out_features)):
        return "fp8_blockwise"
    if (isinstance(recipe, (Float8Rowwise, Float8Tensorwise)) and dtype == torch.bfloat16
            and num_groups <= TORCH_GROUPED_MAX_GROUPS and fp8_torch_gemm.available(device)
            and fp8_torch_gemm.shapes_supported(in_features, out_features)
            and fp8_torch_gemm.gemm_accepts(recipe.gradient_dtype, recipe.forward_dtype,
                                            device.index if device.index is not None
                                            else torch.cuda.current_device())):
        return "fp8_scaled_mm"
    return "fp8_fused" if small else "fp8_emulated"  # a large weight no GEMM route takes


def choose_route(backend: str, recipe: Float8Recipe | None, device: torch.device,
                 dtype: torch.dtype, in_features: int, out_features: int, num_rows: int,
                 num_groups: int) -> str:
    """The route of one call (see the module's table). With a recipe ``backend`` is only
    checked for its name: it selects among the high-precision implementations."""
    if recipe is None:
        return resolve_backend(backend, device, dtype, in_features, out_features, num_rows,
                               num_groups)
    check_backend(backend)
    check_recipe(recipe, device)
    return fp8_route(recipe, device, dtype, in_features, out_features, num_groups, num_rows)


# --------------------------------------------------------------------------- verdict cache
# The plain call's verdicts by call signature: the route ("" where the plain call's
# conditions do not hold) and, for ``triton``, that geometry's launches. Starts over when full.
_VERDICTS: dict[tuple, tuple[str, LinearLaunches | None]] = {}
_MAX_VERDICTS = 1024


def cached_verdict(x: object, weight: object, bias: object, m_splits: object,
                   backend: object) -> tuple[str, LinearLaunches | None] | None:
    """The route of a plain call, from the cache, and its Triton launches; ``None`` where the
    call is not a plain one (then the caller takes the checked path, which rejects bad input).

    A plain call: ``x`` a CUDA tensor ``(M, K)``, ``m_splits`` an integer ``(G,)`` tensor on
    its device, ``weight`` ``(G, N, K)`` and ``bias`` ``(G, N)`` or ``None`` of ``x``'s dtype
    there, a valid backend. The key holds every shape, stride, dtype and device, so one
    lookup stands for the checks of :func:`grouped_linear.ops.grouped_linear.apply_grouped_linear`.
    The route is ``""`` where those conditions fail (the checked path then runs).
    """
    if (type(x) is not torch.Tensor or type(m_splits) is not torch.Tensor or not x.is_cuda
            or not isinstance(weight, torch.Tensor) or type(backend) is not str
            or (bias is not None and not isinstance(bias, torch.Tensor))):
        return None
    shape = x.shape
    if len(shape) != 2:
        return None
    key = (shape, x.stride(), shape[0] <= _tuning.current().triton_auto_max_rows, x.dtype,
           x.device, m_splits.shape, m_splits.dtype, m_splits.device, weight.shape,
           weight.stride(), weight.dtype, weight.device,
           None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device), backend)
    verdict = _VERDICTS.get(key)
    if verdict is None:
        route = _plain_route(x, weight, bias, m_splits, backend)
        verdict = (route, LinearLaunches() if route == "triton" else None)
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()
        _VERDICTS[key] = verdict
    return verdict


def _plain_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 m_splits: torch.Tensor, backend: str) -> str:
    """The route of a call of this signature, or "" when it is not a plain call."""
    device = x.device
    if m_splits.device != device or weight.dim() != 3 or m_splits.dim() != 1:
        return ""
    dtype = x.dtype
    num_groups, out_features, in_features = weight.shape
    if (x.shape[1] != in_features or m_splits.shape[0] != num_groups
            or weight.dtype != dtype or weight.device != device
            or m_splits.dtype not in SPLIT_DTYPES or not x.is_floating_point()
            or backend not in BACKEND_CHOICES):
        return ""
    if bias is not None and (bias.shape != (num_groups, out_features) or bias.dtype != dtype
                             or bias.device != device):
        return ""
    try:
        return resolve_backend(backend, device, dtype, in_features, out_features, x.shape[0],
                               num_groups)
    except ValueError:
        return ""  # the checked path raises it again, with its context
