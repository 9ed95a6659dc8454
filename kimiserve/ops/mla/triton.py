"""Paged MLA decode in latent space (the absorbed form) as Triton kernels, FlashDecoding style.

Same contract as `reference.paged_sparse_mla_decode` / `paged_dense_mla_decode`: per sequence b
and head h, softmax over the selected tokens of scale * (q_latent . c[:L] + q_pe . c[L:]), output
probs @ c[:L] in fp32 [B, H, L]. Latents are read in place from the paged cache [P, block_size,
L + R] (a strided view of the page pool: any page stride, last dim contiguous) and dequantised
to `dtype` in registers, exactly as the reference does (fp8 code * latent_scale in fp32, rounded
to `dtype`).

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
    if SPARSE:
        n = n_sel
    else:
        n = tl.load(sel_ptr + b * s_sb).to(tl.int32)  # context length
    start = split * split_len
    end = tl.minimum(start + split_len, n)
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
        offs = n0 + tl.arange(0, BLOCK_N)
        if SPARSE:
            pos = tl.load(sel_ptr + b * s_sb + offs, mask=offs < end, other=-1)
            ok = pos >= 0
        else:
            pos = offs
            ok = offs < end
        pos = tl.where(ok, pos, 0)
        page = tl.load(tables_ptr + b * s_tb + pos // PAGE, mask=ok, other=0).to(tl.int64)
        row = cache_ptr + page * s_cp + (pos % PAGE).to(tl.int64) * s_cr
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
    ls = 1.0 if latent_scale is None else float(latent_scale)
    # folding a power-of-two scale out of the loop is exact (fp16 could overflow where the reference does not)
    fold = ls == 1.0 or (math.frexp(ls)[0] == 0.5 and dtype != torch.float16)
    cfg = cfg or default_config(dtype, not fold)
    B, H, L = q_latent.shape
    R = latent_cache.shape[-1] - L
    dev = q_latent.device
    if out is None:
        out = torch.empty(B, H, L, dtype=torch.float32, device=dev)
    if B == 0:
        return out
    if out.shape != (B, H, L) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("out must be a [B, H, L] fp32 tensor contiguous in its last dim")
    q_latent, q_pe, block_tables, sel = (t if t.stride(-1) == 1 else t.contiguous()
                                         for t in (q_latent, q_pe, block_tables, sel))
    head_blocks = triton.cdiv(H, cfg.block_h)
    num_splits, split_len = plan_splits(B, head_blocks, tokens, cfg, _num_sms(dev))
    if num_splits == 1:  # write straight into out
        part, s_part = out, (out.stride(0), 0, out.stride(1))
    else:
        part = torch.empty(B, num_splits, H, L, dtype=torch.float32, device=dev)
        s_part = (part.stride(0), part.stride(1), part.stride(2))
    lse = torch.empty(B, num_splits, H, dtype=torch.float32, device=dev)

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
    if num_splits > 1:
        _merge_kernel[(H, B)](
            part, lse, out, num_splits, *s_part, lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            L=L, BLOCK_L=_pow2(L), BLOCK_S=_pow2(num_splits), num_warps=4,
        )
    return out


def paged_sparse_mla_decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, indices, scale, dtype,
                            *, out: torch.Tensor | None = None, config: DecodeConfig | None = None) -> torch.Tensor:
    """Sparse decode over indices [B, k] (token positions, -1 = none); see `reference.paged_sparse_mla_decode`.

    q_latent [B, H, L], q_pe [B, H, R] (any float dtype), latent_cache [P, block_size, L + R] (bf16, or
    e4m3 times latent_scale), block_tables [B, M] -> [B, H, L] fp32 (into `out` when given)."""
    return _decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, indices, True, indices.shape[1],
                   scale, dtype, config, out)


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


__all__ = ["DecodeConfig", "default_config", "paged_dense_mla_decode", "paged_sparse_mla_decode", "plan_splits"]
