"""Fused routed experts (MoE) as Triton kernels: grouped GEMMs over expert-sorted blocks, with MXFP4
(or plain) expert weights dequantised in registers.

Same contract as `reference.fused_moe_reference` (and `RoutedExperts` with `experts_forward`):
out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), expert_e(v) = act(v W1_e^T, v W3_e^T) W2_e^T.

Design.
1. Align (`align_blocks`, `ops.moe.align`). The N * k routed (token, slot) pairs, pair p = t * k + j, are grouped by
   expert and each expert's run is padded to a multiple of BLOCK_M rows: `sorted_pairs[r]` is the
   pair at row r, `block_expert[b]` the expert of block b, `block_rows[b]` its real rows (the rest
   is padding, masked), `num_blocks[0]` the blocks used. Every shape depends only on N, k, E and
   BLOCK_M: at most floor((N k + min(E, N k) (BLOCK_M - 1)) / BLOCK_M) blocks, so the grids are
   fixed and CUDA graphs capture them; nothing is read back by the host. Up to ALIGN_FEW_PAIRS
   pairs one Triton program compares the pairs' experts pairwise (a pair's rank in its expert, the
   blocks of the experts below it); up to ALIGN_SMALL_PAIRS one program does it all (a histogram
   over experts, a scan, a sort of the (expert, pair) keys, the scatter); above that, three launches
   do the same by chunks of that many pairs (the chunks' histograms; one program's scan of them into
   each chunk's offsets per expert; each chunk's sort and scatter). A few torch ops (a stable sort,
   cumsums, a scatter, a searchsorted) are the reference, and the fallback for 8192 or more experts.
   All put an expert's pairs in ascending pair order.
2. Gate/up GEMM, grid (blocks x column tiles of the intermediate dim; column tiles fastest, so
   the programs of one block run together and share its activation rows from L2): a program
   gathers its block's token rows of x, streams BLOCK_N rows of W1_e and of W3_e in BLOCK_K steps,
   runs both dots on the same activation tile, rounds gate and up to the model dtype (as the
   reference's two matmuls do), applies SiTU or SiLU in fp32 and stores act [N k, I] at the pair's
   row, in the model dtype.
3. Down GEMM, same grid over the hidden dim: act rows of the block times W2_e -> y [N k, h] at the
   pair's row, rounded to the model dtype (the reference's expert output), unweighted.
4. Combine, grid (tokens x hidden tiles): out[t] = sum_j weights[t, j] * y[t k + j] in fp32, the
   slots in order j = 0..k-1, cast once. No atomics anywhere: for a given batch and config the
   result is bitwise reproducible run to run (the row placement inside a block never changes a
   row's arithmetic). It is not batch-invariant: the config (hence the tile and MMA shapes) is
   picked from the token count.

Weights. MXFP4 experts are read as the checkpoint stores them (`<w>_packed` uint8 [E, out, in/2],
element 2i in the low nibble; `<w>_scale` ue8m0 uint8 [E, out, in/32]): 4.25 bits per weight, read
once per (block, tile). Three in-register dequantisations (`MoEConfig.dequant`):
- "exact": e2m1 value and 2^(s - 127) built from bits in fp32, multiplied in fp32, rounded to the
  dot dtype: bit for bit `dequantize_mxfp4(...).to(dtype)`. The only one for fp32 / fp16 inputs.
- "lut": inline PTX on one 32-bit word of 8 codes: byte permutes (prmt) look up the bf16 bytes of
  each e2m1 magnitude and place the signs, an fma.rn.bf16x2 applies the scale (`_LUT_ASM`: 21
  instructions per 8 weights; Triton's own bf16 multiply goes through fp32). Same values as
  "exact" (every product is exact; scale byte 0, 2^-127, is a bf16 subnormal). The interpreter
  runs the same permutes emulated in plain ops.
- "dot_scaled": `tl.dot_scaled` with an e2m1 operand: Triton's own upcast (fast_math: scale byte
  255 is not turned into NaN). Same values.
- "shift": the codes re-laid once at load (`mxfp4_layout.to_shift_layout`, fused_moe's
  mxfp4_layout="shift"): per word 4 shifts, a rotate, 6 masks and 4 bf16x2 fmas
  (`mxfp4_layout.shift_decode_ptx`; no table constants, which "lut" rematerialises under register
  pressure). Same values, scale bytes <= 128.
bf16 or fp32 (unquantised) experts go through the same kernels (MXFP4=False).

Dots. Activations and dequantised weights meet in the model dtype (bf16: tensor cores with fp32
accumulation; fp32: IEEE fp32 dots, for the CPU-sized tests). swap=True computes the transposed
tile W x^T ([BLOCK_N, BLOCK_M]) so that the weight tile is the MMA's first operand (a wgmma's M
side, >= 64, from registers) and the few tokens of a decode block its N side (>= 8): no 16-row
MMA padding, the tokens' tile from shared memory.

Configs (`ops.moe.config`: `MoEConfig`, `default_config`): decode (few tokens) takes BLOCK_M 16 and narrow
column tiles, so that blocks x tiles programs each stream a slice of the weights (bytes-bound: the split is along
the weight's output dim, no split-K, so the activation stays fused), and where they fit the Gluon fragment GEMMs of
`ops.moe.gluon_decode` instead of the two Triton GEMMs below (MoEConfig.fragments); prefill takes BLOCK_M 64-128
tiles for the tensor cores, and where they fit `ops.moe.gluon_prefill`'s wgmma fragment GEMMs (MoEConfig.fragments
with BLOCK_M 64 or 128). benchmarks/moe_layer.py sweeps these on the GPU. GemmTiles.split_k > 1 (opt-in)
splits each (block, column tile) along K over that many programs into fp32 partials, reduced in a fixed order
(`ops.moe.epilogue`: gate/up with the activation in one small kernel, down inside the combine).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kimiserve.ops.moe.align import align_blocks
from kimiserve.ops.moe.config import DECODE_MAX_ROWS, GemmTiles, MoEConfig, WgmmaTail, default_config, max_blocks
from kimiserve.ops.moe.dependent_launch import launch_options, unsupported
from kimiserve.ops.moe.epilogue import _activate, _combine_kernel, _reduce_act_kernel
from kimiserve.ops.moe.mxfp4_layout import MAG_MASK, SHIFT_PAIRS, SIGN_MASK, shift_decode_ptx

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX: the "lut" dequant runs emulated
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_DEQUANT = {"exact": 0, "lut": 1, "dot_scaled": 2, "shift": 3}  # "shift": weights in mxfp4_layout's shift layout
_ACT = {"silu": 0, "situ": 1}


def sm_count(device) -> int | None:
    """The SM count of a CUDA device (`default_config`'s num_sms), None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype, mxfp4: bool,
                          mxfp4_layout: str, dims: tuple[int, int], device) -> MoEConfig:
    """`default_config` for experts of these (hidden, intermediate) dims on this device (its SM count, whether it
    runs PDL): what `fused_moe` runs when given no config."""
    return default_config(num_tokens, top_k, num_experts, dtype, mxfp4, mxfp4_layout, dims=dims,
                          num_sms=sm_count(device), dependent_launch=runs_dependent_launch(device))


