"""The FP8 grouped GEMMs of the rowwise recipes as the kernels layer calls them (torch's, and
the Gluon kernel on FP8 tiles), against dequantized float32."""

import pytest
import torch

from grouped_linear.kernels.gemm import fp8_gluon_gemm
from grouped_linear.kernels.gemm import fp8_torch_gemm as fp8_gemm
from grouped_linear.kernels.quantize import folded as qf
from grouped_linear.kernels.quantize import rows as q
from grouped_linear.kernels.quantize.transpose import transpose_groups
from tests.reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and fp8_gemm.available(torch.device("cuda"))),
                       reason="needs an sm90 GPU"),
]
E4M3 = torch.float8_e4m3fn


def _operands(sizes, tail, K, N):
    """Group ends, ``dy`` and the weight in bf16; ``x`` quantized per row, the weight per
    output channel."""
    M, G = sum(sizes) + tail, len(sizes)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    return (offsets, dy, w, *q.quantize_rows(x, E4M3, False),
            *q.quantize_weight_rows(w, E4M3, False))


@pytest.mark.parametrize("sizes, tail", [([100, 0, 333, 79, 512], 11), ([1, 15, 0, 17], 0),
                                         ([0, 0, 64], 3)])
def test_forward_and_dgrad_against_dequantized_float32(sizes, tail):
    G, K, N = len(sizes), 96, 64
    M = sum(sizes) + tail
    offsets, dy, w, x_data, x_inv, w_data, w_inv = _operands(sizes, tail, K, N)
    y = fp8_gemm.forward(x_data, x_inv, w_data, w_inv, offsets, torch.bfloat16)
    want = fp8_gemm.dequantized_reference(x_data, x_inv, w_data, w_inv, offsets)
    rows = sum(sizes)
    assert rel_err(y[:rows], want[:rows]) < 1e-2
    # dgrad as Float8Rowwise runs it: the forward copy transposed, its factors folded into dy
    folded = qf.ColumnFactors.of_groups(w_inv, offsets, M)
    dy_data, dy_inv = qf.quantize_rows_folded(dy, folded, E4M3, False)
    wt_data = transpose_groups(w_data)
    wt_inv = torch.ones(G, K, device="cuda")
    dx = fp8_gemm.dgrad(dy_data, dy_inv, wt_data, wt_inv, offsets, torch.bfloat16)
    want = fp8_gemm.dequantized_reference(dy_data, dy_inv, wt_data, wt_inv, offsets)
    assert rel_err(dx[:rows], want[:rows]) < 1e-2
    starts = [sum(sizes[:g]) for g in range(G)]
    exact = torch.cat([dy[s:s + n].double() @ w[g].double() for g, (s, n) in
                       enumerate(zip(starts, sizes))])
    assert rel_err(dx[:rows], exact) < 6e-2


def test_format_pairs_are_probed_once():
    assert fp8_gemm.gemm_accepts(E4M3, E4M3, torch.cuda.current_device())
    print("e5m2 x e4m3 accepted:", fp8_gemm.gemm_accepts(torch.float8_e5m2, E4M3,
                                                         torch.cuda.current_device()))


@pytest.mark.parametrize("sizes, tail", [([100, 0, 333, 79, 512], 11), ([1, 15, 0, 17], 0),
                                         ([0, 0, 300], 3), ([2048, 0, 1536], 0)])
@pytest.mark.parametrize("K, N", [(256, 64), (2048, 768), (768, 2048), (384, 200)])
def test_gluon_rowwise_against_dequantized_float32_and_torch(sizes, tail, K, N):
    """Forward with per-channel and with per-group (stride 0) weight factors, and the dgrad
    on the transposed copy: within 1e-2 of the dequantized float32 product and of torch's
    GEMM (both accumulate in the tensor cores), rows past the groups zero."""
    G, M, rows = len(sizes), sum(sizes) + tail, sum(sizes)
    offsets, dy, _w, x_data, x_inv, w_data, w_inv = _operands(sizes, tail, K, N)
    group_inv = w_inv.amax(1)  # any positive per-group factor, repeated along N
    for factors in (w_inv, group_inv[:, None].expand(G, N)):
        assert fp8_gluon_gemm.rowwise_supported(x_data, w_data)
        y = fp8_gluon_gemm.rowwise_mm(x_data, x_inv, w_data, factors, offsets, torch.bfloat16)
        want = fp8_gemm.dequantized_reference(x_data, x_inv, w_data, factors.contiguous(),
                                              offsets)
        assert rel_err(y[:rows], want[:rows]) < 1e-2
        assert torch.all(y[rows:] == 0)
        if fp8_gemm.shapes_supported(K, N):  # torch's GEMM wants 16-byte output rows too
            theirs = fp8_gemm.forward(x_data, x_inv, w_data, factors.contiguous(), offsets,
                                      torch.bfloat16)
            assert rel_err(y[:rows], theirs[:rows]) < 1e-2
    # the bias added to the scaled float32 tile (rows past the groups stay zero)
    bias = torch.randn(G, N, device="cuda", dtype=torch.bfloat16)
    y = fp8_gluon_gemm.rowwise_mm(x_data, x_inv, w_data, w_inv, offsets, torch.bfloat16, bias)
    want = fp8_gemm.dequantized_reference(x_data, x_inv, w_data, w_inv, offsets)
    want[:rows] += torch.repeat_interleave(bias.float(), torch.tensor(sizes, device="cuda"), 0)
    assert rel_err(y[:rows], want[:rows]) < 1e-2
    assert torch.all(y[rows:] == 0)
    folded = qf.ColumnFactors.of_groups(w_inv, offsets, M)
    wt_data = transpose_groups(w_data)
    wt_inv = torch.ones(G, K, device="cuda")
    for dy_format in (E4M3, torch.float8_e5m2):  # E5M2: the hybrid format's gradients
        dy_data, dy_inv = qf.quantize_rows_folded(dy, folded, dy_format, False)
        if N % 16 == 0 and N > 128:  # TMA rows; the pipeline needs two 128-deep blocks
            dx = fp8_gluon_gemm.rowwise_mm(dy_data, dy_inv, wt_data, wt_inv, offsets,
                                           torch.bfloat16)
            want = fp8_gemm.dequantized_reference(dy_data, dy_inv, wt_data, wt_inv, offsets)
            assert rel_err(dx[:rows], want[:rows]) < 1e-2
            assert torch.all(dx[rows:] == 0)
        else:
            assert not fp8_gluon_gemm.rowwise_supported(dy_data, wt_data)
