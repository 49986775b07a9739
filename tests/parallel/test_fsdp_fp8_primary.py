"""FSDP2 (fully_shard) of FP8 primary weights on 2 CPU ranks: sharded by experts, the FP8
codes and factors all-gathered, float32 masters sharded alike, distributed checkpoints."""

import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

import grouped_linear as gl
from tests.parallel.ranks import spawn_gloo
from tests.reference import rel_err

E, H, FFN = 4, 128, 256
SIZES = [3, 0, 5, 4]
RECIPES = [gl.recipes.Float8Rowwise(), gl.recipes.Float8Tensorwise(),
           gl.recipes.Float8Blockwise()]


class _CountingAllGather(DefaultAllGather):
    """FSDP2's own all-gather, adding up the bytes each rank sends."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.sent += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


def _model(recipe, seed=0, dtype=torch.float32, fp8=True):
    torch.manual_seed(seed)
    model = gl.GroupedMLP(E, H, FFN, recipe=recipe, params_dtype=dtype)
    return gl.to_fp8_weights(model) if fp8 else model


def _shard(model, mesh, counter=None):
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
        if counter is not None:
            layer.set_custom_all_gather(counter)
    fully_shard(model, mesh=mesh)
    return model


def _trains_like_one_process(rank, world, mesh, recipe):
    """Three AdamW steps through MasterWeights, sharded against one process on the mean
    loss: the same FP8 weights and masters; each rank's masters hold its experts only.
    One intra-op thread: with more, the CPU GEMMs may split their sums by the threads
    free at the time (a busy machine), a last-bit difference that the FP8 quantization of
    activations and gradients turns into a different code now and then."""
    torch.set_num_threads(1)
    sharded, ref = _shard(_model(recipe), mesh), _model(recipe)
    assert isinstance(sharded.fc1.weight.to_local(), gl.Float8WeightTensor)
    xs = [torch.randn(12, H, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    masters, ref_masters = gl.MasterWeights(sharded.parameters()), gl.MasterWeights(
        ref.parameters())
    opt = torch.optim.AdamW(masters.params + masters.others, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_masters.params + ref_masters.others, lr=1e-2)
    start = ref.fc1.weight.dequantize()
    for _ in range(3):
        sharded(xs[rank], SIZES).square().mean().backward()
        masters.step(opt)
        opt.zero_grad()
        torch.stack([ref(x, SIZES).square().mean() for x in xs]).mean().backward()
        ref_masters.step(ref_opt)
        ref_opt.zero_grad()
    assert rel_err(ref.fc1.weight.dequantize(), start) > 1e-2  # it did train
    for (name, p), p_ref in zip(sharded.named_parameters(), ref.parameters()):
        want = p_ref.dequantize() if isinstance(p_ref, gl.Float8WeightTensor) else p_ref
        assert rel_err(p.full_tensor(), want) < 1e-6, (recipe, name)
    for master, ref_master in zip(masters.params, ref_masters.params):
        local = master.to_local()
        assert local.dtype == torch.float32 and local.shape[0] == E // world
        assert rel_err(master.full_tensor(), ref_master) < 1e-6, recipe


def _gathers_half_the_bytes(mesh, recipe):
    """The FP8 weights' all-gathers send at most 0.55x what the same model with bf16
    weights under the same recipe sends (biases, bf16 in both, included)."""
    sent = {}
    for fp8 in (False, True):
        counter = _CountingAllGather()
        model = _shard(_model(recipe, dtype=torch.bfloat16, fp8=fp8), mesh, counter)
        model(torch.randn(12, H, dtype=torch.bfloat16), SIZES).float().square().mean().backward()
        sent[fp8] = counter.sent
    assert 0 < sent[True] <= 0.55 * sent[False], (recipe, sent)


def _checkpoints(mesh, checkpoint_dir):
    """torch.distributed.checkpoint saves the FP8 shards and loads them into a differently
    initialised sharded model: the same outputs. Its masters, built before the load, follow
    it: a step at ``lr=0`` keeps the loaded shards bit for bit."""
    recipe = RECIPES[0]
    saved = _shard(_model(recipe), mesh)
    x = torch.randn(12, H)
    dcp.save(get_model_state_dict(saved), checkpoint_id=checkpoint_dir)
    restored = _shard(_model(recipe, seed=5), mesh)
    masters = gl.MasterWeights(restored.parameters())
    opt = torch.optim.SGD(masters.params + masters.others, lr=0.0)
    state = get_model_state_dict(restored)
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(restored, state)
    assert isinstance(restored.fc1.weight.to_local(), gl.Float8WeightTensor)
    assert torch.equal(restored(x, SIZES), saved(x, SIZES))
    restored(x, SIZES).sum().backward()
    masters.step(opt)
    for (p, master), name in zip(masters.pairs, ("fc1", "fc2")):
        loaded = getattr(saved, name).weight.to_local().dequantize()
        assert torch.equal(p.to_local().dequantize(), loaded), name
        assert torch.equal(master.to_local(), loaded), name
    assert torch.equal(restored(x, SIZES), saved(x, SIZES))


def _uneven_experts_are_refused(mesh):
    """3 experts over 2 ranks: every rank raises the same ValueError before gathering."""
    torch.manual_seed(0)
    model = _shard(gl.to_fp8_weights(gl.GroupedMLP(3, H, FFN, recipe=RECIPES[0])), mesh)
    try:
        model(torch.randn(6, H), [1, 2, 3])
    except ValueError as error:
        assert "3 experts is sharded over 2 ranks" in str(error)
    else:
        raise AssertionError("an uneven expert count did not raise")


def _worker(rank, world, checkpoint_dir):
    mesh = init_device_mesh("cpu", (world,))
    for recipe in RECIPES:
        _trains_like_one_process(rank, world, mesh, recipe)
        _gathers_half_the_bytes(mesh, recipe)
    _checkpoints(mesh, checkpoint_dir)
    _uneven_experts_are_refused(mesh)


def test_fp8_primary_weights_under_fully_shard():
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        spawn_gloo(_worker, checkpoint_dir)


def _one_rank_worker(rank, world):
    """One rank: FSDP2 then copies each weight's single all-gather input instead of
    gathering; the FP8 weights still train as one process does."""
    mesh = init_device_mesh("cpu", (world,))
    for recipe in RECIPES:
        _trains_like_one_process(rank, world, mesh, recipe)


def test_fp8_primary_weights_under_fully_shard_on_one_rank():
    spawn_gloo(_one_rank_worker, world=1)
