"""The shift layout of MXFP4 codes (kimiserve/ops/moe/mxfp4_layout.py) in plain torch: the re-layout is a
bijection, and decoding it the way the kernel does (per output pair: rotate, mask, read the bf16, times
2^(s - 1)) gives dequantize_mxfp4 of the checkpoint codes exactly, and so does the kernels' PTX text run by a
small emulator of its instructions. The Triton decode itself is checked in tests/test_triton_moe_interpret.py
(interpreter) and tests/test_triton_moe.py (the PTX, on a GPU)."""

import re

import pytest
import torch

from kimiserve.ops.moe.mxfp4_layout import (MAG_MASK, MAX_SHIFT_SCALE, SHIFT_PAIRS, SIGN_MASK, from_shift_layout,
                                            shift_decode_ptx, to_shift_layout)
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


def run_ptx(ptx: str, word: torch.Tensor, scale_pair: torch.Tensor) -> torch.Tensor:
    """Emulate `shift_decode_ptx`'s instructions on uint32 words (int64 tensors) -> [..., 8] fp32 ($0..$7)."""
    regs = {"$8": word & 0xFFFFFFFF, "$9": scale_pair & 0xFFFFFFFF}
    out = {}

    def val(x):
        return regs[x] if x in regs else torch.full_like(word, int(x, 0))

    def bf16(bits):  # 16-bit patterns -> their bf16 values as fp64 (exact)
        b = (bits << 16).to(torch.int64)
        return (b - ((b >> 31) << 32)).to(torch.int32).view(torch.float32).double()

    def to_bits(x):
        return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF

    body = [ln.strip() for ln in ptx.strip("{}\n").splitlines() if ln.strip() and not ln.startswith(".reg")]
    for line in body:
        op, args = line.rstrip(";").split(None, 1)
        if op == "mov.b32" and args.startswith("{"):
            lo, hi, src = re.match(r"\{(\$\d), (\$\d)\}, (\w+)", args).groups()
            out[lo], out[hi] = bf16(regs[src] & 0xFFFF), bf16(regs[src] >> 16)
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << int(src[1])) & 0xFFFFFFFF
        elif op == "shf.l.wrap.b32":  # funnel shift of (src[1]:src[0]) = a rotate when both are the same word
            d = int(src[2]) % 32
            regs[dst] = ((val(src[0]) << d) | (val(src[1]) >> (32 - d))) & 0xFFFFFFFF
        elif op == "fma.rn.bf16x2":
            a, b, c = (val(x) for x in src)
            halves = [to_bits(bf16((a >> s) & 0xFFFF) * bf16((b >> s) & 0xFFFF) + bf16((c >> s) & 0xFFFF))
                      for s in (0, 16)]
            regs[dst] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
    return torch.stack([out[f"${i}"] for i in range(8)], -1).float()


def decode_with_ptx(ptx: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint codes uint8 [rows, in/2] and scales [rows, in/32] -> fp32 [rows, in] through `ptx` run on their
    shift-layout words, each word with its group's scale pair (2^(s - 1) as two bf16), as the kernels call it."""
    words = to_shift_layout(codes, scales).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    s16 = (scales.to(torch.int64).repeat_interleave(4, -1) + 126) << 7  # 4 words (32 codes) a scale group
    return run_ptx(ptx, words, s16 | (s16 << 16)).reshape(codes.shape[0], -1)


def test_kernel_ptx_equals_dequantize_every_code_pair_and_scale():
    """The PTX text the kernels inline (its shifts where no masked bit wraps, its rotate, masks and fmas) decodes
    every byte (code pair) at every scale the layout allows exactly as dequantize_mxfp4."""
    ptx = shift_decode_ptx()
    assert ptx.count("shl.b32") == 4 and ptx.count("shf.l.wrap.b32") == 1
    codes = torch.arange(256, dtype=torch.uint8).repeat(MAX_SHIFT_SCALE + 1, 1)
    scales = torch.arange(MAX_SHIFT_SCALE + 1, dtype=torch.uint8)[:, None].repeat(1, 16)
    assert torch.equal(decode_with_ptx(ptx, codes, scales), dequantize_mxfp4(codes, scales, torch.float32))


def test_a_wrapping_rotate_is_not_a_shift():
    """The emulator tells a rotate from a shift: the same PTX with every rotate written as shl decodes wrongly."""
    ptx = shift_decode_ptx().replace("shf.l.wrap.b32 t, $8, $8,", "shl.b32 t, $8,")
    codes = torch.arange(256, dtype=torch.uint8).repeat(2, 1)
    scales = torch.full((2, 16), 127, dtype=torch.uint8)
    assert not torch.equal(decode_with_ptx(ptx, codes, scales), dequantize_mxfp4(codes, scales, torch.float32))
