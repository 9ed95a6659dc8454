"""Paged MLA decode in latent space (the absorbed form) as Triton kernels, FlashDecoding style.

Same contract as `reference.paged_sparse_mla_decode` / `paged_dense_mla_decode`: per sequence b
and head h, softmax over the selected tokens of scale * (q_latent . c[:L] + q_pe . c[L:]), output
probs @ c[:L] in fp32 [B, H, L]. Latents are read in place from the paged cache [P, block_size,
L + R] (a strided view of the page pool: any page stride, last dim contiguous) and dequantised
to `dtype` in registers, exactly as the reference does (fp8 code * latent_scale in fp32, rounded
to `dtype`). NVFP4 latents (uint8 rows of 9 * ceil((L + R) / 16) bytes, latent_scale their global
scale) run in `_split_fp4_kernel`: e2m1 * (e4m3 group scale * global scale) in fp32, rounded to
`dtype`, bit for bit as the reference (`dequantize_fp4_rows` exposes that code to the tests).

Design. Stage 1, grid (cdiv(H, BLOCK_H), num_splits, B), head blocks fastest so the programs
sharing a (sequence, split) run together and re-read its latents from L2: a program loads
BLOCK_H heads' queries once (rounded to the dot dtype), walks its split's share of tokens in
tiles of BLOCK_N (sparse: a slice of indices[b]; dense: a range of positions
0..context_len-1), maps each position through the block table to (page, row) (int64 byte
offsets: pools pass 2^31 bytes), loads the tile's latents [BLOCK_N, L] and [BLOCK_N, R],
dequantises them, computes logits with tl.dot (fp32 accumulation), keeps an online softmax
(base 2) and accumulates probs @ latents[:, :L]; it writes its normalised partial output
[BLOCK_H, L] and log-sum-exp to fp32 scratch [B, splits, H, L], [B, splits, H]. Stage 2, grid
(H, B), merges the splits by log-sum-exp; with one split stage 1 writes the output directly and
stage 2 is skipped. The split count (`plan_splits`) aims at `waves` x SM-count programs.

Rounding (the only deviations from the reference): for dtype bf16/fp16 the dot operands are in
that dtype, so q_latent, q_pe (fp32 in the reference) and the probabilities are rounded to it;
accumulation is fp32 in a different order. dtype fp32 uses IEEE fp32 dots. A power-of-two
latent_scale is folded into the logit scale and the output (the same as scaling each latent
first, up to fp32 rounding); any other scale is applied per element as in the reference.
Rows whose every index is -1 (or context_len 0) give NaN, like the reference.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DEFAULT_SMS = 132  # H200; used when the tensors are not on a CUDA device (interpreter)
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling and split policy. num_splits None: enough splits for `waves` x SM-count programs,
    each split at least `min_split_tokens` tokens. reload: load the latent tile a second time (from
    L2) for probs @ latents instead of keeping it in registers: each load then has one use and the
    software pipeliner prefetches both (it does not prefetch a tile used by two dots)."""

    block_h: int = 32
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    reload: bool = True
    waves: int = 2
    min_split_tokens: int = 64
    num_splits: int | None = None


def default_config(dtype: torch.dtype, scale_each: bool = False) -> DecodeConfig:
    """From the H200 sweep (benchmarks/sweep_decode.py, results/sweep_decode.json): 32 heads x 64
    tokens, 8 warps, no software pipelining is 1.26-1.40x faster than 32 tokens x 2 stages at batch 1
    and 64, contexts 128K and 1M. Per-element scales and IEEE fp32 dots take smaller tiles (registers)."""
    if dtype == torch.float32:  # IEEE fp32 dots (FMA): small tiles
        return DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, reload=False)
    if scale_each:  # the per-element scale costs registers: 16 heads, 4 warps has no spills
        return DecodeConfig(block_h=16, num_warps=4)
    return DecodeConfig(block_n=64, num_stages=1)


SPARSE_FP4_WIDE_HEADS_FROM_BATCH = 32


