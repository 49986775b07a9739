"""The Gluon writer of the weight gradient's transposed FP8 operand (128-aligned groups)
against the Triton kernel it stands in for, bit for bit, on sm90; its reference against the
Triton kernel everywhere.

Gluon has no CPU interpreter: CI compiles the kernel for sm90
(tests/kernels/test_compiles_for_sm90.py) and checks here that
:func:`~grouped_linear.kernels.quantize.transposed.quantize_columns_t` hands the writer what
the Triton kernel would have taken, by running the writer's reference in its place.
"""

import pytest
import torch

from grouped_linear.kernels.quantize import transposed as qt
from grouped_linear.kernels.quantize import transposed_gluon as qtg
from grouped_linear.kernels.quantize.rows import quantize_rows
from tests.hardware import sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
ALIGN = qtg.TILE


def _operand(M, C, dtype=torch.bfloat16):
    """Values over several orders of magnitude, per column and per row."""
    t = torch.randn(M, C) * torch.logspace(-2, 2, C) * torch.logspace(1, -1, M)[:, None]
    return t.to(dtype).to(DEVICE)


def _ends(sizes, tail=0):
    """``(G,)`` int32 ends of ``sizes`` on the device, and the rows (``tail`` past them)."""
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    return ends, sum(sizes) + tail


def _calls(t, ends, scaling, factors=None, group_scale=None, pow2=False):
    """The transposed operand and factors as the wgrad asks for them (``scaling``: amax,
    group or unit)."""
    if scaling == "unit":
        return qt.transpose_group_columns(t, ends, ALIGN), None
    data, inv, _ = qt.quantize_group_columns_t(t, ends, E4M3, pow2, group_scale, align=ALIGN,
                                               row_factors=factors)
    return data, inv


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


CASES = [([0, 1, 129, 130, 0], 5, 200),  # C % 128 != 0, empty groups, a tail
         ([3000, 1000], 0, 1024),
         ([0, 0], 7, 128),  # every row is tail
         ([255, 257, 1, 600], 130, 384)]


def _inputs(sizes, tail, C, scaling):
    ends, M = _ends(sizes, tail)
    t = _operand(M, C)
    if scaling == "unit":
        t, _ = quantize_rows(t, E4M3, False)
    factors = torch.rand(M, device=DEVICE) + 0.5
    group_scale = torch.rand(len(sizes), device=DEVICE) * 4 + 0.25
    return t, ends, factors, group_scale


def _variants(t, ends, factors, group_scale, scaling, pow2):
    if scaling == "amax":
        return [_calls(t, ends, "amax", pow2=pow2), _calls(t, ends, "amax", factors, pow2=pow2)]
    if scaling == "group":
        return [_calls(t, ends, "group", group_scale=group_scale)]
    return [_calls(t, ends, "unit")]


@pytest.mark.parametrize("scaling", qtg.SCALINGS)
@pytest.mark.parametrize("sizes, tail, C", CASES[:2])
def test_the_writer_takes_what_the_triton_kernel_takes(monkeypatch, scaling, sizes, tail, C):
    """With the writer's reference standing in for the kernel (every device), the operand
    and factors equal the Triton kernel's (the interpreter's on CPU)."""
    inputs = _inputs(sizes, tail, C, scaling)
    want = _variants(*inputs, scaling, False)
    calls = []

    def writer(t, ends, data, scaling, scale, inv, factors, fp8_dtype, power_of_two):
        calls.append(scaling)
        qtg.write_columns_t_reference(t, ends, data, scaling, scale, inv, factors, fp8_dtype,
                                      power_of_two)

    monkeypatch.setattr(qtg, "supported", lambda t, data, align, groups: align == ALIGN)
    monkeypatch.setattr(qtg, "write_columns_t", writer)
    got = _variants(*inputs, scaling, False)
    assert calls == [scaling] * len(want)
    for (data, inv), (want_data, want_inv) in zip(got, want):
        assert data.shape == want_data.shape and data.dtype == want_data.dtype
        # the layout's width past the groups: zeros in both
        assert torch.equal(_bytes(data), _bytes(want_data))
        if inv is not None:
            torch.testing.assert_close(inv, want_inv, rtol=2e-7, atol=0)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("scaling", qtg.SCALINGS)
@pytest.mark.parametrize("sizes, tail, C", CASES)
@pytest.mark.parametrize("pow2", [False, True])
def test_the_gluon_writer_equals_the_triton_kernel(monkeypatch, scaling, sizes, tail, C, pow2):
    inputs = _inputs(sizes, tail, C, scaling)
    t = inputs[0]
    data = torch.empty(C, 16, device="cuda", dtype=E4M3)
    # TMA reads whole 16-byte rows: FP8 codes (``unit``) of 200 columns are the Triton kernel's
    assert qtg.supported(t, data, ALIGN, len(sizes)) == (C * t.element_size() % 16 == 0)
    got = _variants(*inputs, scaling, pow2)
    monkeypatch.setattr(qtg, "supported", lambda t, data, align, groups: False)
    want = _variants(*inputs, scaling, pow2)
    for (data, inv), (want_data, want_inv) in zip(got, want):
        assert data.shape == want_data.shape and data.dtype == E4M3
        assert torch.equal(_bytes(data), _bytes(want_data))
        if inv is not None:
            assert torch.equal(inv, want_inv)


@pytest.mark.gpu
@sm90
def test_many_groups_and_wide_rows(monkeypatch):
    """128 skewed groups (many partial blocks), more blocks than programs per wave, rows
    folded by factors."""
    generator = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 300, (128,), generator=generator).tolist()
    ends, M = _ends(sizes, 64)
    t = _operand(M, 2048)
    factors = torch.rand(M, device=DEVICE) + 0.5
    got = _calls(t, ends, "amax", factors)
    monkeypatch.setattr(qtg, "supported", lambda t, data, align, groups: False)
    want = _calls(t, ends, "amax", factors)
    assert torch.equal(_bytes(got[0]), _bytes(want[0]))
    assert torch.equal(got[1], want[1])
