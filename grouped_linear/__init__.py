"""Grouped linear layers for Mixture-of-Experts models, in PyTorch and Triton.

>>> import grouped_linear as gl
>>> layer = gl.GroupedLinear(num_gemms=4, in_features=64, out_features=32)
"""

from . import parallel, recipes
from .modules import ExpertParallelMoE, GroupedLinear, GroupedMLP, to_fp8_weights
from .ops import GroupSplits, grouped_linear
from .ops.chunks import sort_chunks_by_index
from .ops.fp8.primary import Float8WeightTensor, MasterWeights
from .ops.fp8.rows import Float8Rows
from .ops.mlp import grouped_mlp
from .ops.padding import pad_groups, unpad_groups
from .ops.permutation import permute, unpermute
from .recipes import autocast, checkpoint_context

__version__ = "0.1.0"

__all__ = [
    "GroupedLinear",
    "GroupedMLP",
    "ExpertParallelMoE",
    "to_fp8_weights",
    "Float8WeightTensor",
    "Float8Rows",
    "MasterWeights",
    "parallel",
    "GroupSplits",
    "grouped_linear",
    "grouped_mlp",
    "pad_groups",
    "unpad_groups",
    "permute",
    "unpermute",
    "sort_chunks_by_index",
    "recipes",
    "autocast",
    "checkpoint_context",
    "__version__",
]
