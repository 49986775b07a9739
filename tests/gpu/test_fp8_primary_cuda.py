"""FP8 primary weights on CUDA (each recipe's device route): a GroupedMLP with its weights
stored in FP8 against the same block holding the stored values in bf16, and float32 masters
training in step with that block; one step in a CUDA graph."""

import pytest
import torch

import grouped_linear as gl
from tests.gpu.test_cuda_graphs import _capture
from tests.reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]
SIZES = [100, 0, 300, 112]


def _pair(recipe):
    torch.manual_seed(0)
    kwargs = dict(bias=False, params_dtype=torch.bfloat16, device="cuda", recipe=recipe)
    stored = gl.to_fp8_weights(gl.GroupedMLP(4, 256, 128, **kwargs))
    plain = gl.GroupedMLP(4, 256, 128, **kwargs)
    with torch.no_grad():
        plain.fc1.weight.copy_(stored.fc1.weight.dequantize())
        plain.fc2.weight.copy_(stored.fc2.weight.dequantize())
    return stored, plain


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_stored_block_matches_the_plain_block_and_trains_in_step(recipe):
    stored, plain = _pair(recipe)
    masters = gl.MasterWeights(stored.parameters())
    opt = torch.optim.SGD(masters.params + masters.others, lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    splits = torch.tensor(SIZES, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        x = torch.randn(sum(SIZES), 256, device="cuda", generator=gen).bfloat16()
        y = stored(x, splits)
        y.float().square().mean().backward()
        y_plain = plain(x, splits)
        y_plain.float().square().mean().backward()
        if step == 0:
            assert rel_err(y, y_plain) < 1e-2
            assert rel_err(stored.fc1.weight.grad, plain.fc1.weight.grad) < 2e-2
        masters.step(opt)
        opt.zero_grad()
        plain_opt.step()
        plain_opt.zero_grad()
    for master, p in zip(masters.params, (plain.fc1.weight, plain.fc2.weight)):
        assert rel_err(master, p) < 2e-2


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_stored_block_in_a_cuda_graph(recipe):
    stored, _ = _pair(recipe)
    x = torch.randn(sum(SIZES), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(SIZES, device="cuda")

    def step():
        stored.zero_grad(set_to_none=True)
        x.grad = None
        y = stored(x, splits)
        y.float().square().sum().backward()
        return y, x.grad, stored.fc1.weight.grad

    graph, captured = _capture(step)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        stored.fc1.weight.mul_(0.5)  # quantized in place: the graph reads the same buffers
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in captured]
    for a, b in zip(got, step()):
        assert torch.equal(a, b)


def _fsdp_trains_in_step(rank, world, device, mesh, recipe):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    kwargs = dict(bias=False, params_dtype=torch.bfloat16, device=device, recipe=recipe)
    sharded = gl.to_fp8_weights(gl.GroupedMLP(4, 256, 128, **kwargs))
    ref = gl.to_fp8_weights(gl.GroupedMLP(4, 256, 128, **kwargs))
    ref.load_state_dict(sharded.state_dict())
    for layer in (sharded.fc1, sharded.fc2, sharded):
        fully_shard(layer, mesh=mesh)
    masters, ref_masters = gl.MasterWeights(sharded.parameters()), gl.MasterWeights(
        ref.parameters())
    opt = torch.optim.AdamW(masters.params, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_masters.params, lr=1e-2)
    splits = torch.tensor(SIZES, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(sum(SIZES), 256, device=device, generator=gen).bfloat16()
          for _ in range(world)]
    for _ in range(3):
        sharded(xs[rank], splits).float().square().mean().backward()
        masters.step(opt)
        opt.zero_grad()
        torch.stack([ref(x, splits).float().square().mean() for x in xs]).mean().backward()
        ref_masters.step(ref_opt)
        ref_opt.zero_grad()
    for master, ref_master in zip(masters.params, ref_masters.params):
        assert master.to_local().shape[0] == 4 // world
        assert rel_err(master.full_tensor(), ref_master) < 1e-2, recipe
    y = sharded(xs[0], splits)
    assert rel_err(y, ref(xs[0], splits)) < 2e-2, recipe


def _fsdp_worker(rank, world, port):
    import gc
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    try:
        mesh = init_device_mesh("cuda", (world,))
        for recipe in RECIPES:
            _fsdp_trains_in_step(rank, world, device, mesh, recipe)
        gc.collect()  # fully_shard's module cycles hold the group: free them while it lives
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fully_shard_gathers_fp8_weights_on_cuda():
    """FSDP2 over NCCL (two GPUs where there are, else one): the FP8 codes all-gathered on
    the device train in step with the unsharded FP8 block on the mean loss."""
    import torch.multiprocessing as mp

    from tests.parallel.ranks import free_port

    world = min(2, torch.cuda.device_count())
    mp.spawn(_fsdp_worker, args=(world, free_port()), nprocs=world, join=True)
