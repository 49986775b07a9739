"""FP8 fake quantization against a per-unit loop written here."""

import pytest
import torch

from grouped_linear.kernels import bias as bias_kernels
from grouped_linear.kernels.ends import aligned_ends_reference
from grouped_linear.kernels.quantize import common as qc
from grouped_linear.kernels.quantize import emulate as qe
from grouped_linear.kernels.quantize import groups as qg
from grouped_linear.kernels.quantize import rows as q
from grouped_linear.kernels.quantize import transposed as qt
from grouped_linear.kernels.quantize.transpose import transpose_groups, transpose_groups_reference
from tests.reference import codes_close, rel_err

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _unit(values, fp8, pow2):
    """One scaling unit: scale (float32) = fp8_max / amax, saturate, round, divide back."""
    amax = values.abs().max().float() if values.numel() else torch.tensor(0.0)
    fmax = torch.finfo(fp8).max
    scale = torch.tensor(fmax, dtype=torch.float32) / amax if amax > 0 else torch.tensor(1.0)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (values.float() * scale).clamp(-fmax, fmax).to(fp8).float() / scale


SIZES = [3, 0, 5, 1]


def _same(a, b):
    """Equal up to the last bit of the float32 scale (torch divides a scalar by a tensor
    through the reciprocal, so scales may differ by one ulp)."""
    return torch.allclose(a, b, rtol=1e-6, atol=0)


def _bounds():
    b = [0]
    for s in SIZES:
        b.append(b[-1] + s)
    return b


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_rows_groups_group_columns(fp8, pow2):
    t = torch.randn(sum(SIZES) + 2, 6) * torch.logspace(-3, 3, 6)  # columns of mixed range
    offsets = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    b = _bounds()
    got_rows = qe.fake_quant_rows(t, fp8, pow2)
    for i in range(t.shape[0]):
        assert _same(got_rows[i], _unit(t[i], fp8, pow2))
    got_groups = qe.fake_quant_groups(t, offsets, fp8, pow2)
    got_cols = qe.fake_quant_group_columns(t, offsets, fp8, pow2)
    for g in range(len(SIZES)):
        assert _same(got_groups[b[g]:b[g + 1]], _unit(t[b[g]:b[g + 1]], fp8, pow2))
        for c in range(t.shape[1]):
            assert _same(got_cols[b[g]:b[g + 1], c], _unit(t[b[g]:b[g + 1], c], fp8, pow2))


@pytest.mark.parametrize("dim", [2, 1, None])
def test_weight_units(dim):
    w = torch.randn(3, 4, 5) * 100
    got = qe.fake_quant_weight(w, dim, E4M3, False)
    for g in range(3):
        if dim is None:  # one scale per group
            assert _same(got[g], _unit(w[g], E4M3, False))
        elif dim == 2:  # per output channel: amax over K
            for n in range(w.shape[1]):
                assert _same(got[g, n], _unit(w[g, n], E4M3, False))
        else:  # per input channel: amax over N
            for k in range(w.shape[2]):
                assert _same(got[g, :, k], _unit(w[g, :, k], E4M3, False))


def test_zeros_and_extremes_stay_finite():
    t = torch.zeros(4, 3)
    t[1] = 3e38
    t[2, 0] = 1e-40  # subnormal in float32
    out = qe.fake_quant_rows(t, E4M3, False)
    assert torch.isfinite(out).all() and torch.all(out[0] == 0)
    assert torch.allclose(out[1], t[1], rtol=0.07)
    assert torch.isfinite(qc.scale_from_amax(torch.tensor([0.0, 1e-45, 1e38]), E4M3, True)).all()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(7, 40), (5, 1500), (0, 8)])
def test_quantize_rows_kernel(fp8, pow2, shape):
    t = (torch.randn(*shape) * torch.logspace(-2, 2, shape[1])).to(DEVICE)
    if shape[0]:
        t[0] = 0
    data, inv = q.quantize_rows(t, fp8, pow2)
    ref_data, ref_inv = q.quantize_rows_reference(t, fp8, pow2)
    assert data.dtype == fp8 and inv.shape == (shape[0],)
    assert torch.allclose(inv, ref_inv, rtol=1e-6) and codes_close(data, ref_data)
    assert torch.isfinite(inv).all()



