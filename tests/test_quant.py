import pytest
import torch

from conftest import rel_rms
from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4


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
