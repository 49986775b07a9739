"""Expert parallelism over NCCL, one GPU per rank, against a single-GPU reference.

Each rank also builds the whole layer on its own GPU (every expert, every rank's tokens)
and checks its share of the output and of the gradients against it.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grouped_linear as gl
from grouped_linear.recipes import Float8Rowwise
from tests.parallel.ranks import free_port
from tests.reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

H, FFN, E, TOP_K, T = 256, 128, 8, 2, 512
# float32 (TF32 off) differs only by the order of the k-way combine; bf16 and FP8 also by
# the GEMM tiling, which depends on the number of rows each launch sees.
TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-2, "fp8": 1e-2}


def _worker(rank, world, port, case):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    try:
        dtype = torch.float32 if case == "float32" else torch.bfloat16
        kwargs = {"params_dtype": dtype, "device": device}
        if case == "fp8":
            kwargs["recipe"] = Float8Rowwise()
        singles = [dist.new_group([r]) for r in range(world)]
        torch.manual_seed(0)
        ref = gl.ExpertParallelMoE(H, FFN, E, TOP_K, ep_group=singles[rank], **kwargs)
        ep = gl.ExpertParallelMoE(H, FFN, E, TOP_K, **kwargs)
        local = slice(rank * E // world, (rank + 1) * E // world)
        with torch.no_grad():
            ep.router.weight.copy_(ref.router.weight)
            for name, p in ep.experts.named_parameters():
                p.copy_(dict(ref.experts.named_parameters())[name][local])
        gens = [torch.Generator(device=device).manual_seed(10 + r) for r in range(world)]
        xs = [torch.randn(T, H, device=device, dtype=dtype, generator=g) for g in gens]
        xs[1][: T // 4] *= 0  # some all-zero tokens
        x = xs[rank].clone().requires_grad_()
        y = ep(x)
        y.float().square().sum().backward()
        x_all = torch.cat(xs).requires_grad_()
        y_ref = ref(x_all)
        y_ref.float().square().sum().backward()
        tol = TOLERANCE[case]
        rows = slice(rank * T, (rank + 1) * T)
        assert torch.isfinite(y).all()
        assert rel_err(y, y_ref[rows]) < tol, rel_err(y, y_ref[rows])
        assert rel_err(x.grad, x_all.grad[rows]) < tol, rel_err(x.grad, x_all.grad[rows])
        for name, p in ep.experts.named_parameters():
            want = dict(ref.experts.named_parameters())[name].grad[local]
            assert rel_err(p.grad, want) < tol, (name, rel_err(p.grad, want))
        router_grad = ep.router.weight.grad.float()
        dist.all_reduce(router_grad)
        assert rel_err(router_grad, ref.router.weight.grad) < tol
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", list(TOLERANCE))
def test_expert_parallel_moe_over_nccl_matches_one_gpu(case):
    mp.spawn(_worker, args=(2, free_port(), case), nprocs=2, join=True)