@pytest.mark.parametrize("config", [(4, 256, 4), (1, 1024, 2)])
@pytest.mark.parametrize("shape", [(7, 40), (5, 1500)])
def test_quantize_rows_launch_shapes_agree(config, shape):
    """``config=`` (rows per program, columns per block, warps) other than the default: the
    same codes and factors (one column block per row, or several)."""
    t = (torch.randn(*shape) * torch.logspace(-2, 2, shape[1])).to(DEVICE)
    data, inv = q.quantize_rows(t, E4M3, False, config=config)
    ref_data, ref_inv = q.quantize_rows(t, E4M3, False)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(inv, ref_inv)

@pytest.mark.parametrize("sizes, tail", [([3, 0, 70, 1], 5), ([0, 0], 3), ([33], 0)])
def test_quantize_group_columns_transposed_kernel(sizes, tail):
    M, C = sum(sizes) + tail, 70
    t = (torch.randn(M, C) * 10).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    data, inv, data_offsets = qt.quantize_group_columns_t(t, offsets, E4M3, False)
    assert data_offsets is offsets
    ref_data, ref_inv = qt.quantize_group_columns_t_reference(t, offsets, E4M3, False)
    assert data.shape == (C, M) and inv.shape == (len(sizes), C)
    assert torch.allclose(inv, ref_inv, rtol=1e-6) and codes_close(data, ref_data)
    assert torch.all(data[:, sum(sizes):].float() == 0)
    # dequantized, the transposed copy reproduces t within FP8 precision
    bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
    for g in range(len(sizes)):
        block = data[:, bounds[g]:bounds[g + 1]].float() * inv[g][:, None]
        assert torch.allclose(block, t[bounds[g]:bounds[g + 1]].t().float(), rtol=0.07, atol=1e-6)


def _reference_columns(t, offsets, group_scale, align):
    """The plain-PyTorch transposed group-column quantization, each group moved to its
    ``align``-ed column start (as the kernels lay it out)."""
    data, inv = qt.quantize_group_columns_t_reference(t, offsets, E4M3, False, group_scale)
    if align == 1:
        return data, inv, offsets
    data_offsets = aligned_ends_reference(offsets, align).to(offsets.device)
    width = -(-(t.shape[0] + (align - 1) * offsets.shape[0]) // 16) * 16
    return qt._realign_columns(data, offsets, data_offsets, width), inv, data_offsets


@pytest.mark.parametrize("tiled_config, sub_tiles", [((16, 16, 4), 1), ((16, 32, 4), 3),
                                                     ((32, 16, 4), 4)])
@pytest.mark.parametrize("align", [1, 16])
def test_tiled_columns_with_groups_over_many_tiles(tiled_config, sub_tiles, align):
    """Small tiles: groups span several row tiles and amax sub-tiles, alignment padding and
    the tail span tiles of their own; the tiles equal the plain-PyTorch reference."""
    sizes, tail = [37, 0, 5, 70, 16], 9
    M, C = sum(sizes) + tail, 40
    t = (torch.randn(M, C) * torch.logspace(-2, 2, C)).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    sums = torch.full((len(sizes), C), float("nan"), device=DEVICE)
    data, inv, data_offsets = qt.quantize_group_columns_t(
        t, offsets, E4M3, False, align=align, column_sums=sums,
        config=qt.TiledConfig(*tiled_config, amax_sub_tiles=sub_tiles))
    ref_data, ref_inv, ref_offsets = _reference_columns(t, offsets, None, align)
    assert torch.equal(data_offsets.cpu(), ref_offsets.cpu())
    want_sums = bias_kernels.bias_grad_reference(t, offsets, torch.float64).float()
    # the sums come from the column-amax pass
    torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-4)
    end = int(data_offsets[-1])
    assert torch.allclose(inv, ref_inv, rtol=1e-6)  # scales computed by torch or in-kernel
    assert codes_close(data[:, :end], ref_data[:, :end])
    if align == 1:
        assert torch.all(data[:, end:].float() == 0)


