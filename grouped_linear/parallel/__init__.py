"""Scale-out through ``torch.distributed``: tensor and expert parallelism."""

from .expert_parallel import DispatchPlan, combine, dispatch
from .tensor_parallel import TensorParallel, copy_to_tp_region, reduce_from_tp_region

__all__ = ["TensorParallel", "copy_to_tp_region", "reduce_from_tp_region", "dispatch", "combine",
           "DispatchPlan"]
