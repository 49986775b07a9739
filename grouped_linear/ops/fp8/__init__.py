"""The FP8 routes of a grouped linear call (chosen by :func:`grouped_linear.ops.dispatch.fp8_route`):
``fp8_scaled_mm`` (:mod:`.scaled_mm`), ``fp8_blockwise`` (:mod:`.blockwise`), ``fp8_fused``
(:mod:`.fused`) and ``fp8_emulated`` (:mod:`.emulated`), with the FP8 weight and its cache
(:mod:`.weight`) and rows permuted in FP8 (:mod:`.rows`)."""

from .blockwise import Fp8BlockwiseFunction
from .emulated import Fp8EmulatedFunction
from .fused import Fp8FusedFunction
from .primary import Float8WeightTensor, MasterWeights
from .rows import Float8Rows, plain_rows
from .scaled_mm import Fp8ScaledMMFunction
from .weight import Fp8Config, Fp8Weight, Fp8WeightCache

__all__ = ["Fp8BlockwiseFunction", "Fp8EmulatedFunction", "Fp8FusedFunction",
           "Fp8ScaledMMFunction", "Fp8Config", "Fp8Weight", "Fp8WeightCache",
           "Float8Rows", "Float8WeightTensor", "MasterWeights", "plain_rows"]