def test_block_tiles_against_loops():
    t = torch.randn(5, 300) * torch.logspace(-3, 3, 300)
    got = qe.fake_quant_column_tiles(t, E4M3, False)
    for r in range(5):
        for c0 in range(0, 300, 128):
            assert _same(got[r, c0:c0 + 128], _unit(t[r, c0:c0 + 128], E4M3, False))
    w = torch.randn(2, 200, 130) * 50
    got_w = qe.fake_quant_weight_blocks(w, E4M3, False)
    for g in range(2):
        for n0 in range(0, 200, 128):
            for k0 in range(0, 130, 128):
                block = w[g, n0:n0 + 128, k0:k0 + 128]
                assert _same(got_w[g, n0:n0 + 128, k0:k0 + 128], _unit(block, E4M3, False))
    sizes = [300, 0, 5]
    rows = torch.randn(sum(sizes) + 4, 3) * 10
    got_r = qe.fake_quant_row_tiles(rows, torch.tensor(sizes).cumsum(0), E4M3, False)
    for start, end in ((0, 128), (128, 256), (256, 300), (300, 305)):  # never across groups
        for c in range(3):
            assert _same(got_r[start:end, c], _unit(rows[start:end, c], E4M3, False))


@pytest.mark.parametrize("pow2", [False, True])
def test_given_scales_replace_the_amax(pow2):
    sizes, tail, C = [5, 0, 9], 2, 40
    M = sum(sizes) + tail
    t = (torch.randn(M, C) * 30).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    group_scale = qg.group_amax_scales(t, offsets, E4M3, pow2)
    want = qc.scale_from_amax(torch.stack([t[0:5].abs().max(), t.new_tensor(0.0),
                                          t[5:14].abs().max()]), E4M3, pow2)
    assert torch.allclose(group_scale, want.to(DEVICE), rtol=1e-6)
    row_scale = torch.rand(M, device=DEVICE) * 4 + 0.5
    data, inv = q.quantize_rows(t, E4M3, pow2, row_scale)
    ref_data, ref_inv = q.quantize_rows_reference(t, E4M3, pow2, row_scale)
    assert torch.allclose(inv, 1 / row_scale) and torch.allclose(inv, ref_inv)
    assert codes_close(data, ref_data)
    data_t, inv_t, _ = qt.quantize_group_columns_t(t, offsets, E4M3, pow2, group_scale)
    ref_t, ref_inv_t = qt.quantize_group_columns_t_reference(t, offsets, E4M3, pow2, group_scale)
    assert inv_t.shape == (3, C) and torch.allclose(inv_t, ref_inv_t)
    assert torch.allclose(inv_t, (1 / group_scale)[:, None].expand(3, C))
    assert codes_close(data_t, ref_t)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("tensorwise", [False, True])
def test_weight_quantization_kernels(fp8, tensorwise):
    G, N, K = 3, 24, 40
    w = (torch.randn(G, N, K) * torch.logspace(-2, 2, K)).to(DEVICE)
    w[1] = 0  # an all-zero expert stays finite
    group_scale = qg.weight_group_scales(w, fp8, False)[0] if tensorwise else None
    fwd, fwd_inv = q.quantize_weight_rows(w, fp8, False, group_scale)
    ref_fwd, ref_fwd_inv = q.quantize_rows_reference(
        w.reshape(G * N, K), fp8, False,
        group_scale.repeat_interleave(N) if tensorwise else None)
    assert fwd.shape == (G, N, K) and fwd_inv.shape == (G, N)
    assert torch.allclose(fwd_inv.reshape(-1), ref_fwd_inv) and codes_close(fwd.reshape(G * N, K),
                                                                             ref_fwd)
    # dequantized, the copy reproduces the weight within FP8 precision
    tol = 0.07 if fp8 == E5M2 else 0.04
    assert rel_err(fwd.float() * fwd_inv[..., None], w) < tol
    if tensorwise:
        assert torch.allclose(fwd_inv, (1 / group_scale)[:, None].expand(G, N))
    assert torch.isfinite(fwd_inv).all()


@pytest.mark.parametrize("shape", [(3, 24, 40), (2, 130, 257), (1, 1, 5), (2, 0, 7)])
def test_transpose_groups_moves_every_byte(shape):
    data = torch.randint(0, 256, shape, dtype=torch.uint8).to(DEVICE)
    out = transpose_groups(data)
    assert out.shape == (shape[0], shape[2], shape[1]) and out.is_contiguous()
    assert torch.equal(out, transpose_groups_reference(data))
    codes = (torch.randn(shape) * 40).to(E4M3).to(DEVICE)
    assert torch.equal(transpose_groups(codes).view(torch.uint8),
                       codes.transpose(1, 2).contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match="1-byte"):
        transpose_groups(torch.zeros(2, 3, 4, device=DEVICE))