def default_fp4_config(dtype: torch.dtype, batch: int = 1, sparse: bool = True) -> DecodeConfig:
    """NVFP4 latents: each tile is read and dequantised once per head block (reload is ignored), its
    values kept in registers for both dots; fp32 as `default_config`. From the H200 (K3.1 pages, 96
    heads, top-2048, bf16; BENCHMARKS.md): 16 heads x 32 tokens, 4 warps is best at small batches
    (33.7 us at batch 1 against 65-81 with 32- or 64-head blocks); from batch 32, sparse decode takes
    64-head blocks with 8 warps, which dequantise each tile for fewer head blocks (374 against 389 us
    at batch 32, 535 against 738 at batch 64; a tie at 16)."""
    if dtype == torch.float32:
        return default_config(dtype)
    if sparse and batch >= SPARSE_FP4_WIDE_HEADS_FROM_BATCH:
        return DecodeConfig(block_h=64, num_warps=8, reload=False)
    return DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, reload=False)


@triton.jit
def _mask2(rows_ok, cols, N: tl.constexpr, BLOCK: tl.constexpr):
    """[rows, BLOCK] mask; constant along the columns when N fills the block, so loads vectorise."""
    if N == BLOCK:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (cols < N)[None, :]


@triton.jit
def _load_latent(ptrs, mask, latent_scale, SCALE_EACH: tl.constexpr, DTYPE: tl.constexpr, EVICT: tl.constexpr):
    """Cache values -> DTYPE as the reference dequantises them: (code * latent_scale in fp32) rounded to DTYPE."""
    c = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICT)
    if SCALE_EACH:
        return (c.to(tl.float32) * latent_scale).to(DTYPE)
    else:
        return c.to(DTYPE)


