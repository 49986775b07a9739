"""FSDP2 (fully_shard) of GroupedMLP on 2 CPU ranks, and torch.distributed.checkpoint."""

import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import grouped_linear as gl
from tests.parallel.ranks import spawn_gloo
from tests.reference import rel_err

E, H, FFN = 4, 16, 8
SIZES = [3, 0, 5, 4]


def _model(seed):
    torch.manual_seed(seed)
    return gl.GroupedMLP(E, H, FFN)


def _shard(model, mesh):
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank, world, checkpoint_dir):
    mesh = init_device_mesh("cpu", (world,))
    ref, sharded = _model(0), _shard(_model(0), mesh)
    local = sharded.fc1.weight.to_local()
    assert local.shape == (E // world, 2 * FFN, H)  # sharded along the experts
    assert torch.equal(local, ref.fc1.weight[rank * E // world:(rank + 1) * E // world])
    xs = [torch.randn(12, H, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    sgd = torch.optim.SGD(sharded.parameters(), lr=0.1)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        sgd.zero_grad()
        sharded(xs[rank], SIZES).square().mean().backward()
        sgd.step()
        sgd_ref.zero_grad()
        torch.stack([ref(x, SIZES).square().mean() for x in xs]).mean().backward()
        sgd_ref.step()
    for (name, p), p_ref in zip(sharded.named_parameters(), ref.parameters()):
        assert rel_err(p.full_tensor(), p_ref) < 1e-6, name
    # torch.distributed.checkpoint: save, load into a differently initialised model
    dcp.save(get_model_state_dict(sharded), checkpoint_id=checkpoint_dir)
    restored = _shard(_model(123), mesh)
    state = get_model_state_dict(restored)
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(restored, state)
    x = torch.randn(12, H)
    assert torch.equal(restored(x, SIZES), sharded(x, SIZES))
    # A warm FP8 weight cache: a load into the sharded layers drops it, and the next
    # forward quantizes the loaded weight (as a call quantizing afresh does).
    warm = _shard(_model(7), mesh)
    with gl.autocast(gl.recipes.Float8Rowwise()):
        warm(x, SIZES, is_first_microbatch=True)
        warm.load_state_dict(get_model_state_dict(sharded))
        assert torch.equal(warm(x, SIZES, is_first_microbatch=False), sharded(x, SIZES))


def test_fully_shard_trains_like_one_process_and_checkpoints():
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        spawn_gloo(_worker, checkpoint_dir)


def _deferred_init_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    for single in (True, False):  # both layouts
        layouts = {"single_grouped_weight": single, "single_grouped_bias": single}
        torch.manual_seed(0)
        ref = gl.GroupedMLP(E, H, FFN, **layouts)
        with torch.device("meta"):
            model = gl.GroupedMLP(E, H, FFN, **layouts)
        _shard(model, mesh).to_empty(device="cpu")
        torch.manual_seed(0)
        model.fc1.reset_parameters()
        model.fc2.reset_parameters()
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.full_tensor(), p_ref), (single, name)
    # A delayed weight gradient cannot reach parameters that fully_shard swapped back.
    layer = gl.GroupedLinear(E, H, FFN, delay_wgrad_compute=True)
    fully_shard(layer, mesh=mesh)
    layer(torch.randn(sum(SIZES), H), SIZES).sum().backward()
    try:
        layer.backward_dw()
    except ValueError as error:
        assert "does not work under FSDP2's fully_shard" in str(error)
    else:
        raise AssertionError("backward_dw under fully_shard did not raise")


def test_deferred_init_under_fully_shard_and_delayed_wgrad_error():
    """meta -> fully_shard -> to_empty -> reset_parameters gives the unsharded layer's values
    for the same seed (both layouts); delay_wgrad_compute under fully_shard raises."""
    spawn_gloo(_deferred_init_worker)


class _AddsTheBias(torch.nn.Module):
    """A parent adding a child layer's returned bias after the layer's forward (when FSDP2
    has freed the gathered parameters of the child)."""

    def __init__(self, single):
        super().__init__()
        self.layer = gl.GroupedLinear(E, H, FFN, return_bias=True, single_grouped_weight=single,
                                      single_grouped_bias=single)

    def forward(self, x):
        y, bias = self.layer(x, SIZES)
        bias = torch.stack(bias) if isinstance(bias, list) else bias
        return y + torch.repeat_interleave(bias, torch.tensor(SIZES), 0)


def _return_bias_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    xs = [torch.randn(sum(SIZES), H, generator=torch.Generator().manual_seed(r))
          for r in range(world)]
    for single in (True, False):
        torch.manual_seed(0)
        ref = _AddsTheBias(single)
        torch.manual_seed(0)
        model = _AddsTheBias(single)
        fully_shard(model.layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        y = model(xs[rank])
        y.square().sum().backward()
        sum(ref(x).square().sum() for x in xs).backward()
        assert rel_err(y, ref(xs[rank])) < 1e-6
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.grad.full_tensor() * world, p_ref.grad) < 1e-6, (single, name)


def test_a_returned_bias_outlives_the_sharded_layers_forward():
    """``return_bias=True`` on a layer sharded by fully_shard inside a sharded parent: the
    returned bias is the layer's (not its gathered storage, freed after the layer's
    forward), and every gradient equals one process's (both layouts)."""
    spawn_gloo(_return_bias_worker)
