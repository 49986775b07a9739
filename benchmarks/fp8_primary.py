"""FP8 primary weights under FSDP2: weight memory, bytes all-gathered and step time against
the same FP8 recipe on high-precision weights.

From the repository root, on a machine with N GPUs (NCCL; NVLink multicast is kept off):
    PYTHONPATH=. python benchmarks/fp8_primary.py --world N
On CPU (gloo), as a smoke test with a tiny block:
    PYTHONPATH=. python benchmarks/fp8_primary.py --world 2 --cpu --tiny

A ``GroupedMLP`` (SwiGLU, no bias; DeepSeek-V3-like defaults: 32 experts, 7168 -> 2048,
``--rows`` rows in balanced groups per rank) is sharded by ``fully_shard`` and trained with
AdamW under ``--recipe``, one step = forward, backward, optimizer step:

- ``bf16``: bf16 weights, AdamW on them; FSDP2 gathers bf16 and each forward quantizes.
- ``fp32+bf16``: float32 weights gathered in bf16 (``MixedPrecisionPolicy``), AdamW on the
  float32 weights; each forward quantizes.
- ``fp8``: ``gl.to_fp8_weights``; FSDP2 gathers the FP8 codes and factors, AdamW on
  ``gl.MasterWeights``' float32 shards, quantized back after each step.

Columns: weight bytes per rank (the parameters as FSDP2 holds them), master and optimizer
bytes per rank, bytes each rank sends to the all-gathers per step, and the median step time
over alternating rounds with its ratio to ``bf16``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from _common import distributed_arguments, process_group, spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

import grouped_linear as gl
from grouped_linear.cli.timing import format_table, warm_gpu

RECIPES = {"rowwise": gl.recipes.Float8Rowwise, "tensorwise": gl.recipes.Float8Tensorwise,
           "blockwise": gl.recipes.Float8Blockwise}


class _CountingAllGather(DefaultAllGather):
    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.sent += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


def _nbytes(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)
    if isinstance(local, gl.Float8WeightTensor):
        return local.codes.nbytes + local.inv.nbytes
    return local.numel() * local.element_size()


def _build(case: str, args, mesh, device, counter):
    recipe = RECIPES[args.recipe]()
    dtype = torch.float32 if case == "fp32+bf16" else torch.bfloat16
    torch.manual_seed(0)
    model = gl.GroupedMLP(args.experts, args.hidden, args.ffn, bias=False, recipe=recipe,
                          params_dtype=dtype, device=device)
    if case == "fp8":
        gl.to_fp8_weights(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if case == "fp32+bf16" \
        else MixedPrecisionPolicy()
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        layer.set_custom_all_gather(counter)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if case == "fp8":
        masters = gl.MasterWeights(model.parameters())
        opt = torch.optim.AdamW(masters.params + masters.others, lr=1e-5)

        def update():
            masters.step(opt)
            opt.zero_grad()
        kept = masters.params
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def update():
            opt.step()
            opt.zero_grad()
        kept = []
    return model, opt, update, kept


def _measure(rank, world, device, args):
    cuda = not args.cpu
    mesh = init_device_mesh(device.type, (world,))
    dtype = torch.bfloat16
    sizes = [args.rows // args.experts] * args.experts
    x = torch.randn(sum(sizes), args.hidden, device=device, dtype=dtype)
    splits = torch.tensor(sizes, device=device)
    cases = ["bf16", "fp32+bf16", "fp8"]
    built, counters = {}, {}
    for case in cases:
        counters[case] = _CountingAllGather()
        built[case] = _build(case, args, mesh, device, counters[case])

    def step(case):
        model, _, update, _ = built[case]
        model(x, splits).float().square().mean().backward()
        update()

    def sync():
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    sent = {}
    for case in cases:
        step(case)  # first step: lazy initialisation, compilation
        counters[case].sent = 0
        step(case)
        sent[case] = counters[case].sent
    times = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            if cuda:
                warm_gpu(200, device)
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(case)
            sync()
            times[case].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        rows = []
        base = statistics.median(times["bf16"])
        for case in cases:
            model, opt, _, kept = built[case]
            weights = sum(_nbytes(p) for p in model.parameters())
            state = sum(_nbytes(t) for s in opt.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)
            masters = sum(_nbytes(t) for t in kept)
            ms = statistics.median(times[case]) * 1e3
            rows.append([case, f"{weights / 2**20:.1f}", f"{masters / 2**20:.1f}",
                         f"{state / 2**20:.1f}", f"{sent[case] / 2**20:.1f}", f"{ms:.2f}",
                         f"{ms / (base * 1e3):.3f}"])
        print(format_table(
            ["weights", "weight MiB", "master MiB", "AdamW MiB", "all-gather MiB/step",
             "step ms", "vs bf16"], rows,
            title=f"GroupedMLP {args.experts} experts {args.hidden} -> {args.ffn}, "
                  f"{args.rows} rows per rank, Float8{args.recipe.capitalize()}, "
                  f"fully_shard over {world} {'GPU' if cuda else 'CPU process'}(s), "
                  f"{args.rounds} rounds of {args.steps} steps"))


def _worker(rank, world, port, args):
    with process_group(rank, world, port, args.cpu) as device:
        _measure(rank, world, device, args)


def main() -> None:
    parser = distributed_arguments(__doc__, world=1)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="rowwise")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.tiny:
        args.experts, args.hidden, args.ffn, args.rows = 4, 128, 256, 64
    spawn(_worker, args)


if __name__ == "__main__":
    main()