@triton.jit
def _tile_rows(sel_ptr, tables_ptr, b, s_sb, s_tb, n0, end, PAGE: tl.constexpr, SPARSE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(page, slot in the page, ok) of a tile's BLOCK_N tokens: the selected positions n0.. of row b
    (sparse; -1 = none) or the positions n0.. themselves (dense), below `end`."""
    offs = n0 + tl.arange(0, BLOCK_N)
    if SPARSE:
        pos = tl.load(sel_ptr + b * s_sb + offs, mask=offs < end, other=-1)
        ok = pos >= 0
    else:
        pos = offs
        ok = offs < end
    pos = tl.where(ok, pos, 0)
    page = tl.load(tables_ptr + b * s_tb + pos // PAGE, mask=ok, other=0).to(tl.int64)
    return page, (pos % PAGE).to(tl.int64), ok


@triton.jit
def _split_range(sel_ptr, b, s_sb, n_sel, split, split_len, SPARSE: tl.constexpr):
    """[start, end) of this split's share of row b: of its n_sel selected tokens (sparse) or of its
    context (dense: the length is sel_ptr[b])."""
    if SPARSE:
        n = n_sel
    else:
        n = tl.load(sel_ptr + b * s_sb).to(tl.int32)  # context length
    start = split * split_len
    return start, tl.minimum(start + split_len, n)


@triton.jit
def _split_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, tables_ptr, sel_ptr, part_ptr, lse_ptr,
    latent_scale, qk_scale, out_scale, H, n_sel, split_len,
    s_qlb, s_qlh, s_qpb, s_qph, s_cp, s_cr, s_tb, s_sb, s_pb, s_ps, s_ph, s_lb, s_ls,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr, SPARSE: tl.constexpr, SCALE_EACH: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    RELOAD: tl.constexpr,
):
    """One (head block, split, sequence): online softmax over the split's tokens -> partial output, lse (base 2)."""
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    ol = tl.arange(0, BLOCK_L)
    orr = tl.arange(0, BLOCK_R)
    start, end = _split_range(sel_ptr, b, s_sb, n_sel, split, split_len, SPARSE)
    # a split past the context (dense rows shorter than the longest) only writes lse = -inf;
    # split 0 always writes its output (with one split it is the output: NaN for an empty row)
    live = h_ok & ((start < end) | (split == 0))
    q_lat = tl.load(q_lat_ptr + b * s_qlb + heads[:, None] * s_qlh + ol[None, :],
                    mask=_mask2(live, ol, L, BLOCK_L), other=0.0).to(DTYPE)
    q_pe = tl.load(q_pe_ptr + b * s_qpb + heads[:, None] * s_qph + orr[None, :],
                   mask=_mask2(live, orr, R, BLOCK_R), other=0.0).to(DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        page, slot, ok = _tile_rows(sel_ptr, tables_ptr, b, s_sb, s_tb, n0, end, PAGE, SPARSE, BLOCK_N)
        row = cache_ptr + page * s_cp + slot * s_cr
        c_l = _load_latent(row[:, None] + ol[None, :], _mask2(ok, ol, L, BLOCK_L), latent_scale, SCALE_EACH, DTYPE,
                           "")
        c_r = _load_latent(row[:, None] + L + orr[None, :], _mask2(ok, orr, R, BLOCK_R), latent_scale, SCALE_EACH,
                           DTYPE, "")
        s = tl.dot(q_lat, tl.trans(c_l), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(c_r), s, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid token yet: keep p = 0, no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if RELOAD:  # a second load (from L2) with a single use lets the pipeliner prefetch both
            c_l = _load_latent(row[:, None] + ol[None, :], _mask2(ok, ol, L, BLOCK_L), latent_scale, SCALE_EACH,
                               DTYPE, "evict_first")
        acc = tl.dot(p.to(DTYPE), c_l, acc, input_precision=PRECISION)
        m_i = m_new
    # a split without a valid token (l_i = 0) stores NaN (or nothing) and lse -inf; the merge skips it
    out = acc * (out_scale / l_i)[:, None]
    tl.store(part_ptr + b * s_pb + split * s_ps + heads[:, None] * s_ph + ol[None, :], out,
             mask=_mask2(live, ol, L, BLOCK_L))
    tl.store(lse_ptr + b * s_lb + split * s_ls + heads, m_i + tl.log2(l_i), mask=h_ok)


@triton.jit
def _fp4_tile(row, ok, global_scale, CODES: tl.constexpr, SCALES: tl.constexpr, NBYTES: tl.constexpr,
              DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """NVFP4 values of a run of whole groups in BLOCK_N rows, as the reference dequantises them:
    e2m1 * (float(e4m3 scale) * global_scale) in fp32, rounded to DTYPE. CODES, SCALES: the byte
    offsets of the run's first code and scale byte in a row; NBYTES: its code bytes. Returns (low
    nibbles, high nibbles) [BLOCK_N, 8 * BLOCK_G]: column k holds value 2k, resp. 2k + 1, of the run."""
    g = tl.arange(0, BLOCK_G)
    k = g[:, None] * 8 + tl.arange(0, 8)[None, :]
    if NBYTES == 8 * BLOCK_G:  # masks constant along a row, so the loads vectorise
        b_ok = ok[:, None, None]
        s_ok = ok[:, None]
    else:
        b_ok = ok[:, None, None] & (k < NBYTES)[None, :, :]
        s_ok = ok[:, None] & (g * 8 < NBYTES)[None, :]
    b = tl.load(row[:, None, None] + CODES + k[None, :, :], mask=b_ok, other=0).to(tl.int32)
    s = tl.load(row[:, None] + SCALES + g[None, :], mask=s_ok, other=0)
    # e2m1 placed in an fp16's sign, exponent and top mantissa bit is e2m1 * 2^-14 (0.5 a subnormal),
    # exact in fp32; the 2^14 rides on the group scale (exact), so each product is e2m1 * scale rounded once
    s = (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * global_scale * 16384.0)[:, :, None]
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * s
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * s
    return (tl.reshape(lo.to(DTYPE), [BLOCK_N, 8 * BLOCK_G]), tl.reshape(hi.to(DTYPE), [BLOCK_N, 8 * BLOCK_G]))


@triton.jit
def _load_pairs(ptr, rows, rows_ok, n, BLOCK_C: tl.constexpr):
    """[rows, BLOCK_C] x2: values 2c and 2c + 1 of each row (of n values; zeros past them)."""
    c = tl.arange(0, BLOCK_C)
    even = tl.load(ptr + rows[:, None] + 2 * c[None, :], mask=rows_ok[:, None] & (2 * c < n)[None, :], other=0.0)
    odd = tl.load(ptr + rows[:, None] + 2 * c[None, :] + 1, mask=rows_ok[:, None] & (2 * c + 1 < n)[None, :],
                  other=0.0)
    return even, odd


@triton.jit
def _split_fp4_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, tables_ptr, sel_ptr, part_ptr, lse_ptr,
    global_scale, qk_scale, H, n_sel, split_len,
    s_qlb, s_qlh, s_qpb, s_qph, s_cp, s_cr, s_tb, s_sb, s_pb, s_ps, s_ph, s_lb, s_ls,
    L: tl.constexpr, R: tl.constexpr, GROUPS: tl.constexpr, BLOCK_GL: tl.constexpr, BLOCK_GR: tl.constexpr,
    ROW_ALIGN: tl.constexpr, PAGE: tl.constexpr, SPARSE: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """`_split_kernel` over NVFP4 rows (bytes: 8 * GROUPS codes, then GROUPS e4m3 scales; value v of
    the L + R in byte v / 2, low nibble first, group v / 16; L a multiple of 16, so the R values start
    at group L / 16). A tile's rows are read once, as bytes, and dequantised in registers. The latent
    dim is contracted as even and odd values (the low and high nibbles of the code bytes, each a
    [BLOCK_N, L / 2] operand without a shuffle): the queries are split the same way and the output is
    accumulated as its even and odd columns. s_cp, s_cr: strides in units of ROW_ALIGN bytes, so the
    compiler knows the rows' alignment and vectorises the loads."""
    hb = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    start, end = _split_range(sel_ptr, b, s_sb, n_sel, split, split_len, SPARSE)
    live = h_ok & ((start < end) | (split == 0))  # as in _split_kernel
    ql_e, ql_o = _load_pairs(q_lat_ptr + b * s_qlb, heads * s_qlh, live, L, 8 * BLOCK_GL)
    qr_e, qr_o = _load_pairs(q_pe_ptr + b * s_qpb, heads * s_qph, live, R, 8 * BLOCK_GR)
    ql_e, ql_o, qr_e, qr_o = ql_e.to(DTYPE), ql_o.to(DTYPE), qr_e.to(DTYPE), qr_o.to(DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_e = tl.zeros([BLOCK_H, 8 * BLOCK_GL], tl.float32)
    acc_o = tl.zeros([BLOCK_H, 8 * BLOCK_GL], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        page, slot, ok = _tile_rows(sel_ptr, tables_ptr, b, s_sb, s_tb, n0, end, PAGE, SPARSE, BLOCK_N)
        row = cache_ptr + (page * s_cp + slot * s_cr) * ROW_ALIGN
        cl_e, cl_o = _fp4_tile(row, ok, global_scale, 0, 8 * GROUPS, L // 2, DTYPE, BLOCK_N, BLOCK_GL)
        cr_e, cr_o = _fp4_tile(row, ok, global_scale, L // 2, 8 * GROUPS + L // 16, (R + 1) // 2, DTYPE, BLOCK_N,
                               BLOCK_GR)
        s = tl.dot(ql_e, tl.trans(cl_e), input_precision=PRECISION)
        s = tl.dot(ql_o, tl.trans(cl_o), s, input_precision=PRECISION)
        s = tl.dot(qr_e, tl.trans(cr_e), s, input_precision=PRECISION)
        s = tl.dot(qr_o, tl.trans(cr_o), s, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(DTYPE)
        acc_e = tl.dot(p, cl_e, acc_e * alpha[:, None], input_precision=PRECISION)
        acc_o = tl.dot(p, cl_o, acc_o * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    inv = 1.0 / l_i
    c = tl.arange(0, 8 * BLOCK_GL)
    out = part_ptr + b * s_pb + split * s_ps + heads[:, None] * s_ph + 2 * c[None, :]
    mask = live[:, None] & (2 * c < L)[None, :]
    tl.store(out, acc_e * inv[:, None], mask=mask)
    tl.store(out + 1, acc_o * inv[:, None], mask=mask)
    tl.store(lse_ptr + b * s_lb + split * s_ls + heads, m_i + tl.log2(l_i), mask=h_ok)


@triton.jit
def _store_fp4_rows(row, ok, dst, global_scale, L: tl.constexpr, R: tl.constexpr, GROUPS: tl.constexpr,
                    BLOCK_GL: tl.constexpr, BLOCK_GR: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The L + R values of BLOCK_N NVFP4 rows (rows where ok), dequantised by `_fp4_tile`, stored to
    dst [BLOCK_N, L + R] (a pointer per row)."""
    l_e, l_o = _fp4_tile(row, ok, global_scale, 0, 8 * GROUPS, L // 2, DTYPE, BLOCK_N, BLOCK_GL)
    r_e, r_o = _fp4_tile(row, ok, global_scale, L // 2, 8 * GROUPS + L // 16, (R + 1) // 2, DTYPE, BLOCK_N, BLOCK_GR)
    c = tl.arange(0, 8 * BLOCK_GL)
    tl.store(dst + 2 * c[None, :], l_e, mask=ok[:, None] & (2 * c < L)[None, :])
    tl.store(dst + 2 * c[None, :] + 1, l_o, mask=ok[:, None] & (2 * c + 1 < L)[None, :])
    c = tl.arange(0, 8 * BLOCK_GR)
    tl.store(dst + L + 2 * c[None, :], r_e, mask=ok[:, None] & (2 * c < R)[None, :])
    tl.store(dst + L + 2 * c[None, :] + 1, r_o, mask=ok[:, None] & (2 * c + 1 < R)[None, :])


@triton.jit
def _dequant_fp4_kernel(rows_ptr, out_ptr, n_rows, s_r, s_o, global_scale, L: tl.constexpr, R: tl.constexpr,
                        GROUPS: tl.constexpr, BLOCK_GL: tl.constexpr, BLOCK_GR: tl.constexpr, DTYPE: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """NVFP4 rows -> [n_rows, L + R] through `_fp4_tile` as `_split_fp4_kernel` calls it (a check of the
    in-register dequantisation against the reference's)."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = r < n_rows
    row = rows_ptr + r.to(tl.int64) * s_r
    dst = out_ptr + r.to(tl.int64)[:, None] * s_o
    _store_fp4_rows(row, ok, dst, global_scale, L, R, GROUPS, BLOCK_GL, BLOCK_GR, DTYPE, BLOCK_N)


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    s_pb, s_ps, s_ph, s_lb, s_ls, s_ob, s_oh,
    L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[b, h] = sum_s 2^lse_s part_s / sum_s 2^lse_s over the splits that saw a token (lse > -inf).
    A NaN split (NaN read from the cache) makes the output NaN, as in the reference."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + b * s_lb + splits * s_ls + h, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    total = tl.sum(w, 0)  # 0 when no split saw a token: the output is NaN, as in the reference
    ol = tl.arange(0, BLOCK_L)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for s in range(num_splits):
        w_s = tl.sum(tl.where(splits == s, w, 0.0), 0)
        part = tl.load(part_ptr + b * s_pb + s * s_ps + h * s_ph + ol, mask=ol < L, other=0.0)
        acc += tl.where(w_s == 0.0, 0.0, w_s * part)  # an empty split's part is NaN (0 / 0)
    tl.store(out_ptr + b * s_ob + h * s_oh + ol, acc / total, mask=ol < L)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(batch: int, head_blocks: int, tokens: int, cfg: DecodeConfig, sms: int) -> tuple[int, int]:
    """(num_splits, split_len): split_len a multiple of block_n, num_splits * split_len >= tokens."""
    tokens = max(tokens, 1)
    if cfg.num_splits is not None:
        splits = cfg.num_splits
    else:
        want = triton.cdiv(cfg.waves * sms, max(batch * head_blocks, 1))
        splits = max(1, min(want, triton.cdiv(tokens, cfg.min_split_tokens)))
    split_len = triton.cdiv(triton.cdiv(tokens, splits), cfg.block_n) * cfg.block_n
    return triton.cdiv(tokens, split_len), split_len


def _check(q_latent, q_pe, latent_cache, dtype):
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_DOT_DTYPES)}, got {dtype}")
    B, H, L = q_latent.shape
    if latent_cache.dtype == torch.uint8:
        R = q_pe.shape[-1]
        if L % 16 or q_pe.shape[:2] != (B, H) or latent_cache.shape[-1] != 9 * triton.cdiv(L + R, 16):
            raise ValueError(f"NVFP4 latents need L a multiple of 16 and 9 * ceil((L + R) / 16)-byte rows: L={L}, "
                             f"q_pe {tuple(q_pe.shape)}, rows of {latent_cache.shape[-1]} bytes")
    else:
        R = latent_cache.shape[-1] - L
    if q_pe.shape != (B, H, R):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} does not match q_latent {tuple(q_latent.shape)} and a "
                         f"{latent_cache.shape[-1]}-wide latent")
    if latent_cache.stride(-1) != 1:
        raise ValueError("latent_cache must be contiguous in its last dim")


def _decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, sel, sparse: bool, tokens: int,
            scale: float, dtype: torch.dtype, cfg: DecodeConfig | None = None, out: torch.Tensor | None = None):
    """Both variants: `sel` is indices [B, k] (sparse) or context_lens [B] (dense, `tokens` = max context)."""
    _check(q_latent, q_pe, latent_cache, dtype)
    fp4 = latent_cache.dtype == torch.uint8
    if fp4 and latent_scale is None:
        raise ValueError("NVFP4 latents need their global scale (latent_scale)")
    ls = 1.0 if latent_scale is None else float(latent_scale)
    # folding a power-of-two scale out of the loop is exact (fp16 could overflow where the reference does not)
    fold = ls == 1.0 or (math.frexp(ls)[0] == 0.5 and dtype != torch.float16)
    B, H, L = q_latent.shape
    cfg = cfg or (default_fp4_config(dtype, B, sparse) if fp4 else default_config(dtype, not fold))
    R = q_pe.shape[-1] if fp4 else latent_cache.shape[-1] - L
    dev = q_latent.device
    head_blocks = triton.cdiv(H, cfg.block_h)
    num_splits, split_len = plan_splits(B, head_blocks, tokens, cfg, _num_sms(dev))
    if out is None:
        out = torch.empty(B, H, L, dtype=torch.float32, device=dev)
    if B == 0:
        return out
    # one split writes the output from the kernel's registers: any float dtype (rounded there); the merge's is fp32
    if out.shape != (B, H, L) or out.stride(-1) != 1 or (out.dtype != torch.float32 and num_splits > 1) \
            or out.dtype not in _DOT_DTYPES:
        raise ValueError("out must be a [B, H, L] fp32 tensor contiguous in its last dim (or of another float "
                         "dtype when the config has one split)")
    q_latent, q_pe, block_tables, sel = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q_latent, q_pe, block_tables, sel))
    if num_splits == 1:  # write straight into out
        part, s_part = out, (out.stride(0), 0, out.stride(1))
    else:
        part = torch.empty(B, num_splits, H, L, dtype=torch.float32, device=dev)
        s_part = (part.stride(0), part.stride(1), part.stride(2))
    lse = torch.empty(B, num_splits, H, dtype=torch.float32, device=dev)

    if fp4:
        # the compiler assumes nothing of a stride that is not a multiple of 16: give it the rows' alignment
        align = math.gcd(4, latent_cache.data_ptr(), latent_cache.stride(0), latent_cache.stride(1))
        _split_fp4_kernel[(head_blocks, num_splits, B)](
            q_latent, q_pe, latent_cache, block_tables, sel, part, lse,
            ls, scale * LOG2E, H, tokens if sparse else 0, split_len,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            latent_cache.stride(0) // align, latent_cache.stride(1) // align, block_tables.stride(0), sel.stride(0),
            *s_part, lse.stride(0), lse.stride(1),
            L=L, R=R, GROUPS=latent_cache.shape[-1] // 9, BLOCK_GL=_pow2(L // 2) // 8,
            BLOCK_GR=_pow2(triton.cdiv(R, 2)) // 8, ROW_ALIGN=align, PAGE=latent_cache.shape[1], SPARSE=sparse,
            DTYPE=_DOT_DTYPES[dtype], PRECISION="ieee" if dtype == torch.float32 else "tf32",
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return _merge(out, part, lse, s_part, num_splits, L)
    qk_scale = scale * LOG2E * (ls if fold else 1.0)
    out_scale = ls if fold else 1.0
    _split_kernel[(head_blocks, num_splits, B)](
        q_latent, q_pe, latent_cache, block_tables, sel, part, lse,
        ls, qk_scale, out_scale, H, tokens if sparse else 0, split_len,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), sel.stride(0),
        *s_part, lse.stride(0), lse.stride(1),
        L=L, R=R, BLOCK_L=_pow2(L), BLOCK_R=_pow2(R), PAGE=latent_cache.shape[1], SPARSE=sparse,
        SCALE_EACH=not fold, DTYPE=_DOT_DTYPES[dtype], PRECISION="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, RELOAD=cfg.reload, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _merge(out, part, lse, s_part, num_splits, L)


def _merge(out, part, lse, s_part, num_splits: int, L: int) -> torch.Tensor:
    if num_splits > 1:
        B, H = out.shape[:2]
        _merge_kernel[(H, B)](
            part, lse, out, num_splits, *s_part, lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            L=L, BLOCK_L=_pow2(L), BLOCK_S=_pow2(num_splits), num_warps=4,
        )
    return out


def dequantize_fp4_rows(rows: torch.Tensor, global_scale: float, L: int, R: int, dtype: torch.dtype) -> torch.Tensor:
    """NVFP4 latent rows [N, 9 * ceil((L + R) / 16)] -> [N, L + R] in dtype, dequantised by the decode
    kernel's own code (for tests: it must equal `quant.reference.dequantize_nvfp4` bit for bit)."""
    if L % 16 or rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] != 9 * triton.cdiv(L + R, 16):
        raise ValueError(f"rows {rows.dtype} {tuple(rows.shape)} are not NVFP4 rows of L={L} + R={R} values")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape[0], L + R, dtype=dtype, device=rows.device)
    block_n = 16
    _dequant_fp4_kernel[(triton.cdiv(rows.shape[0], block_n),)](
        rows, out, rows.shape[0], rows.stride(0), out.stride(0), float(global_scale), L=L, R=R,
        GROUPS=rows.shape[1] // 9, BLOCK_GL=_pow2(L // 2) // 8, BLOCK_GR=_pow2(triton.cdiv(R, 2)) // 8,
        DTYPE=_DOT_DTYPES[dtype], BLOCK_N=block_n,
    )
    return out


def paged_sparse_mla_decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, indices, scale, dtype,
                            *, out: torch.Tensor | None = None, config: DecodeConfig | None = None) -> torch.Tensor:
    """Sparse decode over indices [B, k] (token positions, -1 = none); see `reference.paged_sparse_mla_decode`.

    q_latent [B, H, L], q_pe [B, H, R] (any float dtype), latent_cache [P, block_size, L + R] (bf16, or
    e4m3 times latent_scale) or uint8 NVFP4 rows [P, block_size, 9 * ceil((L + R) / 16)] (L a multiple
    of 16, latent_scale the global scale), block_tables [B, M] -> [B, H, L] fp32 (into `out` when given)."""
    return _decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, indices, True, indices.shape[1],
                   scale, dtype, config, out)


PREFILL_CONFIG = DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=1, reload=False, num_splits=1)
"""Prefill rows: many rows fill the GPU without splitting a row's selection. 64 heads x 64 tokens, 8 warps,
no pipelining, the latent tile kept in registers: the fastest of the H200 sweep (benchmarks/prefill_attention.py,
session 4: 116 / 103 TFLOP/s for 512 rows x 96 heads x top-2048 at 32K / 128K, against 72-74 for the decode
tiling). Heads of fewer than 64: `PREFILL_CONFIG_FEW_HEADS`."""

