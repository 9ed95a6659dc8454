"""The "shift" layout of MXFP4 expert weights: the checkpoint's packed e2m1 codes with the bits of
each 32-bit word (8 codes) moved, once at load, so that the fused MoE kernel turns a word into its 4
bf16 pairs with rotates and masks only (`SHIFT_PAIRS`: 11 integer instructions and 4 bf16x2
multiplies per 8 weights, against 17 permutes/shifts plus table constants for the "lut" decode of
the checkpoint layout).

The trick (as in Marlin's and triton_kernels' fp4 upcasts): an e2m1 code s|e1 e0 m placed in a bf16
as sign bit 15 and e1 e0 m in bits 8..6 (the exponent's two low bits and the mantissa's top bit) is
the bf16 whose value is the e2m1 value times 2^-126 (code 1, 0.5, becomes the subnormal 2^-127; code
0 is 0). Multiplying by 2^(s - 1) for the group's ue8m0 scale byte s gives value * 2^(s - 127)
exactly, as `dequantize_mxfp4` does, for s <= 128 (2^(s - 1) must be a finite bf16; groups with
larger scale bytes, |w| >= 16, need the "lut" decode of the checkpoint layout).

Word layout: pair i of a word (codes 2i, 2i + 1, the low and high bf16 of output register i) comes
out of `rotl(w, d) & mask` for one or two rotations d: its magnitude bits from rotation
`SHIFT_PAIRS[i][0]`, its sign bits from `SHIFT_PAIRS[i][1]`. No four rotations of the 8 target bits
tile a 32-bit word, so two pairs take their signs from a second rotation (found by a search over
tilings of Z_16). Scales keep the checkpoint's ue8m0 bytes.
"""

from __future__ import annotations

import functools

import torch

# (rotate-left of the magnitude bits, of the sign bits) for output pair i = 0..3
SHIFT_PAIRS = ((0, 0), (3, 3), (6, 2), (13, 1))
MAG_MASK = 0x01C001C0  # bits 8..6 of both bf16 halves
SIGN_MASK = 0x80008000
MAX_SHIFT_SCALE = 128  # 2^(s - 1) is a finite bf16 up to here


@functools.cache
def _bit_moves() -> tuple[tuple[int, int], ...]:
    """(checkpoint bit, shift-layout bit) for the 32 bits of a word."""
    moves = []
    for i, (dm, ds) in enumerate(SHIFT_PAIRS):
        for half in (0, 1):
            code = 2 * i + half  # checkpoint nibble `code`: bits 4 code .. 4 code + 3 (bit 3: sign)
            for b in range(4):
                target = (15 if b == 3 else 6 + b) + 16 * half
                d = ds if b == 3 else dm
                moves.append((4 * code + b, (target - d) % 32))
    if sorted(p for _, p in moves) != list(range(32)):
        raise AssertionError("SHIFT_PAIRS does not tile a 32-bit word")
    return tuple(moves)


@functools.cache
def _rotations(inverse: bool) -> tuple[tuple[int, int], ...]:
    """The bit moves as (source mask, rotate-left) pairs, one per distinct rotation (13 for 32 bits)."""
    masks: dict[int, int] = {}
    for src, dst in _bit_moves():
        a, b = (dst, src) if inverse else (src, dst)
        masks[(b - a) % 32] = masks.get((b - a) % 32, 0) | (1 << a)
    return tuple((m, d) for d, m in sorted(masks.items()))


def _move_bits(words: torch.Tensor, inverse: bool) -> torch.Tensor:
    """int32 words -> int32 words with every bit moved (in chunks: the K3.1 layer is 3.9G words)."""
    flat = words.reshape(-1)
    out = torch.empty_like(flat)
    step = 1 << 24
    for start in range(0, flat.numel(), step):
        w = flat[start:start + step].to(torch.int64) & 0xFFFFFFFF
        moved = torch.zeros_like(w)
        for mask, d in _rotations(inverse):
            part = w & mask
            moved |= ((part << d) | (part >> (32 - d))) & 0xFFFFFFFF if d else part
        out[start:start + step] = (moved - (((moved >> 31) & 1) << 32)).to(torch.int32)
    return out.view(words.shape)


def _words(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.dim() == 0 or packed.shape[-1] % 4:
        raise ValueError(f"MXFP4 packed codes must be uint8 [..., in/2] with in/2 divisible by 4, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    return packed.contiguous().view(torch.int32)


def to_shift_layout(packed: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Checkpoint packed codes uint8 [..., in/2] -> the same codes in the shift layout (a new tensor).
    With scales (ue8m0 uint8 [..., in/32]), first checks that every scale byte is <= MAX_SHIFT_SCALE."""
    if scales is not None and scales.numel() and int(scales.max()) > MAX_SHIFT_SCALE:
        raise ValueError(f"the shift layout needs MXFP4 scale bytes <= {MAX_SHIFT_SCALE} (scales up to 2); got "
                         f"{int(scales.max())}: keep the checkpoint layout (dequant 'lut') for these weights")
    return _move_bits(_words(packed), inverse=False).view(torch.uint8).view(packed.shape)


def from_shift_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_shift_layout` (for tests and checks)."""
    return _move_bits(_words(packed), inverse=True).view(torch.uint8).view(packed.shape)


def shift_decode_ptx() -> str:
    """The kernels' PTX for one word of the shift layout (`ops.moe.triton`, `gluon_decode`, `gluon_prefill`): per
    output pair its rotation(s) and masks, then an fma (bf16x2, + -0) by the group's 2^(s - 1): 8 bf16 outputs
    ($0..$7, codes 0..7 of the word), the word ($8), the scale pair ($9). A rotation whose masked bits all come from
    unwrapped ones is a left shift (4 of the 5: ptxas issues part of the shifts on the FMA pipe, where rotates
    would all go to the ALU pipe, the decode loop's busiest)."""
    lines = [".reg .b32 t, z, o0, o1, o2, o3;", "mov.b32 z, 0x80008000;"]
    for i, (dm, ds) in enumerate(SHIFT_PAIRS):
        parts = [(dm, MAG_MASK | SIGN_MASK)] if dm == ds else [(dm, MAG_MASK), (ds, SIGN_MASK)]
        for j, (d, mask) in enumerate(parts):
            src = "$8"
            if d and mask >> d << d == mask:  # no masked bit comes from a wrapped one: a plain shift
                lines.append(f"shl.b32 t, $8, {d};")
                src = "t"
            elif d:
                lines.append(f"shf.l.wrap.b32 t, $8, $8, {d};")
                src = "t"
            if j == 0:
                lines.append(f"and.b32 o{i}, {src}, {mask:#010x};")
            else:
                lines.append(f"and.b32 t, {src}, {mask:#010x};")
                lines.append(f"or.b32 o{i}, o{i}, t;")
    for i in range(4):
        lines.append(f"fma.rn.bf16x2 o{i}, o{i}, $9, z;")
    lines += [f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, o{i};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


__all__ = ["MAG_MASK", "MAX_SHIFT_SCALE", "SHIFT_PAIRS", "SIGN_MASK", "from_shift_layout", "shift_decode_ptx",
           "to_shift_layout"]
