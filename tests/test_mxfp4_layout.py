"""The shift layout of MXFP4 codes (kimiserve/ops/moe/mxfp4_layout.py) in plain torch: the re-layout is a
bijection, and decoding it the way the kernel does (per output pair: rotate, mask, read the bf16, times
2^(s - 1)) gives dequantize_mxfp4 of the checkpoint codes exactly. The Triton decode itself is checked
in tests/test_triton_moe_interpret.py (interpreter) and tests/test_triton_moe.py (the PTX, on a GPU)."""

import pytest
import torch

from kimiserve.ops.moe.mxfp4_layout import (MAG_MASK, MAX_SHIFT_SCALE, SHIFT_PAIRS, SIGN_MASK, from_shift_layout,
                                            to_shift_layout)
from kimiserve.ops.quant.reference import dequantize_mxfp4


def rotl(w: torch.Tensor, d: int) -> torch.Tensor:
    return ((w << d) | (w >> (32 - d))) & 0xFFFFFFFF if d else w


def decode_shift_layout(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed (shift layout) uint8 [..., in/2], ue8m0 scales [..., in/32] -> fp32 [..., in], as the kernel."""
    w = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    values = []
    for dm, ds in SHIFT_PAIRS:  # output pair i: codes 2i (low bf16), 2i + 1 (high bf16)
        o = (rotl(w, dm) & MAG_MASK) | (rotl(w, ds) & SIGN_MASK)
        for half in (0, 1):
            bits = ((o >> (16 * half)) & 0xFFFF) << 16  # the bf16 as an fp32 (2^-127 is an fp32 subnormal)
            values.append((bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32))
    codes = torch.stack(values, -1).reshape(*packed.shape[:-1], -1)  # e2m1 value x 2^-126
    scale = torch.pow(2.0, scales.double() - 1).repeat_interleave(32, -1)
    return (codes.double() * scale).float()


def test_round_trip_and_every_bit_moves():
    codes = torch.randint(0, 256, (4, 9, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    shifted = to_shift_layout(codes)
    assert shifted.shape == codes.shape and shifted.dtype == torch.uint8
    assert torch.equal(from_shift_layout(shifted), codes)
    one_bit = (torch.tensor([1], dtype=torch.int64) << torch.arange(32)).to(torch.int64)
    words = (one_bit - ((one_bit >> 31) << 32)).to(torch.int32).view(torch.uint8).view(32, 4)
    moved = to_shift_layout(words).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert sorted(int(m).bit_length() - 1 for m in moved) == list(range(32))  # a permutation of the 32 bits


def test_decode_equals_dequantize_every_code_pair_and_scale():
    codes = torch.arange(256, dtype=torch.uint8).repeat(MAX_SHIFT_SCALE + 1, 1)  # every byte = code pair
    scales = torch.arange(MAX_SHIFT_SCALE + 1, dtype=torch.uint8)[:, None].repeat(1, 16)
    got = decode_shift_layout(to_shift_layout(codes, scales), scales)
    assert torch.equal(got, dequantize_mxfp4(codes, scales, torch.float32))


def test_bad_inputs():
    codes = torch.randint(0, 256, (3, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale bytes <= 128"):
        to_shift_layout(codes, torch.full((3, 1), MAX_SHIFT_SCALE + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="divisible by 4"):
        to_shift_layout(codes[:, :6])
    with pytest.raises(ValueError, match="uint8"):
        to_shift_layout(codes.float())