PREFILL_CONFIG_FEW_HEADS = DecodeConfig(block_n=64, num_stages=1, num_splits=1)
"""Prefill rows of at most 32 heads: the decode tiling (a 64-head block would be half padding)."""


def paged_sparse_mla_prefill(q_latent, q_pe, latent_cache, latent_scale, block_table, indices, scale, dtype,
                             *, out: torch.Tensor | None = None, config: DecodeConfig | None = None,
                             round_in_kernel: bool = False) -> torch.Tensor:
    """`reference.paged_sparse_mla_prefill`: query rows [n, H, L] / [n, H, R] of one sequence (pages
    `block_table` [M]) over their selected tokens indices [n, k] -> [n, H, L] in `dtype` (into `out`:
    contiguous in its last dim), rounded once from the kernel's fp32 result. The decode kernel with one
    split per row (`PREFILL_CONFIG`). round_in_kernel: the kernel stores `dtype` itself (what the engine runs,
    `backend.prefill_kernels`); else it stores fp32 and torch rounds."""
    if block_table.dim() != 1:
        raise ValueError(f"block_table must be one sequence's page ids [M], got shape {tuple(block_table.shape)}")
    B, H, L = q_latent.shape
    if config is None:
        ls = 1.0 if latent_scale is None else float(latent_scale)
        fold = ls == 1.0 or (math.frexp(ls)[0] == 0.5 and dtype != torch.float16)  # as `_decode` decides
        if latent_cache.dtype == torch.uint8:
            config = default_fp4_config(dtype, B)
        elif dtype == torch.float32 or not fold:
            config = default_config(dtype, not fold)
        else:
            config = PREFILL_CONFIG if H > 32 else PREFILL_CONFIG_FEW_HEADS
    cfg = dataclasses.replace(config, num_splits=1)
    if out is not None and out.dtype != dtype:
        raise ValueError(f"out must be of the compute dtype {dtype}, got {out.dtype}")
    tables = block_table.expand(B, -1)
    if not round_in_kernel and dtype != torch.float32:
        res = _decode(q_latent, q_pe, latent_cache, latent_scale, tables, indices, True, indices.shape[1], scale, dtype,
                      cfg).to(dtype)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty(B, H, L, dtype=dtype, device=q_latent.device)
    return _decode(q_latent, q_pe, latent_cache, latent_scale, tables, indices, True, indices.shape[1], scale, dtype,
                   cfg, out)


def paged_dense_mla_decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, context_lens, scale, dtype,
                           max_context: int | None = None, *, out: torch.Tensor | None = None,
                           config: DecodeConfig | None = None) -> torch.Tensor:
    """Dense decode over positions 0..context_lens[b]-1; see `reference.paged_dense_mla_decode`.

    max_context must be >= every context length (it sizes the splits; None reads context_lens.max(),
    a host sync). Longer rows would be cut at the split grid's end."""
    if max_context is None:
        max_context = int(context_lens.max()) if context_lens.numel() else 0
    return _decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, context_lens, False, max_context,
                   scale, dtype, config, out)


__all__ = ["DecodeConfig", "PREFILL_CONFIG", "default_config", "default_fp4_config", "dequantize_fp4_rows",
           "paged_dense_mla_decode", "paged_sparse_mla_decode", "paged_sparse_mla_prefill", "plan_splits"]
