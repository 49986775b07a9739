"""ExpertParallelMoE forward+backward over N processes: tokens/s and the all-to-all share.

From the repository root, on a machine with N GPUs (NCCL; NVLink multicast is kept off):
    PYTHONPATH=. python benchmarks/expert_parallel.py --world 2
On CPU (gloo), as a smoke test with a tiny layer:
    PYTHONPATH=. python benchmarks/expert_parallel.py --world 2 --cpu --tiny

Each rank holds ``--experts-per-rank`` experts and routes ``--tokens`` tokens of width
``--hidden`` to ``--top-k`` of all experts (DeepSeek-V3-like defaults: 7168, 16, 8, 16384).
``--world 1`` runs one process holding the same per-rank work (the 1-GPU baseline).
The all-to-all share is the time of the dispatch and combine exchanges, measured by
timing the same step with the exchanges replaced by local copies of the same sizes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from _common import distributed_arguments, process_group, spawn

import grouped_linear as gl
from grouped_linear.parallel import expert_parallel


def _time_steps(step, device, warmup=3, iters=10) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return (time.perf_counter() - start) / iters


def _worker(rank, world, port, args):
    cuda = not args.cpu
    with process_group(rank, world, port, args.cpu) as device:
        dtype = torch.bfloat16 if cuda else torch.float32
        torch.manual_seed(rank)
        moe = gl.ExpertParallelMoE(args.hidden, args.ffn, args.experts_per_rank * world,
                                   args.top_k, params_dtype=dtype, device=device)
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)

        def step():
            moe(x).float().sum().backward()

        seconds = _time_steps(step, device)
        exchange = float("nan")
        if world > 1:  # the same step with the two exchanges replaced by local copies
            real = expert_parallel.all_to_all_single

            def local_copy(output, input, output_split_sizes=None, input_split_sizes=None,
                           group=None):
                return input[: output.shape[0]].clone() if input.shape[0] >= output.shape[0] \
                    else torch.cat([input, input.new_zeros(output.shape[0] - input.shape[0],
                                                           input.shape[1])])

            expert_parallel.all_to_all_single = local_copy
            try:
                without = _time_steps(step, device)
            finally:
                expert_parallel.all_to_all_single = real
            exchange = max(0.0, seconds - without) / seconds
        if rank == 0:
            tokens = args.tokens * world
            print(f"world {world}: {seconds * 1e3:.2f} ms per forward+backward, "
                  f"{tokens / seconds:,.0f} tokens/s over all ranks, all-to-all share "
                  f"{exchange:.1%}")


def main() -> None:
    parser = distributed_arguments(__doc__, world=2)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts-per-rank", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.ffn, args.experts_per_rank, args.top_k, args.tokens = 64, 32, 4, 2, 256
    spawn(_worker, args)


if __name__ == "__main__":
    main()
