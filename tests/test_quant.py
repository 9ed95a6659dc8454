import pytest
import torch

from conftest import rel_rms
from kimiserve.ops.quant.reference import dequantize_mxfp4, dequantize_nvfp4, hadamard, quantize_mxfp4, quantize_nvfp4


def test_mxfp4_codes_and_packing_layout():
    x = torch.zeros(32)
    x[:8] = torch.tensor([0.5, -1.0, 6.0, -6.0, 0.25, 0.75, 2.5, 5.0])
    packed, scale = quantize_mxfp4(x)
    assert scale.tolist() == [127]  # amax 6 -> 2^(2 + 0 - 2) = 1
    # element 2i in the low nibble: codes 0.5 -> 1, -1 -> 8|2, 6 -> 7, -6 -> 8|7, ties go to even codes
    assert packed[:4].tolist() == [1 | (10 << 4), 7 | (15 << 4), 0 | (2 << 4), 4 | (6 << 4)]
    assert dequantize_mxfp4(packed, scale)[:8].tolist() == [0.5, -1.0, 6.0, -6.0, 0.0, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e4])
def test_mxfp4_round_trip_error_bound(scale):
    w = torch.randn(7, 96) * scale
    w[0, :32] = 0.0  # an all-zero group
    w[1, 5] = scale * 1e3  # an outlier
    d = dequantize_mxfp4(*quantize_mxfp4(w))
    assert torch.equal(d[0, :32], torch.zeros(32))
    # per group: error <= half a step of the largest binade plus saturation of 6..8 x scale
    assert rel_rms(d[2:], w[2:]) < 0.15
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(d)), d)  # representable values are fixed points


def test_mxfp4_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(torch.tensor([float("nan")] * 32))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.randn(4, 33))


# NVFP4 ------------------------------------------------------------------------------------------
def test_nvfp4_row_layout():
    """8 code bytes per 16 values (element 2i in the low nibble), then one e4m3 scale per group."""
    x = torch.zeros(32)
    x[:4] = torch.tensor([6.0, -3.0, 0.5, 1.75])  # group 0: amax 6 -> scale e4m3(6 / 6) = 1.0
    x[16] = 12.0  # group 1: amax 12 -> scale 2.0, 12 / 2 = 6 -> code 7
    row = quantize_nvfp4(x, 1.0)
    assert row.shape == (18,) and row.dtype == torch.uint8
    assert row[:2].tolist() == [7 | ((8 | 5) << 4), 1 | (4 << 4)]  # 1.75 is a tie of 1.5 and 2: even code 4
    assert row[16:].view(torch.float8_e4m3fn).float().tolist() == [1.0, 2.0]
    assert dequantize_nvfp4(row, 1.0)[[0, 1, 2, 3, 16]].tolist() == [6.0, -3.0, 0.5, 2.0, 12.0]


@pytest.mark.parametrize("g", [1.0, 0.05, 1 / 2688])
@pytest.mark.parametrize("D", [16, 40, 576])
def test_nvfp4_round_trip_error_bound(g, D):
    """|x - x'| <= 1 code step of the top binade (2 x the e2m1 unit) / 2 = the block scale, and the
    block scale is amax / 6 rounded to e4m3 (<= 2^-4 relative): err <= amax / 6 * (1 + 2^-4)."""
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(9, D, generator=gen) * g * 40 * torch.rand(9, 1, generator=gen).add(0.05)
    x[0] = 0.0  # all-zero groups
    x[1, 3] *= 50  # an outlier in its group
    d = dequantize_nvfp4(quantize_nvfp4(x, g), g, torch.float32, D)
    assert d.shape == x.shape and torch.equal(d[0], torch.zeros(D))
    pad = -D % 16
    groups = torch.nn.functional.pad(x, (0, pad)).view(9, -1, 16)
    amax = groups.abs().amax(-1, keepdim=True).expand(-1, -1, 16).reshape(9, -1)[:, :D]
    assert ((d - x).abs() <= amax / 6 * (1 + 2**-4) * (1 + 1e-6)).all()
    assert rel_rms(d[1:], x[1:]) < 0.12
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(d, g), g, torch.float32, D), d)  # fixed points


def test_nvfp4_huge_and_tiny_values():
    g = 1.0
    huge = torch.full((16,), 1e6)
    huge[1] = -1e7
    d = dequantize_nvfp4(quantize_nvfp4(huge, g), g)
    assert d.abs().max() == 448 * 6 * g and d[1] == -448 * 6  # the scale saturates at 448, codes at 6
    tiny = torch.full((16,), 1e-30)
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(tiny, g), g), torch.zeros(16))  # scale underflows: zeros


def test_nvfp4_rejects_bad_input():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize_nvfp4(torch.tensor([1.0] * 15 + [bad]), 1.0)
    with pytest.raises(ValueError, match="global scale"):
        quantize_nvfp4(torch.ones(16), 0.0)
    with pytest.raises(ValueError, match="NVFP4 rows"):
        dequantize_nvfp4(torch.zeros(10, dtype=torch.uint8), 1.0)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_nvfp4(torch.zeros(9, dtype=torch.uint8), 1.0, dim=17)


def test_hadamard_is_orthonormal_and_symmetric():
    for n in (1, 2, 16, 128):
        h = hadamard(n, torch.float64)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64)) and torch.equal(h, h.T)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(24)


def test_ue8m0_powers_of_two_are_exact():
    """Every MXFP4 scale byte (0: the subnormal 2^-127; 255: inf, read as NaN by the scan) is the
    exact fp32 power of two, whatever exp2 would round to on the device."""
    from kimiserve.ops.quant.reference import _pow2

    b = torch.arange(256, dtype=torch.uint8)
    want = torch.ldexp(torch.ones(256, dtype=torch.float64), b.double() - 127).float()
    assert torch.equal(_pow2(b), want)
