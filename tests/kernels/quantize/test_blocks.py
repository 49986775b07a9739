"""Block-scaling FP8 quantization kernels against their references and the emulation."""

import pytest
import torch

from grouped_linear.kernels.quantize import blocks as qb
from grouped_linear.kernels.quantize import emulate as qe
from tests.reference import codes_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the last bit of the float32 scale."""
    return torch.allclose(a, b, rtol=1e-6, atol=0)


def _dequant_same(deq: torch.Tensor, emulated: torch.Tensor, data: torch.Tensor,
                  ref_data: torch.Tensor) -> bool:
    """Dequantized kernel output equals the emulation wherever the kernel's code equals
    the reference's (``codes_close`` bounds the rare ties where it does not)."""
    same_code = (data.view(torch.uint8) == ref_data.view(torch.uint8)).cpu()
    return _same(deq.cpu()[same_code], emulated.cpu()[same_code])


def _mixed(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """Random values over several orders of magnitude along the last dimension."""
    return torch.randn(*shape) * torch.logspace(-2, 2, shape[-1]) * scale


def _row_tiles_dequant(data: torch.Tensor, inv: torch.Tensor, tile: int) -> torch.Tensor:
    """``(M, C)`` float32 ``data * inv`` with each factor spread over its tile."""
    return data.float() * inv.repeat_interleave(tile, dim=1)[:, :data.shape[1]]


def _weight_dequant(data: torch.Tensor, inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``(G, N, K)`` float32 ``data * inv`` with each factor spread over its block."""
    _, N, K = data.shape
    per_elem = inv.repeat_interleave(block, dim=1)[:, :N].repeat_interleave(block, dim=2)[:, :, :K]
    return data.float() * per_elem


def _token_dequant(data: torch.Tensor, inv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``(M, C)`` float32 on the CPU: each row times its block's factors (the tail
    rows, whose index is one past ``inv``, take the last row)."""
    return data.float().cpu() * inv.cpu()[index.clamp(max=inv.shape[0] - 1)]


def _check_pair(got, ref, fp8):
    data, inv = got
    ref_data, ref_inv = ref
    assert data.dtype == fp8 and inv.dtype == torch.float32
    assert data.shape == ref_data.shape and inv.shape == ref_inv.shape
    assert data.is_contiguous()
    assert torch.isfinite(inv).all()
    assert _same(inv, ref_inv) and codes_close(data, ref_data)


# --------------------------------------------------------------------------- row tiles
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape, magnitude", [((20, 300), 1.0), ((5, 128), 1e4), ((40, 70), 1e-4)])
def test_row_tiles(fp8, pow2, shape, magnitude):
    t = _mixed(*shape, scale=magnitude)
    t[1] = 0  # all-zero tiles: scale 1
    t[2, 128:] = 0
    t = t.to(DEVICE)
    data, inv = qb.quantize_row_tiles(t, fp8, pow2)
    ref = qb.quantize_row_tiles_reference(t, fp8, pow2)
    _check_pair((data, inv), ref, fp8)
    M, C = shape
    assert inv.shape == (M, -(-C // 128))
    assert torch.all(inv[1] == 1) and torch.all(data[1].float() == 0)
    emulated = qe.fake_quant_column_tiles(t, fp8, pow2)
    assert _same(_row_tiles_dequant(*ref, 128), emulated)
    assert _dequant_same(_row_tiles_dequant(data, inv, 128), emulated, data, ref[0])


def test_row_tiles_strided_bf16_and_small_tile():
    t = _mixed(300, 50).to(torch.bfloat16).to(DEVICE).t()  # (50, 300), column-major
    data, inv = qb.quantize_row_tiles(t, E4M3, True, tile=48)
    ref = qb.quantize_row_tiles_reference(t, E4M3, True, tile=48)
    _check_pair((data, inv), ref, E4M3)
    assert inv.shape == (50, 7)
    emulated = qe.fake_quant_column_tiles(t, E4M3, True, tile=48)
    assert _same(_row_tiles_dequant(*ref, 48), emulated)
    assert _dequant_same(_row_tiles_dequant(data, inv, 48), emulated, data, ref[0])


def test_row_tiles_empty():
    for shape in [(0, 300), (4, 0)]:
        data, inv = qb.quantize_row_tiles(torch.zeros(shape, device=DEVICE), E4M3, False)
        assert data.shape == shape and inv.shape == (shape[0], -(-shape[1] // 128))



def _bits(pair):
    return pair[0].view(torch.uint8), pair[1]


@pytest.mark.parametrize("row_tiles, weight_blocks, token_blocks",
                         [((8, 2), (2,), (16, 2)), ((64, 8), (4,), (128, 8))])
def test_launch_shapes_agree(row_tiles, weight_blocks, token_blocks):
    """``config=`` other than the default gives the same codes and factors, for the row
    tiles, the weight blocks and the (transposed) token blocks."""
    t = _mixed(150, 300).to(DEVICE)
    w = _mixed(2, 200, 130).to(DEVICE)
    sizes = torch.tensor([0, 1, 129, 17], device=DEVICE)
    pairs = [(qb.quantize_row_tiles(t, E4M3, False, config=row_tiles),
              qb.quantize_row_tiles(t, E4M3, False)),
             (qb.quantize_weight_blocks(w, E4M3, True, config=weight_blocks),
              qb.quantize_weight_blocks(w, E4M3, True))]
    for transpose in (False, True):
        pairs.append((qb.quantize_token_blocks(t, sizes, E4M3, False, transpose=transpose,
                                               config=token_blocks),
                      qb.quantize_token_blocks(t, sizes, E4M3, False, transpose=transpose)))
    for got, want in pairs:
        for a, b in zip(_bits(got), _bits(want), strict=True):
            assert torch.equal(a, b)

# --------------------------------------------------------------------------- weight blocks
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape, magnitude", [((2, 200, 130), 1.0), ((1, 128, 128), 1e4),
                                              ((3, 40, 260), 1e-4)])
def test_weight_blocks(fp8, pow2, shape, magnitude):
    w = _mixed(*shape, scale=magnitude)
    w[0, :, 128:] = 0  # all-zero blocks when K > 128
    w = w.to(DEVICE)
    data, inv = qb.quantize_weight_blocks(w, fp8, pow2)
    ref = qb.quantize_weight_blocks_reference(w, fp8, pow2)
    _check_pair((data, inv), ref, fp8)
    G, N, K = shape
    assert inv.shape == (G, -(-N // 128), -(-K // 128))
    if K > 128:
        assert torch.all(inv[0, :, 1:] == 1)
    emulated = qe.fake_quant_weight_blocks(w, fp8, pow2)
    assert _same(_weight_dequant(*ref), emulated)
    assert _dequant_same(_weight_dequant(data, inv), emulated, data, ref[0])


def test_weight_blocks_strided():
    w = _mixed(2, 150, 140).to(DEVICE).transpose(1, 2)  # (2, 140, 150), not contiguous
    data, inv = qb.quantize_weight_blocks(w, E4M3, False)
    ref = qb.quantize_weight_blocks_reference(w, E4M3, False)
    _check_pair((data, inv), ref, E4M3)
    emulated = qe.fake_quant_weight_blocks(w, E4M3, False)
    assert _same(_weight_dequant(*ref), emulated)
    assert _dequant_same(_weight_dequant(data, inv), emulated, data, ref[0])


# --------------------------------------------------------------------------- token blocks
def _token_blocks_loop(sizes: list[int], M: int, tile: int) -> list[tuple[int, int]]:
    """``(start, end)`` rows of each global block, written out group by group."""
    blocks, start = [], 0
    for size in sizes:
        end = min(start + max(size, 0), M)
        blocks.extend((r, min(r + tile, end)) for r in range(start, end, tile))
        start = end
    return blocks


def _clamped_offsets(sizes: list[int], M: int) -> torch.Tensor:
    return torch.tensor(sizes).clamp(min=0).cumsum(0).clamp(max=M)


def _check_token_blocks(t, sizes, fp8, pow2, tile=128):
    M, C = t.shape
    sizes_t = torch.tensor(sizes, dtype=torch.int32, device=t.device)
    data, inv = qb.quantize_token_blocks(t, sizes_t, fp8, pow2, tile)
    ref = qb.quantize_token_blocks_reference(t, sizes_t, fp8, pow2, tile)
    _check_pair((data, inv), ref, fp8)
    assert inv.shape == (-(-M // tile) + len(sizes), C)
    blocks = _token_blocks_loop(sizes, M, tile)
    used = blocks[-1][1] if blocks else 0
    index = qb.token_block_index(sizes_t, M, tile).cpu()
    expected = torch.full((M,), qb.num_token_blocks(M, len(sizes), tile), dtype=torch.int64)
    for b, (r0, r1) in enumerate(blocks):
        expected[r0:r1] = b
    assert torch.equal(index, expected)
    assert torch.all(data[used:].float() == 0)
    assert torch.all(inv[len(blocks):] == 1)
    emulated = qe.fake_quant_row_tiles(t, _clamped_offsets(sizes, M).to(t.device), fp8, pow2, tile)
    emulated = emulated.cpu()[:used]
    assert _same(_token_dequant(*ref, index)[:used], emulated)
    assert _dequant_same(_token_dequant(data, inv, index)[:used], emulated, data[:used], ref[0][:used])
    return data, inv


@pytest.mark.parametrize("fp8, pow2", [(E4M3, False), (E5M2, True)])  # the others: below
@pytest.mark.parametrize("sizes, tail", [([0, 1, 129, 130, 0], 5), ([300], 0), ([3, 0, 70], 200),
                                         ([-4, 129, 0], 40)])
def test_token_blocks(fp8, pow2, sizes, tail):
    M = sum(max(s, 0) for s in sizes) + tail
    t = _mixed(M, 70).to(DEVICE)
    _check_token_blocks(t, sizes, fp8, pow2)


@pytest.mark.parametrize("magnitude", [1e4, 1e-4])
def test_token_blocks_magnitudes_and_zeros(magnitude):
    sizes = [129, 0, 60, 10]
    t = _mixed(sum(sizes), 70, scale=magnitude)
    t[129:189] = 0  # group 2: one all-zero block
    data, inv = _check_token_blocks(t.to(DEVICE), sizes, E4M3, False)
    assert torch.all(inv[2] == 1)


def test_token_blocks_sizes_over_rows():
    t = _mixed(200, 40).to(DEVICE)
    _check_token_blocks(t, [150, 100, 7, -1, 30], E4M3, True)  # clamped to M: last groups empty


def test_token_blocks_small_tile_and_strided_bf16():
    t = _mixed(90, 260).to(torch.bfloat16).to(DEVICE).t()  # (260, 90), column-major
    _check_token_blocks(t, [1, 100, 0, 33, 110], E5M2, False, tile=48)


def test_token_blocks_degenerate():
    _check_token_blocks(_mixed(7, 30).to(DEVICE), [0, 0], E4M3, False)  # every row is tail
    data, inv = qb.quantize_token_blocks(torch.zeros(0, 5, device=DEVICE),
                                         torch.tensor([0, 0, 0], device=DEVICE), E4M3, False)
    assert data.shape == (0, 5) and inv.shape == (3, 5) and torch.all(inv == 1)
    t = _mixed(10, 8).to(DEVICE)
    data, inv = qb.quantize_token_blocks(t, torch.zeros(0, dtype=torch.int64, device=DEVICE), E4M3,
                                         False)
    assert torch.all(data.float() == 0) and inv.shape == (1, 8) and torch.all(inv == 1)


@pytest.mark.parametrize("sizes, tail", [([0, 1, 129, 130, 0], 5), ([300], 0), ([50, 90], -20),
                                         ([0, 0], 7)])
def test_token_blocks_transposed_layout(sizes, tail):
    """Each row of a group at its block's column, every other column zero."""
    M, C = sum(sizes) + tail, 70
    t = (torch.randn(M, C) * 7).to(DEVICE)
    size_tensor = torch.tensor(sizes, device=DEVICE)
    data, inv = qb.quantize_token_blocks(t, size_tensor, E4M3, False)
    data_t, inv_t = qb.quantize_token_blocks(t, size_tensor, E4M3, False, transpose=True)
    blocks = qb.num_token_blocks(M, len(sizes))
    assert data_t.shape == (C, blocks * 128) and data_t.stride(1) == 1
    assert torch.equal(inv_t, inv)
    columns = qb.token_block_columns(size_tensor, M).cpu()
    blocks_loop = _token_blocks_loop(sizes, M, 128)
    expected = torch.full((M,), -1, dtype=torch.int64)
    for b, (r0, r1) in enumerate(blocks_loop):
        expected[r0:r1] = torch.arange(b * 128, b * 128 + r1 - r0)
    assert torch.equal(columns, expected)
    used = columns >= 0
    assert torch.equal(data_t.float().cpu()[:, columns[used]], data.float().cpu()[used].t())
    rest = torch.ones(blocks * 128, dtype=torch.bool)
    rest[columns[used]] = False
    assert torch.all(data_t.float().cpu()[:, rest] == 0)
