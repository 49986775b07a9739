"""Expert parallelism on 2 CPU ranks (gloo) against a single-process reference (float32)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grouped_linear as gl
from tests.parallel.test_tensor_parallel import _free_port
from tests.reference import rel_err

H, FFN, E, TOP_K, T = 16, 8, 4, 2, 24


def _worker(rank, world, port):
    os.environ.pop("TRITON_INTERPRET", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        singles = [dist.new_group([r]) for r in range(world)]
        torch.manual_seed(0)
        ref = gl.ExpertParallelMoE(H, FFN, E, TOP_K, ep_group=singles[rank])
        ep = gl.ExpertParallelMoE(H, FFN, E, TOP_K)
        assert ref.ep_size == 1 and ep.ep_size == world and ep.num_local_experts == E // world
        local = slice(rank * E // world, (rank + 1) * E // world)
        with torch.no_grad():
            ep.router.weight.copy_(ref.router.weight)
            for name, p in ep.experts.named_parameters():
                p.copy_(dict(ref.experts.named_parameters())[name][local])
        # every rank routes its own tokens
        xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
        x = xs[rank].clone().requires_grad_()
        y = ep(x)
        y.square().sum().backward()
        x_all = torch.cat(xs).requires_grad_()
        y_ref = ref(x_all)
        y_ref.square().sum().backward()
        rows = slice(rank * T, (rank + 1) * T)
        assert rel_err(y, y_ref[rows]) < 1e-6, rel_err(y, y_ref[rows])
        assert rel_err(x.grad, x_all.grad[rows]) < 1e-6
        for name, p in ep.experts.named_parameters():
            want = dict(ref.experts.named_parameters())[name].grad[local]
            assert rel_err(p.grad, want) < 1e-6, name
        router_grad = ep.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # replicated router: data-parallel reduction
        assert rel_err(router_grad, ref.router.weight.grad) < 1e-6
        dist.barrier()  # neither rank tears down while the other still talks
    finally:
        dist.destroy_process_group()


def test_expert_parallel_moe_matches_single_process():
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)


def test_dispatch_rejects_bad_counts():
    """dispatch names the bad argument: before any communication for types and shapes, after
    its one host read for negative counts and counts past the rows (a 1-rank gloo group)."""
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"x_perm is \(6,\)"):
        gl.parallel.dispatch(torch.randn(6), torch.tensor([3, 3]))
    with pytest.raises(TypeError, match="counts must be an integer tensor"):
        gl.parallel.dispatch(x, torch.tensor([3.0, 3.0]))
    with pytest.raises(ValueError, match=r"counts has shape \(1, 2\)"):
        gl.parallel.dispatch(x, torch.tensor([[3, 3]]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="negative count"):
            gl.parallel.dispatch(x, torch.tensor([7, -1]))
        with pytest.raises(ValueError, match="sums to 7, more than the 6 rows"):
            gl.parallel.dispatch(x, torch.tensor([4, 3]))
        received, local_counts, plan = gl.parallel.dispatch(x, torch.tensor([2, 3]))
        assert torch.equal(received, x[:5]) and local_counts.tolist() == [2, 3]
        assert torch.equal(gl.parallel.combine(received, plan)[:5], x[:5])
    finally:
        dist.destroy_process_group()
