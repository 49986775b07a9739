"""Expert parallelism on 2 CPU ranks (gloo) against a single-process reference (float32)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import grouped_linear as gl
from tests.parallel.ranks import free_port, spawn_gloo
from tests.reference import rel_err

H, FFN, E, TOP_K, T = 16, 8, 4, 2, 24


def _worker(rank, world):
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


def test_expert_parallel_moe_matches_single_process():
    spawn_gloo(_worker)


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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="negative count"):
            gl.parallel.dispatch(x, torch.tensor([7, -1]))
        with pytest.raises(ValueError, match="sums to 7, more than the 6 rows"):
            gl.parallel.dispatch(x, torch.tensor([4, 3]))
        received, local_counts, plan = gl.parallel.dispatch(x, torch.tensor([2, 3]))
        assert torch.equal(received, x[:5]) and local_counts.tolist() == [2, 3]
        assert torch.equal(gl.parallel.combine(received, plan)[:5], x[:5])
        with pytest.raises(ValueError, match=r"y_local is \(4, 4\): expected \(5, hidden\)"):
            gl.parallel.combine(received[:4], plan)
        with pytest.raises(TypeError, match="plan is tuple"):
            gl.parallel.combine(received, (plan,))
    finally:
        dist.destroy_process_group()


def _bad_counts_worker(rank, world, bad_rank, counts_of_bad_rank, match_bad):
    """Every rank raises a ValueError when one rank's counts are bad (the others naming that
    rank), and the group stays usable: no rank is left inside an exchange."""
    x = torch.arange(6 * 2, dtype=torch.float32).view(6, 2) + 100 * rank
    good = torch.tensor([1, 2, 0, 3])
    counts = torch.tensor(counts_of_bad_rank) if rank == bad_rank else good
    match = match_bad if rank == bad_rank else f"counts of rank {bad_rank} hold"
    with pytest.raises(ValueError, match=match):
        gl.parallel.dispatch(x, counts)
    received, local_counts, plan = gl.parallel.dispatch(x, good)
    # each rank gets its 2 experts' rows from both ranks: counts (1, 2) or (0, 3) per rank
    assert local_counts.tolist() == [2 * v for v in good.view(world, 2)[rank].tolist()]
    assert torch.equal(gl.parallel.combine(received, plan), x)


@pytest.mark.parametrize("counts, match", [
    ([1, 2, -1, 3], "negative count"),  # an expert of the peer: the peer receives the -1
    ([-1, 2, 0, 3], "negative count"),  # an expert of its own: the peer receives good counts
    ([4, 2, 0, 3], "sums to 9, more than the 6 rows of x_perm"),
])
def test_dispatch_bad_counts_on_one_rank_fail_on_every_rank(counts, match):
    spawn_gloo(_bad_counts_worker, 1, counts, match, timeout=timedelta(seconds=60))


def test_moe_checks_x_before_routing():
    """An x of another dtype than the parameters is named (not the router's matmul error)."""
    moe = gl.ExpertParallelMoE(H, FFN, E, TOP_K)
    with pytest.raises(TypeError, match=r"x has dtype torch.bfloat16 but the parameters have "
                                        r"dtype torch.float32"):
        moe(torch.randn(3, H, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x has dtype torch.int64: expected a floating-point"):
        moe(torch.ones(3, H, dtype=torch.int64))
    with pytest.raises(TypeError, match="x is list"):
        moe([[0.0] * H])
    with pytest.raises(ValueError, match="x is on meta but the parameters are on cpu"):
        moe(torch.randn(3, H, device="meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: any floating dtype
        assert moe(torch.randn(3, H)).shape == (3, H)