def runs_dependent_launch(device) -> bool:
    """Whether a CUDA device launches with PDL (`default_config`'s dependent_launch): sm_90 or later, compiled."""
    device = torch.device(device)
    if device.type != "cuda" or _INTERPRET:
        return False
    return _pdl_runs(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_runs(index: int) -> bool:
    return unsupported(torch.device("cuda", index)) is None


# ------------------------------------------------------------------------------------------------
# in-register dequantisation


@triton.jit
def _mxfp4_exact(q, sc, DTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Packed bytes [BN, BK/2] and ue8m0 scales [BN, BK/32] -> [BN, BK] in DTYPE, as dequantize_mxfp4:
    the e2m1 value and 2^(s - 127) (byte 0: 2^-127) built from bits in fp32, multiplied, rounded."""
    codes = tl.reshape(tl.join(q & 0xF, q >> 4), (BN, BK)).to(tl.int32)  # element 2i in the low nibble
    em = codes & 7
    mag = tl.where(em > 1, (em << 22) + (126 << 23), tl.where(em == 1, 126 << 23, 0))
    v = (mag | ((codes & 8) << 28)).to(tl.float32, bitcast=True)
    s = sc.to(tl.int32)
    scale = tl.where(s > 0, s << 23, 0x400000).to(tl.float32, bitcast=True)
    v = tl.reshape(v, (BN, BK // 32, 32)) * scale[:, :, None]
    return tl.reshape(v, (BN, BK)).to(DTYPE)


@triton.jit
def _bf16_halves(o):
    """int32 words -> [..., 2] bf16: the low 16 bits, then the high."""
    lo = o.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (o >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


# The "lut" dequantisation of one 32-bit word of 8 codes (code j in bits 4j..4j+3) into 4 words of
# bf16 pairs (codes 2i, 2i+1), each value times its group's scale. Byte permutes (prmt) look the
# bf16 bytes of each code's magnitude up in two 8-byte tables (high bytes 00 3F 3F 3F 40 40 40 40,
# low bytes 00 00 80 C0 00 40 80 C0: 0, .5, 1, 1.5, 2, 3, 4, 6), a third permute turns each code's
# sign bit into 0x80, two more interleave low and high bytes; an fma (bf16x2, + -0) applies the
# scale: 21 instructions per 8 weights, every product exact.
_HI_LUT = (0x3F3F3F00, 0x40404040)
_LO_LUT = (0xC0800000, 0xC0804000)
_SIGN_LUT = (0x00008000, 0)
_PAIR_SEL = (0x5140, 0x7362)  # bytes (lo c, hi c, lo c+1, hi c+1) of codes (0, 1) and (2, 3)
_HI_A: tl.constexpr = tl.constexpr(_HI_LUT[0])
_HI_B: tl.constexpr = tl.constexpr(_HI_LUT[1])
_LO_A: tl.constexpr = tl.constexpr(_LO_LUT[0])
_LO_B: tl.constexpr = tl.constexpr(_LO_LUT[1])
_SIGN_A: tl.constexpr = tl.constexpr(_SIGN_LUT[0])
_SEL_0: tl.constexpr = tl.constexpr(_PAIR_SEL[0])
_SEL_1: tl.constexpr = tl.constexpr(_PAIR_SEL[1])
_LUT_ASM = f"""{{
.reg .b32 m, mh, g, gh, h, l, t, z, o0, o1, o2, o3;
and.b32 m, $8, 0x77777777;
shr.u32 mh, m, 16;
shr.u32 g, $8, 3;
and.b32 g, g, 0x11111111;
shr.u32 gh, g, 16;
mov.b32 z, 0x80008000;
prmt.b32 h, {_HI_LUT[0]}, {_HI_LUT[1]}, m;
prmt.b32 l, {_LO_LUT[0]}, {_LO_LUT[1]}, m;
prmt.b32 t, {_SIGN_LUT[0]}, {_SIGN_LUT[1]}, g;
or.b32 h, h, t;
prmt.b32 o0, l, h, {_PAIR_SEL[0]};
prmt.b32 o1, l, h, {_PAIR_SEL[1]};
prmt.b32 h, {_HI_LUT[0]}, {_HI_LUT[1]}, mh;
prmt.b32 l, {_LO_LUT[0]}, {_LO_LUT[1]}, mh;
prmt.b32 t, {_SIGN_LUT[0]}, {_SIGN_LUT[1]}, gh;
or.b32 h, h, t;
prmt.b32 o2, l, h, {_PAIR_SEL[0]};
prmt.b32 o3, l, h, {_PAIR_SEL[1]};
fma.rn.bf16x2 o0, o0, $9, z;
fma.rn.bf16x2 o1, o1, $9, z;
fma.rn.bf16x2 o2, o2, $9, z;
fma.rn.bf16x2 o3, o3, $9, z;
mov.b32 {{$0, $1}}, o0;
mov.b32 {{$2, $3}}, o1;
mov.b32 {{$4, $5}}, o2;
mov.b32 {{$6, $7}}, o3;
}}"""
_LUT_ASM_C: tl.constexpr = tl.constexpr(_LUT_ASM)
# 8 bf16 outputs (16-bit registers $0..$7), then the word ($8) and its scale pair ($9)
_LUT_CONSTRAINTS: tl.constexpr = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r")


@triton.jit
def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode, selector nibbles < 8) in plain int64 ops, for the interpreter: byte k
    of the result is byte (sel >> 4k) & 7 of the 8 bytes b:a."""
    out = tl.zeros(sel.shape, tl.int64)
    a = out + a
    b = out + b
    for k in tl.static_range(4):
        idx = (sel >> (4 * k)) & 7
        byte = tl.where(idx < 4, a >> (8 * idx), b >> (8 * (idx - 4))) & 0xFF
        out = out | (byte << (8 * k))
    return out


@triton.jit
def _lut_words_emulated(w, scale):
    """`_LUT_ASM` in plain ops (interpreter): the same permutes, the scale multiply in fp32 (exact)."""
    w64 = w.to(tl.int64) & 0xFFFFFFFF
    m = w64 & 0x77777777
    g = (w64 >> 3) & 0x11111111
    h0 = _prmt(_HI_A, _HI_B, m) | _prmt(_SIGN_A, 0, g)
    l0 = _prmt(_LO_A, _LO_B, m)
    h1 = _prmt(_HI_A, _HI_B, m >> 16) | _prmt(_SIGN_A, 0, g >> 16)
    l1 = _prmt(_LO_A, _LO_B, m >> 16)
    zero = 0 * m
    o0 = _prmt(l0, h0, zero + _SEL_0)
    o1 = _prmt(l0, h0, zero + _SEL_1)
    o2 = _prmt(l1, h1, zero + _SEL_0)
    o3 = _prmt(l1, h1, zero + _SEL_1)
    return _scaled_pair(o0, scale), _scaled_pair(o1, scale), _scaled_pair(o2, scale), _scaled_pair(o3, scale)


@triton.jit
def _scaled_pair(o, s):
    """int64 word of two bf16 -> [..., 2] bf16, each times s (fp32), rounded (exact here)."""
    v = _bf16_halves(o.to(tl.int32))
    return (v.to(tl.float32) * s[:, :, None]).to(tl.bfloat16)


@triton.jit
def _mxfp4_lut(w, sc, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
    """int32 words [BN, BK/8] and ue8m0 scales [BN, BK/32] -> bf16 [BN, BK] (see `_LUT_ASM`)."""
    s = sc.to(tl.int32)
    s16 = tl.where(s > 0, s << 7, 0x40)  # 2^(s - 127) as bf16 bits (byte 0: the subnormal 2^-127)
    s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))
    if ASM:  # 8 bf16 outputs per word (codes 0..7), in 16-bit registers
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            _LUT_ASM_C, _LUT_CONSTRAINTS, [w, s16 | (s16 << 16)], dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
        # nest as [a, b, c] = code 4a + 2b + c (the natural order): c innermost, the last join
        even = tl.join(tl.join(e0, e4), tl.join(e2, e6))
        odd = tl.join(tl.join(e1, e5), tl.join(e3, e7))
        return tl.reshape(tl.join(even, odd), (BN, BK))
    scale = (s16 << 16).to(tl.float32, bitcast=True)
    p0, p1, p2, p3 = _lut_words_emulated(w, scale)
    # p_i [BN, BK/8, 2] holds codes 2i + c; nest as [a, b, c] = code 4a + 2b + c (the natural order)
    l0, h0 = tl.split(p0)
    l1, h1 = tl.split(p1)
    l2, h2 = tl.split(p2)
    l3, h3 = tl.split(p3)
    lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))
    hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    return tl.reshape(tl.join(lo, hi), (BN, BK))