@pytest.mark.parametrize("sizes", [[3, 0, 17, 1, 16], [0, 0], [40], [150, 2, 0, 90]])
def test_group_columns_aligned_layout(sizes):
    M, C, align = sum(sizes) + 2, 70, 16
    t = (torch.randn(M, C) * 5).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    data, inv, aligned = qt.quantize_group_columns_t(t, offsets, E4M3, False, align=align)
    exact, exact_inv, _ = qt.quantize_group_columns_t_reference(t, offsets, E4M3, False) + (None,)
    padded_sizes = [-(-s // align) * align for s in sizes]
    assert aligned.tolist() == torch.tensor(padded_sizes).cumsum(0).tolist()
    assert data.shape == (C, -(-(M + (align - 1) * len(sizes)) // 16) * 16)
    assert torch.allclose(inv, exact_inv, rtol=1e-6)
    start = aligned_start = 0
    for size, padded in zip(sizes, padded_sizes):
        assert codes_close(data[:, aligned_start:aligned_start + size],
                            exact[:, start:start + size])
        assert torch.all(data[:, aligned_start + size:aligned_start + padded].float() == 0)
        start, aligned_start = start + size, aligned_start + padded


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("tensorwise", [False, True])
@pytest.mark.parametrize("one_launch", [True, False])
def test_quantizing_pieces_equals_quantizing_their_concatenation(align, tensorwise, one_launch,
                                                                 monkeypatch):
    """A list input quantized without concatenation (one launch reading every piece, or one
    launch per piece where the pieces' row strides differ) gives the plain-PyTorch
    quantization of the concatenated tensor: rows for forward, transposed group columns for
    wgrad. The pieces are views of one buffer in another order (so some lie before the
    first) and a separate tensor (a column slice of a wider one, for one launch per piece)."""
    sizes, C = [37, 0, 5, 70], 40
    scales = torch.logspace(-2, 2, C)
    buffer = torch.randn(5 + 37, C) * scales
    on_device = buffer.to(DEVICE)
    last = (torch.randn(70, C) * scales).to(DEVICE)
    if not one_launch:  # another row stride: no single launch reads all the pieces
        wide = torch.zeros(70, C + 8, device=DEVICE)
        wide[:, :C] = last
        last = wide[:, :C]
    pieces = [on_device[5:], on_device[5:5], on_device[:5], last]
    assert [piece.shape[0] for piece in pieces] == sizes
    whole = torch.cat(pieces)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    group_scale = qg.group_amax_scales(whole, offsets, E4M3, False) if tensorwise else None
    launches = []

    def counted(function, name):
        def wrapper(*args, **kwargs):
            if name != "quantize_rows" or "out" in kwargs:  # not quantize_rows' inner CPU call
                launches.append(name)
            return function(*args, **kwargs)
        return wrapper

    for module, name in ((q, "quantize_rows"), (qt, "quantize_columns_t")):
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    rows, rows_inv = q.quantize_rows_pieces(pieces, E4M3, False, group_scale, ends=offsets)
    row_scale = group_scale.repeat_interleave(torch.tensor(sizes, device=DEVICE)) \
        if tensorwise else None
    want_rows, want_rows_inv = q.quantize_rows_reference(whole, E4M3, False, row_scale)
    assert torch.allclose(rows_inv, want_rows_inv, rtol=1e-6)
    assert codes_close(rows, want_rows)
    data, inv = qt.quantize_group_columns_t_pieces(pieces, E4M3, False, group_scale, align,
                                                   ends=offsets, config=(16, 32, 4))
    # one launch: no per-piece calls, and one tiled column quantization for all the pieces
    per_piece = 3 if not one_launch else 0
    assert launches.count("quantize_rows") == per_piece
    assert launches.count("quantize_columns_t") == (per_piece or 1)
    want, want_inv, data_offsets = _reference_columns(whole, offsets, group_scale, align)
    end = int(data_offsets[-1])
    assert data.shape == want.shape and torch.allclose(inv, want_inv, rtol=1e-6)
    assert codes_close(data[:, :end], want[:, :end])


@pytest.mark.parametrize("align", [1, 16])
def test_group_columns_with_row_factors(align):
    """Rows multiplied by per-row factors before the per-(group, column) quantization: the
    kernels equal the reference on the folded rows (factors spanning 1e-6 to 1e6, one huge
    enough to saturate float32), while the column sums stay those of the unfolded rows."""
    sizes, tail = [37, 0, 5, 70, 16], 9
    M, C = sum(sizes) + tail, 40
    t = torch.randn(M, C).to(DEVICE)
    factors = torch.logspace(-6, 6, M)
    factors[50] = 1e38  # t * 1e38 passes float32's range: saturated, never inf
    factors = factors[torch.randperm(M)].to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    sums = torch.full((len(sizes), C), float("nan"), device=DEVICE)
    data, inv, data_offsets = qt.quantize_group_columns_t(t, offsets, E4M3, False, align=align,
                                                          column_sums=sums, row_factors=factors,
                                                          config=(16, 32, 4))  # many tiles
    folded = qt.fold_row_factors(t, factors)
    assert torch.isfinite(folded).all() and torch.isfinite(inv).all()
    ref_data, ref_inv, ref_offsets = _reference_columns(folded, offsets, None, align)
    assert torch.equal(data_offsets.cpu(), ref_offsets.cpu())
    assert torch.allclose(inv, ref_inv, rtol=1e-6)
    end = int(data_offsets[-1])
    assert codes_close(data[:, :end], ref_data[:, :end])
    want_sums = bias_kernels.bias_grad_reference(t, offsets, torch.float64).float()
    torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-4)
    plain, _, _ = qt.quantize_group_columns_t(t, offsets, E4M3, False, align=align)
    assert not codes_close(plain[:, :end], data[:, :end])  # the factors did change the codes


def test_group_columns_transpose_fp8_codes_exactly():
    """FP8 input with unit group scales: the transposed copy holds the same codes (the
    wgrad's activation operand, transposed from the forward's FP8 rows)."""
    sizes = [30, 0, 17, 51]
    M, C = sum(sizes) + 3, 48
    codes = (torch.randn(M, C) * 100).clamp(-448, 448).to(E4M3).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    ones = torch.ones(len(sizes), device=DEVICE)
    data, inv, _ = qt.quantize_group_columns_t(codes, offsets, E4M3, False, ones, align=1)
    assert torch.equal(data[:, :sum(sizes)].float(), codes[:sum(sizes)].float().t())
    assert torch.all(inv == 1)


@pytest.mark.parametrize("align", [1, 16, 128])
def test_transposing_fp8_codes_keeps_them_and_the_aligned_layout(align):
    """The codes' transpose lands where quantize_group_columns_t puts a group's columns
    (same aligned starts and width), holds the codes unchanged, and zeros the alignment and
    tail columns; with the aligned offsets given, the same result."""
    sizes = [30, 0, 17, 51, 1]
    M, C = sum(sizes) + 3, 48
    codes = (torch.randn(M, C) * 100).clamp(-448, 448).to(E4M3).to(DEVICE)
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    data = qt.transpose_group_columns(codes, offsets, align)
    layout, _, aligned = qt.quantize_group_columns_t(codes.float(), offsets, E4M3, False,
                                                     align=align)
    assert data.dtype == E4M3 and data.shape == layout.shape
    want = torch.zeros(C, data.shape[1])
    start, aligned_start = 0, 0
    for size in sizes:
        want[:, aligned_start:aligned_start + size] = codes[start:start + size].float().t().cpu()
        start += size
        aligned_start += -(-size // align) * align
    assert torch.equal(data.float().cpu(), want)
    again = qt.transpose_group_columns(codes, offsets, align, data_ends=aligned)
    assert torch.equal(again[:, :aligned_start].float(), data[:, :aligned_start].float())


def test_unit_factors_are_ones_of_the_shape():
    for shape in ((3, 5), (7,), (2, 4096)):
        factors = qc.unit_factors(shape, torch.device(DEVICE))
        assert factors.shape == shape and factors.dtype == torch.float32
        assert torch.all(factors == 1)
