"""The Triton FP8 grouped GEMMs against float32 matmuls of the dequantized operands."""

import pytest
import torch

from grouped_linear.kernels.gemm import fp8_triton_gemm as fg
from tests.reference import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
# The interpreter multiplies in float32; FP8 tensor cores accumulate with fewer mantissa
# bits (why the blockwise kernels add each K step's partial product in float32).
TOL = 1e-5 if DEVICE == "cpu" else 2e-3


def _fp8(*shape):
    return (torch.randn(*shape) * 40).clamp(-448, 448).to(E4M3).to(DEVICE)


def _factors(*shape):
    return (torch.rand(*shape) * 0.1 + 0.01).to(DEVICE)


@pytest.mark.parametrize("transpose_weight", [True, False])
@pytest.mark.parametrize("sizes, tail", [([70, 0, 133, 1], 9), ([0, 0], 4), ([200], 0)])
def test_grouped_mm_against_dequantized_float32(transpose_weight, sizes, tail):
    G, N, K = len(sizes), 136, 200
    M = sum(sizes) + tail
    R, W = (K, N) if transpose_weight else (N, K)
    a, w = _fp8(M, R), _fp8(G, N, K)
    a_inv, w_inv = _factors(M, -(-R // 128)), _factors(G, -(-N // 128), -(-K // 128))
    sizes_t = torch.tensor(sizes, device=DEVICE)
    kwargs = {"transpose_weight": transpose_weight, "out_dtype": torch.float32}
    got = fg.grouped_mm(a, a_inv, w, w_inv, sizes_t, **kwargs)
    want = fg.grouped_mm_reference(a, a_inv, w, w_inv, sizes_t, **kwargs)
    assert got.shape == (M, W)
    assert rel_err(got, want) < TOL
    assert torch.all(got[sum(sizes):] == 0)


def test_blockwise_scales_apply_per_block():
    """A factor changed in one 128-deep block changes exactly that block's share."""
    M, N, K = 64, 128, 256
    a, w = _fp8(M, K), _fp8(1, N, K)
    a_inv, w_inv = _factors(M, 2), _factors(1, 1, 2)
    sizes = torch.tensor([M], device=DEVICE)
    kwargs = {"transpose_weight": True, "out_dtype": torch.float32}
    base = fg.grouped_mm(a, a_inv, w, w_inv, sizes, **kwargs)
    w_inv2 = w_inv.clone()
    w_inv2[0, 0, 1] *= 2
    second = a[:, 128:].float() * a_inv[:, 1:] @ (w[0, :, 128:].float() * w_inv[0, 0, 1]).t()
    changed = fg.grouped_mm(a, a_inv, w, w_inv2, sizes, **kwargs)
    assert rel_err(changed - base, second) < TOL


@pytest.mark.parametrize("group_scales", [False, True])
@pytest.mark.parametrize("sizes, tail", [([130, 0, 5, 257], 3), ([0], 2), ([128, 128], 0),
                                         ([300, 40], -100)])
def test_blockwise_wgrad_against_dequantized_float32(sizes, tail, group_scales):
    """Operands in the token-block layout; a negative tail: sizes summing past the rows.
    Factors per (block, row), or per (group, row) applied after the reduction."""
    G, N, K = len(sizes), 72, 136
    M = sum(sizes) + tail
    blocks = -(-M // 128) + G
    dy, x = _fp8(N, blocks * 128), _fp8(K, blocks * 128)
    factor_rows = G if group_scales else blocks
    dy_inv, x_inv = _factors(factor_rows, N), _factors(factor_rows, K)
    sizes_t = torch.tensor(sizes, device=DEVICE)
    kwargs = {"out_dtype": torch.float32, "group_scales": group_scales}
    got = fg.blockwise_wgrad(dy, dy_inv, x, x_inv, sizes_t, M, **kwargs)
    want = fg.blockwise_wgrad_reference(dy, dy_inv, x, x_inv, sizes_t, M, **kwargs)
    assert got.shape == (G, N, K)
    assert rel_err(got, want) < TOL
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.all(got[g] == 0)


@pytest.mark.parametrize("group_scales", [False, True])
def test_long_reductions_accumulate_in_float32(group_scales):
    """16384 tokens of one group, every product positive (the sum grows with each block):
    the weight gradient stays close to the float64 product of the same FP8 operands. Hopper's
    FP8 MMA keeps about 14 bits of its running sum; the kernels add every 128-token block's
    products into a float32 accumulator, so only a block's own sum sees that precision (one
    accumulator over all 16384 tokens would drop most of each late block's bits)."""
    gen = torch.Generator().manual_seed(4)
    M, N, K = 16384, 64, 128
    dy = (torch.rand(N, M, generator=gen) * 200 + 40).to(E4M3).to(DEVICE)
    x = (torch.rand(K, M, generator=gen) * 200 + 40).to(E4M3).to(DEVICE)
    rows = 1 if group_scales else M // 128
    dy_inv, x_inv = _factors(rows, N), _factors(rows, K)
    sizes = torch.tensor([M], device=DEVICE)
    kwargs = {"out_dtype": torch.float32, "group_scales": group_scales}
    got = fg.blockwise_wgrad(dy, dy_inv, x, x_inv, sizes, M, **kwargs)
    want = fg.blockwise_wgrad_reference(dy.cpu(), dy_inv.cpu().double(), x.cpu(),
                                        x_inv.cpu().double(), sizes.cpu(), M, **kwargs)
    assert rel_err(got, want) < 5e-3


def test_group_scaled_wgrad_reads_the_rowwise_wgrad_operands():
    """The rowwise recipes' wgrad operands, quantized with 128-token group alignment, are the
    layout the group-scaled kernel reads: dW matches float64 within FP8 error."""
    from grouped_linear.kernels.quantize import transposed as qt

    sizes, N, K = [130, 0, 5, 257, 64], 48, 80
    M = sum(sizes)
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(M, N, generator=gen).to(DEVICE)
    x = torch.randn(M, K, generator=gen).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    dy_t, dy_inv, _ = qt.quantize_group_columns_t(dy, offsets, E4M3, False, align=fg.BLOCK)
    x_t, x_inv, _ = qt.quantize_group_columns_t(x, offsets, E4M3, False, align=fg.BLOCK)
    got = fg.blockwise_wgrad(dy_t, dy_inv, x_t, x_inv, torch.tensor(sizes, device=DEVICE), M,
                             out_dtype=torch.float32, group_scales=True)
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    want = torch.stack([dy[a:b].double().t() @ x[a:b].double()
                        for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    assert rel_err(got, want) < 6e-2
    assert torch.all(got[1] == 0)


def test_blockwise_wgrad_reads_only_its_groups_blocks():
    """Blocks past the groups' (unused upper-bound blocks) never reach the result."""
    sizes, M, N, K = [200, 56], 256, 64, 128
    blocks = -(-M // 128) + 2
    dy, x = _fp8(N, blocks * 128), _fp8(K, blocks * 128)
    dy_inv, x_inv = _factors(blocks, N), _factors(blocks, K)
    sizes_t = torch.tensor(sizes, device=DEVICE)
    base = fg.blockwise_wgrad(dy, dy_inv, x, x_inv, sizes_t, M, out_dtype=torch.float32)
    dy[:, 3 * 128:] = float("nan")  # group 0: blocks 0-1, group 1: block 2
    changed = fg.blockwise_wgrad(dy, dy_inv, x, x_inv, sizes_t, M, out_dtype=torch.float32)
    assert torch.equal(base, changed)


def test_blockwise_wgrad_rejects_strided_tokens():
    sizes_t = torch.tensor([4], device=DEVICE)
    dy = _fp8(256, 16).t()  # (16, 256) with token stride 16
    with pytest.raises(ValueError, match="dy_blocks"):
        fg.blockwise_wgrad(dy, _factors(3, 16), _fp8(8, 256), _factors(3, 8), sizes_t, 4)
