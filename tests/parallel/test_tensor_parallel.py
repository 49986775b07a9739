"""Tensor-parallel GroupedLinear / GroupedMLP on 2 CPU ranks (gloo) against one process."""

import pytest
import torch
import torch.distributed as dist

import grouped_linear as gl
from tests.parallel.ranks import free_port, spawn_gloo

G, K, N, F = 3, 8, 6, 4
SIZES = [3, 0, 5]
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _pair(make_ref, make_tp):
    torch.manual_seed(7)
    ref = make_ref()
    torch.manual_seed(7)
    tp = make_tp()
    return ref, tp


def _check_column(rank):
    ref, tp = _pair(lambda: gl.GroupedLinear(G, K, N, params_dtype=torch.float64),
                    lambda: gl.GroupedLinear(G, K, N, params_dtype=torch.float64,
                                             parallel_mode="column", tp_size=2))
    cols = slice(rank * N // 2, (rank + 1) * N // 2)
    torch.testing.assert_close(tp.weight, ref.weight[:, cols], **TOL)
    torch.testing.assert_close(tp.bias, ref.bias[:, cols], **TOL)
    x = torch.randn(8, K, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(8, N, dtype=torch.float64)
    y = tp(x, SIZES)
    y.backward(grad[:, cols])
    y_ref = ref(x_ref, SIZES)
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref[:, cols], **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)  # all-reduced across the ranks
    torch.testing.assert_close(tp.weight.grad, ref.weight.grad[:, cols], **TOL)
    torch.testing.assert_close(tp.bias.grad, ref.bias.grad[:, cols], **TOL)


def _check_row(rank):
    ref, tp = _pair(lambda: gl.GroupedLinear(G, K, N, params_dtype=torch.float64),
                    lambda: gl.GroupedLinear(G, K, N, params_dtype=torch.float64,
                                             parallel_mode="row", tp_size=2))
    ins = slice(rank * K // 2, (rank + 1) * K // 2)
    torch.testing.assert_close(tp.weight, ref.weight[:, :, ins], **TOL)
    torch.testing.assert_close(tp.bias, ref.bias, **TOL)
    x = torch.randn(8, K, dtype=torch.float64)
    x_local = x[:, ins].clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    grad = torch.randn(8, N, dtype=torch.float64)
    y = tp(x_local, torch.tensor(SIZES))
    y.backward(grad)
    y_ref = ref(x_ref, SIZES)
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(x_local.grad, x_ref.grad[:, ins], **TOL)
    torch.testing.assert_close(tp.weight.grad, ref.weight.grad[:, :, ins], **TOL)
    torch.testing.assert_close(tp.bias.grad, ref.bias.grad, **TOL)
    # delayed wgrad: the bias gradient (added after the reduction) waits for backward_dw too
    torch.manual_seed(7)
    delayed = gl.GroupedLinear(G, K, N, params_dtype=torch.float64, parallel_mode="row",
                               tp_size=2, delay_wgrad_compute=True)
    delayed(x[:, ins], SIZES).backward(grad)
    assert delayed.weight.grad is None and delayed.bias.grad is None
    delayed.backward_dw()
    torch.testing.assert_close(delayed.bias.grad, ref.bias.grad, **TOL)
    torch.testing.assert_close(delayed.weight.grad, ref.weight.grad[:, :, ins], **TOL)
    # reduce_output=False: the caller reduces (and adds the bias it is handed)
    torch.manual_seed(7)
    partial_layer = gl.GroupedLinear(G, K, N, params_dtype=torch.float64, parallel_mode="row",
                                     tp_size=2, reduce_output=False, return_bias=True)
    partial, bias = partial_layer(x[:, ins], SIZES)
    dist.all_reduce(partial)
    torch.testing.assert_close(partial + torch.repeat_interleave(bias, torch.tensor(SIZES), 0),
                               y_ref.detach(), **TOL)


def _check_mlp(rank):
    ref, tp = _pair(lambda: gl.GroupedMLP(G, K, 2 * F, params_dtype=torch.float64),
                    lambda: gl.GroupedMLP(G, K, 2 * F, params_dtype=torch.float64, tp_size=2))
    x = torch.randn(8, K, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = tp(x, SIZES)
    y.sum().backward()
    y_ref = ref(x_ref, SIZES)
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    gate = slice(rank * F, (rank + 1) * F)
    up = slice(2 * F + rank * F, 2 * F + (rank + 1) * F)
    want = torch.cat([ref.fc1.weight.grad[:, gate], ref.fc1.weight.grad[:, up]], dim=1)
    torch.testing.assert_close(tp.fc1.weight.grad, want, **TOL)
    torch.testing.assert_close(tp.fc2.weight.grad, ref.fc2.weight.grad[:, :, gate], **TOL)


def _check_interleaved_mlp(rank):
    """Gate and up interleaved (GPT-OSS's layout): each rank's contiguous slice of fc1 holds
    whole (gate, up) pairs, and its fc2 slice the matching columns."""
    kwargs = dict(activation="gpt_oss_swiglu", gate_up_order="interleaved", limit=1.5,
                  params_dtype=torch.float64)
    ref, tp = _pair(lambda: gl.GroupedMLP(G, K, 2 * F, **kwargs),
                    lambda: gl.GroupedMLP(G, K, 2 * F, tp_size=2, **kwargs))
    x = torch.randn(8, K, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    tp(x, SIZES).sum().backward()
    y_ref = ref(x_ref, SIZES)
    y_ref.sum().backward()
    torch.testing.assert_close(tp(x, SIZES), y_ref, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    rows = slice(rank * 2 * F, (rank + 1) * 2 * F)
    torch.testing.assert_close(tp.fc1.weight.grad, ref.fc1.weight.grad[:, rows], **TOL)
    torch.testing.assert_close(tp.fc2.weight.grad,
                               ref.fc2.weight.grad[:, :, rank * F:(rank + 1) * F], **TOL)


def _check_mlp_probs(rank):
    """Routing probabilities on the input or on the activation (each rank's slice of the
    features): every rank's ``probs`` gradient is the whole one, as ``x``'s is."""
    for probs_on in ("activation", "input"):
        kwargs = dict(params_dtype=torch.float64, probs_on=probs_on)
        ref, tp = _pair(lambda kw=kwargs: gl.GroupedMLP(G, K, 2 * F, **kw),
                        lambda kw=kwargs: gl.GroupedMLP(G, K, 2 * F, tp_size=2, **kw))
        x = torch.randn(8, K, dtype=torch.float64, requires_grad=True)
        probs = torch.rand(8, dtype=torch.float64, requires_grad=True)
        x_ref, probs_ref = (t.detach().clone().requires_grad_() for t in (x, probs))
        y = tp(x, SIZES, probs)
        y.square().sum().backward()
        y_ref = ref(x_ref, SIZES, probs_ref)
        y_ref.square().sum().backward()
        torch.testing.assert_close(y, y_ref, **TOL)
        torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
        torch.testing.assert_close(probs.grad, probs_ref.grad, **TOL)


def _worker(rank, world):
    _check_column(rank)
    _check_row(rank)
    _check_mlp(rank)
    _check_interleaved_mlp(rank)
    _check_mlp_probs(rank)


def test_tensor_parallel_matches_single_process():
    spawn_gloo(_worker)


def test_row_layer_without_reduction_needs_the_bias_returned():
    """reduce_output=False leaves the reduction to the caller: a call asking for the bias to
    be added (return_bias=False) is an error, as it is at construction; GroupedMLP says so
    at construction."""
    with pytest.raises(ValueError, match="GroupedMLP with reduce_output=False"):
        gl.GroupedMLP(2, 8, 6, tp_size=2, reduce_output=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        layer = gl.GroupedLinear(3, 8, 6, parallel_mode="row", tp_size=1,
                                 tp_group=dist.group.WORLD, reduce_output=False, return_bias=True)
        out, bias = layer(torch.randn(8, 8), [3, 0, 5])
        assert out.shape == (8, 6) and torch.equal(bias, layer.bias)
        with pytest.raises(ValueError, match="return_bias=False with reduce_output=False"):
            layer(torch.randn(8, 8), [3, 0, 5], return_bias=False)
    finally:
        dist.destroy_process_group()
