"""The one-read Gluon quantization into both block layouts against its reference, the two
Triton passes (bit for bit), on sm90; the reference itself everywhere.

Gluon has no CPU interpreter: CI compiles the kernel for sm90
(tests/kernels/test_compiles_for_sm90.py) and checks the reference here.
"""

import pytest
import torch

from grouped_linear.kernels.quantize import blocks as qb
from grouped_linear.kernels.quantize import blocks_gluon as qbg
from tests.hardware import sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def _operand(M, C):
    """bf16 values over several orders of magnitude, per column and per row."""
    t = torch.randn(M, C) * torch.logspace(-2, 2, C) * torch.logspace(1, -1, M)[:, None]
    return t.to(torch.bfloat16).to(DEVICE)


def two_passes(t: torch.Tensor, sizes: torch.Tensor, fp8_dtype: torch.dtype,
               power_of_two: bool) -> tuple:
    """The reference of ``quantize_row_tiles_and_token_blocks``: ``((row_data, row_inv),
    (block_data, block_inv))``, ``quantize_row_tiles`` of ``t`` with the rows past the last
    group zeroed and ``quantize_token_blocks`` of ``t`` in the token-block layout
    (``transpose=True``). Any device, dtype and strides."""
    M = t.shape[0]
    used = sizes.to(device=t.device, dtype=torch.int64).clamp(min=0).sum().clamp(max=M)
    in_groups = (torch.arange(M, device=t.device) < used)[:, None]
    # ``where``, not a product with a 0/1 mask: the zeroed rows stay +0, not -0.
    return (qb.quantize_row_tiles(torch.where(in_groups, t, 0), fp8_dtype, power_of_two, qbg.TILE),
            qb.quantize_token_blocks(t, sizes, fp8_dtype, power_of_two, qbg.TILE, transpose=True))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def test_two_passes_zero_the_rows_past_the_groups():
    t = _operand(300, 136)
    sizes = torch.tensor([100, 0, 150], device=DEVICE)
    (row_data, row_inv), (block_data, block_inv) = two_passes(t, sizes, E4M3, False)
    want_rows = qb.quantize_row_tiles(t[:250], E4M3, False)
    assert torch.equal(_bytes(row_data[:250]), _bytes(want_rows[0]))
    assert torch.equal(row_inv[:250], want_rows[1])
    assert torch.all(row_data[250:].float() == 0) and torch.all(row_inv[250:] == 1)
    want_blocks = qb.quantize_token_blocks(t, sizes, E4M3, False, transpose=True)
    assert torch.equal(_bytes(block_data), _bytes(want_blocks[0]))
    assert torch.equal(block_inv, want_blocks[1])


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sizes, tail, C", [([0, 1, 129, 130, 0], 5, 200),  # C % 128 != 0
                                            ([3000, 1000], 0, 1024),
                                            ([50, 90], -20, 136),  # splits past the rows
                                            ([0, 0], 7, 128),  # every row is tail
                                            ([255, 257, 1, 600], 130, 384)])
@pytest.mark.parametrize("pow2", [False, True])
def test_one_read_equals_the_two_passes(sizes, tail, C, pow2):
    M = sum(sizes) + tail
    t = _operand(M, C)
    size_tensor = torch.tensor(sizes, device="cuda")
    assert qbg.supported(t, len(sizes))
    got = qbg.quantize_row_tiles_and_token_blocks(t, size_tensor, E4M3, pow2)
    want = two_passes(t, size_tensor, E4M3, pow2)
    for (data, inv), (want_data, want_inv) in zip(got, want):
        assert data.shape == want_data.shape and data.dtype == E4M3
        assert torch.equal(_bytes(data), _bytes(want_data))
        assert torch.equal(inv, want_inv)


@pytest.mark.gpu
@sm90
def test_many_groups_and_blocks():
    """128 skewed groups (many partial blocks), more blocks than programs per wave."""
    sizes = (torch.rand(128) ** 3 * 900).long()
    sizes[::17] = 0
    M = int(sizes.sum()) + 77
    t = _operand(M, 256)
    size_tensor = sizes.cuda()
    got = qbg.quantize_row_tiles_and_token_blocks(t, size_tensor, E4M3, True)
    want = two_passes(t, size_tensor, E4M3, True)
    for (data, inv), (want_data, want_inv) in zip(got, want):
        assert torch.equal(_bytes(data), _bytes(want_data)) and torch.equal(inv, want_inv)


def test_operands_the_kernel_does_not_take():
    t = _operand(64, 256)
    assert not qbg.supported(t.cpu(), 2)
    if DEVICE == "cuda":
        assert not qbg.supported(t.float(), 2)  # not bf16
        assert not qbg.supported(t[:, :130], 2)  # not contiguous
        assert not qbg.supported(_operand(64, 130), 2)  # 260-byte rows: not a TMA row pitch
