"""Scale-out through ``torch.distributed``: tensor parallelism of the expert layers."""

from .tensor_parallel import TensorParallel, copy_to_tp_region, reduce_from_tp_region

__all__ = ["TensorParallel", "copy_to_tp_region", "reduce_from_tp_region"]