_SHIFT_ASM_C: tl.constexpr = tl.constexpr(shift_decode_ptx())
_MAG: tl.constexpr = tl.constexpr(MAG_MASK)
_SIGN: tl.constexpr = tl.constexpr(SIGN_MASK)
_D0M: tl.constexpr = tl.constexpr(SHIFT_PAIRS[0][0])
_D0S: tl.constexpr = tl.constexpr(SHIFT_PAIRS[0][1])
_D1M: tl.constexpr = tl.constexpr(SHIFT_PAIRS[1][0])
_D1S: tl.constexpr = tl.constexpr(SHIFT_PAIRS[1][1])
_D2M: tl.constexpr = tl.constexpr(SHIFT_PAIRS[2][0])
_D2S: tl.constexpr = tl.constexpr(SHIFT_PAIRS[2][1])
_D3M: tl.constexpr = tl.constexpr(SHIFT_PAIRS[3][0])
_D3S: tl.constexpr = tl.constexpr(SHIFT_PAIRS[3][1])


@triton.jit
def _rotl(w, d: tl.constexpr):
    """Rotate-left of uint32 values held in int64."""
    if d == 0:
        return w
    return ((w << d) | (w >> (32 - d))) & 0xFFFFFFFF


@triton.jit
def _shift_pair_emulated(w, dm: tl.constexpr, ds: tl.constexpr, scale):
    """One output pair of `shift_decode_ptx` in plain ops: [..., 2] bf16 (the low half first), each bf16 read
    as fp32 (bits << 16: 2^-127 is an fp32 subnormal, exact), times scale in fp32 (exact), rounded."""
    o = (_rotl(w, dm) & _MAG) | (_rotl(w, ds) & _SIGN)
    lo = ((o & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)
    hi = (o & 0xFFFF0000).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.join(lo * scale, hi * scale).to(tl.bfloat16)


@triton.jit
def _mxfp4_shift(w, sc, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
    """Shift-layout int32 words [BN, BK/8] and ue8m0 scales [BN, BK/32] (each <= 128) -> bf16 [BN, BK]."""
    s16 = (sc.to(tl.int32) + 126) << 7  # 2^(s - 1) as bf16 bits: the codes come out as value * 2^-126
    s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))
    if ASM:
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            _SHIFT_ASM_C, _LUT_CONSTRAINTS, [w, s16 | (s16 << 16)], dtype=(tl.bfloat16, ) * 8, is_pure=True, pack=1)
        even = tl.join(tl.join(e0, e4), tl.join(e2, e6))
        odd = tl.join(tl.join(e1, e5), tl.join(e3, e7))
        return tl.reshape(tl.join(even, odd), (BN, BK))
    w64 = w.to(tl.int64) & 0xFFFFFFFF
    scale = (s16 << 16).to(tl.float32, bitcast=True)
    p0 = _shift_pair_emulated(w64, _D0M, _D0S, scale)
    p1 = _shift_pair_emulated(w64, _D1M, _D1S, scale)
    p2 = _shift_pair_emulated(w64, _D2M, _D2S, scale)
    p3 = _shift_pair_emulated(w64, _D3M, _D3S, scale)
    l0, h0 = tl.split(p0)
    l1, h1 = tl.split(p1)
    l2, h2 = tl.split(p2)
    l3, h3 = tl.split(p3)
    lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))
    hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    return tl.reshape(tl.join(lo, hi), (BN, BK))


