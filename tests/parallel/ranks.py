"""Multi-rank tests on CPU: each rank a spawned process in a gloo process group."""

import gc
import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo(body: Callable[..., None], *args, world: int = 2, **options) -> None:
    """Runs ``body(rank, world, *args)`` on ``world`` spawned ranks, each in a gloo process
    group (``options`` go to ``init_process_group``); an exception on any rank fails the
    call."""
    mp.spawn(_rank, args=(body, world, free_port(), args, options), nprocs=world, join=True)


def _rank(rank, body, world, port, args, options):
    os.environ.pop("TRITON_INTERPRET", None)  # plain PyTorch paths: fast and exact on CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **options)
    try:
        body(rank, world, *args)
        # The body's frame is gone, but its reference cycles (fully_shard's modules hold the
        # group and its work objects) are not: collected at interpreter exit, after the group
        # is destroyed, gloo's threads abort the process. Free them while everything lives.
        gc.collect()
        dist.barrier()  # no rank tears the group down while another still talks
    finally:
        dist.destroy_process_group()
        gc.collect()