# ------------------------------------------------------------------------------------------------
# grouped GEMM


@triton.jit
def _masked_load(ptrs, rmask, kmask, other, EVEN_K: tl.constexpr, CLAMPED: tl.constexpr):
    """A weight tile's load. CLAMPED (the "shift" path): the caller clamped the rows into range, so only a K
    tail is masked; else (the GPU-verified form of the other dequantisations) rows are masked too."""
    if CLAMPED:
        if EVEN_K:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=kmask[None, :], other=other)
    if EVEN_K:
        return tl.load(ptrs, mask=rmask[:, None], other=other)
    return tl.load(ptrs, mask=rmask[:, None] & kmask[None, :], other=other)


@triton.jit
def _load_weight(w_ptr, s_ptr, cols, col_ok, k0, K, s_wn, s_sn, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
                 ASM: tl.constexpr, DTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 CLAMPED: tl.constexpr):
    """W[cols, k0:k0+BK] in DTYPE ([BN, BK], zero past K, and outside col_ok unless CLAMPED): plain weights,
    or MXFP4 (bytes, or int32 words for "lut" / "shift") with their scales, dequantised by DEQUANT."""
    if MXFP4:
        ks = k0 // 32 + tl.arange(0, BK // 32)
        sc = _masked_load(s_ptr + cols[:, None] * s_sn + ks[None, :], col_ok, ks < K // 32, 127, EVEN_K, CLAMPED)
        if DEQUANT == 1 or DEQUANT == 3:
            kw = k0 // 8 + tl.arange(0, BK // 8)
            words = _masked_load(w_ptr + cols[:, None] * s_wn + kw[None, :], col_ok, kw < K // 8, 0, EVEN_K, CLAMPED)
            if DEQUANT == 3:
                return _mxfp4_shift(words, sc, BN, BK, ASM)
            return _mxfp4_lut(words, sc, BN, BK, ASM)
        else:
            kb = k0 // 2 + tl.arange(0, BK // 2)
            q = _masked_load(w_ptr + cols[:, None] * s_wn + kb[None, :], col_ok, kb < K // 2, 0, EVEN_K, CLAMPED)
            return _mxfp4_exact(q, sc, DTYPE, BN, BK)
    else:
        kk = k0 + tl.arange(0, BK)
        return _masked_load(w_ptr + cols[:, None] * s_wn + kk[None, :], col_ok, kk < K, 0.0, EVEN_K, CLAMPED).to(DTYPE)


@triton.jit
def _weight_dot(acc, a, w_ptr, s_ptr, cols, col_ok, k0, K, s_wn, s_sn,
                MXFP4: tl.constexpr, DEQUANT: tl.constexpr, ASM: tl.constexpr, SWAP: tl.constexpr, DTYPE: tl.constexpr,
                PRECISION: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                CLAMPED: tl.constexpr):
    """acc + a @ W[cols, k0:k0+BK]^T ([BM, BN]; SWAP: acc + W[cols, k0:k0+BK] @ a^T, [BN, BM]).
    w_ptr/s_ptr: expert e's weight (uint8 bytes; "lut", "shift": int32 words) and scale rows. CLAMPED: cols
    are clamped to valid rows (a tail tile's extra rows compute garbage that is never stored)."""
    if MXFP4 and DEQUANT == 2:
        kb = k0 // 2 + tl.arange(0, BK // 2)
        ks = k0 // 32 + tl.arange(0, BK // 32)
        q = _masked_load(w_ptr + cols[:, None] * s_wn + kb[None, :], col_ok, kb < K // 2, 0, EVEN_K, CLAMPED)
        sc = _masked_load(s_ptr + cols[:, None] * s_sn + ks[None, :], col_ok, ks < K // 32, 127, EVEN_K, CLAMPED)
        if SWAP:
            return tl.dot_scaled(q, sc, "e2m1", tl.trans(a), None, "bf16", acc, fast_math=True)
        else:
            return tl.dot_scaled(a, None, "bf16", tl.trans(q), sc, "e2m1", acc, fast_math=True)
    w = _load_weight(w_ptr, s_ptr, cols, col_ok, k0, K, s_wn, s_sn, MXFP4, DEQUANT, ASM, DTYPE, BN, BK, EVEN_K, CLAMPED)
    if SWAP:
        return tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, s_wn, s_sn, s_on, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
                    ASM: tl.constexpr, DTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The GEMMs' weight tiles, stored: out[n, k] = W[n, k] in DTYPE (tests the in-register dequant)."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    col_ok = cols < N
    w = _load_weight(w_ptr, s_ptr, cols, col_ok, k0, K, s_wn, s_sn, MXFP4, DEQUANT, ASM, DTYPE, BN, BK, False, False)
    kk = k0 + tl.arange(0, BK)
    tl.store(out_ptr + cols[:, None] * s_on + kk[None, :], w, mask=col_ok[:, None] & (kk < K)[None, :])


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, v_ptr, vs_ptr, out_ptr, sorted_ptr, bexp_ptr, brows_ptr, nblk_ptr,
    N_OUT, K, A_ROW_DIV, s_am, s_we, s_wn, s_se, s_sn, s_om, beta, linear_beta, s_ps,
    GATED: tl.constexpr, ACT: tl.constexpr, LINEAR_TANH: tl.constexpr, MXFP4: tl.constexpr,
    DEQUANT: tl.constexpr, ASM: tl.constexpr, SWAP: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr = 1,
):
    """One (block, column tile): out[pair, cols] = act(A W^T, A V^T) (GATED) or A W^T, rounded to DTYPE,
    for the block's pairs; A's row of pair p is p // A_ROW_DIV (the token for the gate/up GEMM).
    SPLIT > 1: one (block, column tile, K slice s) whose fp32 accumulators go to out (fp32 partials) at
    out_ptr + s s_ps (+ SPLIT s_ps for V's), for `epilogue`'s reduces."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N_OUT, BN)
    b = pid // (n_tiles * SPLIT)
    if b >= tl.load(nblk_ptr):
        return
    nt = (pid // SPLIT) % n_tiles
    split = pid % SPLIT
    steps = tl.cdiv(tl.cdiv(K, BK), SPLIT)  # K steps per slice; a slice past K stores zeros
    k_lo = split * steps * BK
    k_hi = tl.minimum(K, k_lo + steps * BK)
    e = tl.load(bexp_ptr + b).to(tl.int64)
    rows = tl.arange(0, BM)
    row_ok = rows < tl.load(brows_ptr + b)
    pairs = tl.load(sorted_ptr + b * BM + rows, mask=row_ok, other=0).to(tl.int64)
    a_rows = a_ptr + (pairs // A_ROW_DIV) * s_am
    cols = nt * BN + tl.arange(0, BN)
    col_ok = cols < N_OUT
    CLAMPED: tl.constexpr = DEQUANT == 3  # the shift path: no row masks on loads (not yet run on a GPU)
    if CLAMPED:  # a tail tile's extra rows read row N_OUT - 1, padding rows pair 0's row: stores are masked
        wcols = tl.minimum(cols, N_OUT - 1)
    else:
        wcols = cols
    w_e = w_ptr + e * s_we
    ws_e = ws_ptr + e * s_se
    v_e = v_ptr + e * s_we
    vs_e = vs_ptr + e * s_se
    if SWAP:
        acc = tl.zeros((BN, BM), tl.float32)
        acc2 = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        acc2 = tl.zeros((BM, BN), tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        if CLAMPED and EVEN_K:
            a = tl.load(a_rows[:, None] + kk[None, :]).to(DTYPE)
        elif CLAMPED:
            a = tl.load(a_rows[:, None] + kk[None, :], mask=(kk < K)[None, :], other=0.0).to(DTYPE)
        else:
            if EVEN_K:
                amask = row_ok[:, None]
            else:
                amask = row_ok[:, None] & (kk < K)[None, :]
            a = tl.load(a_rows[:, None] + kk[None, :], mask=amask, other=0.0).to(DTYPE)
        acc = _weight_dot(acc, a, w_e, ws_e, wcols, col_ok, k0, K, s_wn, s_sn, MXFP4, DEQUANT, ASM, SWAP, DTYPE,
                          PRECISION, BN, BK, EVEN_K, CLAMPED)
        if GATED:
            acc2 = _weight_dot(acc2, a, v_e, vs_e, wcols, col_ok, k0, K, s_wn, s_sn, MXFP4, DEQUANT, ASM, SWAP, DTYPE,
                               PRECISION, BN, BK, EVEN_K, CLAMPED)
    if SPLIT > 1:
        part = out_ptr + split.to(tl.int64) * s_ps
        if SWAP:
            offs = pairs[None, :] * s_om + cols[:, None]
            ok = col_ok[:, None] & row_ok[None, :]
        else:
            offs = pairs[:, None] * s_om + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
        tl.store(part + offs, acc, mask=ok)
        if GATED:
            tl.store(out_ptr + (split + SPLIT).to(tl.int64) * s_ps + offs, acc2, mask=ok)
        return
    if GATED:
        y = _activate(acc, acc2, beta, linear_beta, ACT, LINEAR_TANH, DTYPE)
    else:
        y = acc
    if SWAP:
        tl.store(out_ptr + pairs[None, :] * s_om + cols[:, None], y.to(DTYPE), mask=col_ok[:, None] & row_ok[None, :])
    else:
        tl.store(out_ptr + pairs[:, None] * s_om + cols[None, :], y.to(DTYPE), mask=row_ok[:, None] & col_ok[None, :])


# ------------------------------------------------------------------------------------------------
# entry point


def _gemm(a, w, w_scale, v, v_scale, out, align, a_row_div: int, tiles: GemmTiles, block_m: int, dequant: str,
          act: str, beta: float, linear_beta: float | None):
    sorted_pairs, bexp, brows, nblk = align
    E, n_out, k_in = w.shape[0], w.shape[1], a.shape[1]
    mxfp4 = w.dtype == torch.uint8
    dq = _DEQUANT[dequant] if mxfp4 else 0
    if mxfp4 and dq in (1, 3):  # 32-bit words of 8 codes
        w, v = w.view(torch.int32), (v.view(torch.int32) if v is not None else None)
    if not mxfp4:
        w_scale = v_scale = w  # unused
    gated = v is not None
    if not gated:
        v, v_scale = w, w_scale
    split = tiles.split_k
    if split > 1 and (out.dtype != torch.float32 or out.dim() != 3 or out.shape[0] != split * (2 if gated else 1)):
        raise ValueError(f"split-K {split} stores fp32 partials [{split * (2 if gated else 1)}, N k, {n_out}]")
    grid = (bexp.numel() * triton.cdiv(n_out, tiles.block_n) * split,)
    _moe_gemm_kernel[grid](
        a, w, w_scale, v, v_scale, out, sorted_pairs, bexp, brows, nblk,
        n_out, k_in, a_row_div, a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(-2), float(beta), float(linear_beta or 1.0), out.stride(0) if split > 1 else 0,
        GATED=gated, ACT=_ACT[act], LINEAR_TANH=linear_beta is not None, MXFP4=mxfp4, DEQUANT=dq, ASM=not _INTERPRET,
        SWAP=tiles.swap,
        DTYPE=_DOT_DTYPES[a.dtype], PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BM=block_m, BN=tiles.block_n, BK=tiles.block_k, EVEN_K=k_in % tiles.block_k == 0, SPLIT=split,
        **tiles.compile_options(),
    )


def dequantize_weights(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, dequant: str = "exact",
                       block_n: int = 32, block_k: int = 64) -> torch.Tensor:
    """MXFP4 packed [N, K/2] + scales [N, K/32] -> [N, K] in dtype through the GEMMs' in-register
    dequantisation ("exact" or "lut"; "shift": packed in the shift layout, bf16): what the kernels
    multiply by (tests it against `quant.reference.dequantize_mxfp4`)."""
    N, K = packed.shape[0], packed.shape[1] * 2
    dq = _DEQUANT[dequant]
    if dq == 2:
        raise ValueError("dot_scaled dequantises inside tl.dot_scaled: there is no tile to store")
    w = packed.view(torch.int32) if dq in (1, 3) else packed
    out = torch.empty(N, K, dtype=dtype, device=packed.device)
    _dequant_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
        w, scales, out, N, K, w.stride(0), scales.stride(0), out.stride(0), MXFP4=True, DEQUANT=dq, ASM=not _INTERPRET,
        DTYPE=_DOT_DTYPES[dtype], BN=block_n, BK=block_k)
    return out


def _check(x, w1, w2, w3, w1_scale, w2_scale, w3_scale, ids, weights, config: MoEConfig, mxfp4_layout: str):
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    E, inter, h = w1.shape[0], w1.shape[1], x.shape[1]
    mxfp4 = w1.dtype == torch.uint8
    width = h // 2 if mxfp4 else h
    if tuple(w1.shape) != (E, inter, width) or tuple(w3.shape) != tuple(w1.shape):
        raise ValueError(f"w1/w3 must be [E, I, {width}], got {tuple(w1.shape)} and {tuple(w3.shape)}")
    if tuple(w2.shape) != (E, h, inter // 2 if mxfp4 else inter):
        raise ValueError(f"w2 must be [E, {h}, {inter // 2 if mxfp4 else inter}], got {tuple(w2.shape)}")
    if mxfp4:
        if h % 32 or inter % 32:
            raise ValueError(f"MXFP4 experts need hidden and intermediate dims divisible by 32, got {h}, {inter}")
        for name, s, rows, cols in (("w1", w1_scale, inter, h), ("w3", w3_scale, inter, h), ("w2", w2_scale, h, inter)):
            if s is None or tuple(s.shape) != (E, rows, cols // 32) or s.dtype != torch.uint8:
                raise ValueError(f"{name}_scale must be uint8 [E, {rows}, {cols // 32}]")
        if config.dequant not in _DEQUANT:
            raise ValueError(f"dequant must be one of {list(_DEQUANT)}, got {config.dequant!r}")
        if config.dequant != "exact" and x.dtype != torch.bfloat16:
            raise ValueError(f"dequant {config.dequant!r} needs bf16 inputs, got {x.dtype}")
        if (config.dequant == "shift") != (mxfp4_layout == "shift"):
            raise ValueError(f"weights in the {mxfp4_layout!r} layout cannot take dequant {config.dequant!r}: the "
                             f"shift layout (mxfp4_layout.to_shift_layout) goes with dequant 'shift' and only with it")
    for t in (w1, w2, w3) + ((w1_scale, w2_scale, w3_scale) if mxfp4 else ()):
        if t.stride(-1) != 1:
            raise ValueError("expert weights and scales need a contiguous last dim")
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [N, k], N = {x.shape[0]}")
    for tiles in (config.up, config.down):
        if tiles.block_k < 32 or (mxfp4 and tiles.block_k % 32):
            raise ValueError(f"block_k must be a multiple of 32, got {tiles.block_k}")
        if (config.block_m < 16 and not config.fragments) or tiles.block_n < 16:  # fragments: check_fragment_shapes
            raise ValueError("block_m and block_n must be >= 16 (tl.dot)")
        if not 1 <= tiles.split_k <= 16:
            raise ValueError(f"split_k must be 1..16, got {tiles.split_k}")
        if tiles.max_registers is not None and not 24 <= tiles.max_registers <= 255:
            raise ValueError(f"max_registers must be None or 24..255, got {tiles.max_registers}")
    if config.fragments:
        if not (mxfp4 and config.dequant == "shift" and x.dtype == torch.bfloat16 and x.is_cuda):
            raise ValueError("MoEConfig.fragments runs bf16 activations on CUDA against MXFP4 experts in the shift "
                             f"layout (dequant 'shift'); got {x.dtype} on {x.device.type}, dequant {config.dequant!r}")
        from kimiserve.ops.moe.fragment_order import check_fragment_shapes
        why = check_fragment_shapes(h, inter, config.block_m, config.up, config.down, config.wgmma_tails)
        if why:
            raise ValueError(f"MoEConfig.fragments: {why}")
    if config.wgmma_tails != MoEConfig.wgmma_tails and not (config.fragments and config.block_m == 128):
        raise ValueError(f"MoEConfig.wgmma_tails applies to the wgmma fragment GEMMs on 128-row blocks (fragments, "
                         f"block_m 128); leave it at its default for block_m {config.block_m}")
    if config.dependent_launch:
        why = "the Triton interpreter runs no PTX" if _INTERPRET else unsupported(x.device)
        if why:
            raise ValueError(f"MoEConfig.dependent_launch: {why}; leave it off")


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, *, w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              w3_scale: torch.Tensor | None = None, activation: str = "situ", situ_beta: float = 4.0,
              situ_linear_beta: float | None = 25.0, out: torch.Tensor | None = None,
              workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
              config: MoEConfig | None = None, mxfp4_layout: str = "checkpoint") -> torch.Tensor:
    """Routed experts: x [N, h] (bf16, fp16 or fp32), ids / weights [N, k] (int, fp32) -> [N, h] in x's dtype.

    Weights: w1 (gate) and w3 (up) [E, I, h], w2 (down) [E, h, I] in any float dtype; or MXFP4:
    packed uint8 [E, out, in/2] with ue8m0 scales uint8 [E, out, in/32] (`w*_scale`). activation:
    "situ" (situ_beta, situ_linear_beta; None: no tanh on up) or "silu". out: written in place;
    workspace: (act [N k, I], y [N k, h]) buffers in x's dtype (else allocated). mxfp4_layout: "checkpoint"
    (the packed codes as stored) or "shift" (`mxfp4_layout.to_shift_layout`, done once at load; bf16
    inputs, dequant "shift")."""
    if activation not in _ACT:
        raise ValueError(f"activation must be one of {list(_ACT)}, got {activation!r}")
    N, h = x.shape
    k = ids.shape[1] if ids.dim() == 2 else 0
    E, inter = w1.shape[0], w1.shape[1]
    mxfp4 = w1.dtype == torch.uint8
    if mxfp4_layout not in ("checkpoint", "shift"):
        raise ValueError(f"mxfp4_layout must be 'checkpoint' or 'shift', got {mxfp4_layout!r}")
    config = config or device_default_config(N, k, E, x.dtype, mxfp4, mxfp4_layout, (h, inter), x.device)
    _check(x, w1, w2, w3, w1_scale, w2_scale, w3_scale, ids, weights, config, mxfp4_layout)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if N == 0:
        return out
    if k == 0:
        return out.zero_()
    if workspace is None:
        act = torch.empty(N * k, inter, dtype=x.dtype, device=x.device)
        y = torch.empty(N * k, h, dtype=x.dtype, device=x.device)
    else:
        act, y = workspace
    align = align_blocks(ids, E, config.block_m, dependent_launch=config.dependent_launch)
    gate_up(x, w1, w1_scale, w3, w3_scale, act, align, config, activation, situ_beta, situ_linear_beta)
    down_combine(act, w2, w2_scale, y, weights, out, align, config)
    return out


def gate_up(x, w1, w1_scale, w3, w3_scale, act, align, config: MoEConfig, activation: str, beta: float,
            linear_beta: float | None):
    """fused_moe's gate/up stage: act [N k, I] (split-K: fp32 partials, then their reduce with the activation;
    config.fragments: act's columns in `ops.moe.fragment_order`'s MMA-k order, as the down GEMM reads them)."""
    k = act.shape[0] // x.shape[0]
    split, inter = config.up.split_k, act.shape[1]
    if config.fragments and config.block_m > 16:
        from kimiserve.ops.moe import gluon_prefill
        from kimiserve.ops.moe.fragment_order import fragment_order
        gluon_prefill.wgmma_gemm_blocks(fragment_order(x, 128), w1, w1_scale, w3, w3_scale, act, align, k,
                                        config.block_m, activation, beta, linear_beta, config.up, config.wgmma_tails)
        return
    if config.fragments:
        from kimiserve.ops.moe import gluon_decode
        from kimiserve.ops.moe.mma_order import mma_order
        x = mma_order(x, config.up.block_k, config.dependent_launch)
        out = act if split == 1 else torch.empty(2 * split, act.shape[0], inter, dtype=torch.float32, device=x.device)
        gluon_decode.fragment_gemm(x, w1, w1_scale, w3, w3_scale, out, align, k, config.up, activation, beta,
                                   linear_beta, config.down.block_k, config.dependent_launch)
        if split > 1:
            _reduce_act(out, act, activation, beta, linear_beta, config.down.block_k, config.dependent_launch)
        return
    if split == 1:
        _gemm(x, w1, w1_scale, w3, w3_scale, act, align, k, config.up, config.block_m, config.dequant, activation,
              beta, linear_beta)
        return
    part = torch.empty(2 * split, act.shape[0], inter, dtype=torch.float32, device=x.device)
    _gemm(x, w1, w1_scale, w3, w3_scale, part, align, k, config.up, config.block_m, config.dequant, activation,
          beta, linear_beta)
    _reduce_act(part, act, activation, beta, linear_beta)


def _reduce_act(part, act, activation: str, beta: float, linear_beta: float | None, out_block_k: int = 0,
                dependent_launch: bool = False):
    """act [N k, I] from the gate/up GEMM's split-K partials part [2 S, N k, I] (`_reduce_act_kernel`); out_block_k:
    act's columns in the MMA-k order of that step (the decode fragment GEMMs; 0: in place)."""
    split, inter = part.shape[0] // 2, act.shape[1]
    BR = min(1024, triton.next_power_of_2(inter))
    _reduce_act_kernel[(act.shape[0], triton.cdiv(inter, BR))](
        part, act, inter, part.stride(1), part.stride(0), split * part.stride(0), act.stride(0), float(beta),
        float(linear_beta or 1.0), SPLIT=split, ACT=_ACT[activation], LINEAR_TANH=linear_beta is not None,
        DTYPE=_DOT_DTYPES[act.dtype], BR=BR, OUT_BK=out_block_k, PDL=dependent_launch, num_warps=4,
        **launch_options(dependent_launch))


def down_gemm(act, w2, w2_scale, y, align, config: MoEConfig):
    """fused_moe's down GEMM alone: y [N k, h] (split-K: fp32 partials [S, N k, h]), unweighted."""
    if config.fragments and config.block_m > 16:
        from kimiserve.ops.moe import gluon_prefill
        gluon_prefill.wgmma_gemm_blocks(act, w2, w2_scale, None, None, y, align, 1, config.block_m, "silu", 1.0, None,
                                        config.down, config.wgmma_tails)
    elif config.fragments:
        from kimiserve.ops.moe import gluon_decode
        gluon_decode.fragment_gemm(act, w2, w2_scale, None, None, y, align, 1, config.down, "silu", 1.0, None,
                                   dependent_launch=config.dependent_launch)
    else:
        _gemm(act, w2, w2_scale, None, None, y, align, 1, config.down, config.block_m, config.dequant, "silu", 1.0,
              None)


def down_combine(act, w2, w2_scale, y, weights, out, align, config: MoEConfig):
    """fused_moe's down stage and combine: out [N, h] (split-K: fp32 partials summed inside the combine;
    y is then not written)."""
    N, k, h = out.shape[0], weights.shape[1], out.shape[1]
    split = config.down.split_k
    if split > 1:
        y = torch.empty(split, N * k, h, dtype=torch.float32, device=out.device)
    down_gemm(act, w2, w2_scale, y, align, config)
    BH = min(config.combine_block, triton.next_power_of_2(h))
    _combine_kernel[(N, triton.cdiv(h, BH))](y, weights, out, h, y.stride(-2), *weights.stride(), out.stride(0),
                                              y.stride(0) if split > 1 else 0, TOP_K=k, BH=BH, SPLIT=split,
                                              DTYPE=_DOT_DTYPES[out.dtype], PDL=config.dependent_launch, num_warps=4,
                                              **launch_options(config.dependent_launch))


__all__ = ["DECODE_MAX_ROWS", "GemmTiles", "MoEConfig", "WgmmaTail", "align_blocks", "runs_dependent_launch",
           "default_config", "device_default_config", "dequantize_weights", "down_combine", "down_gemm", "fused_moe",
           "gate_up", "max_blocks", "sm_count"]
