"""Triton kernel for the decode-time indexer scan `paged_indexer_scores` (the long-context hot loop).

At a 1M-token context this reads 132 B per token (128 e4m3 key bytes + a 4-byte fp32 scale) and
writes 4 B per token, so it is bound by memory bandwidth. Design:

- grid (token chunks, batch): program (c, b) owns positions [c * CHUNK, (c + 1) * CHUNK) of sequence
  b, CHUNK = TILES * BLOCK_S. It loads the query q[b] [Hi, D] once (transposed, in the dot dtype) and
  the head weights once, then walks its tiles of BLOCK_S tokens. BLOCK_S divides block_size, so a
  tile lies in one page: one block-table read per tile, then a [BLOCK_S, D] key tile read in place
  from the page-strided view (rows contiguous inside the page) plus BLOCK_S scales.
- e4m3 keys enter the dot as their exact code values (converted to fp16, one conversion per pair),
  q as fp16 (bf16 values in fp16's normal range, 6.1e-5 to 65504 in magnitude, convert exactly), fp32 accumulation; ReLU, times the fp32 weights, summed over
  heads -> BLOCK_S scores, each times its token's fp32 key scale (ReLU commutes with a positive
  scale), as the reference defines it. bf16 keys are cast to `dtype` and dotted in `dtype`. The H200
  measurement behind the fp16 dot (benchmarks/scan_variants.py, results/scan_variants.json): the
  per-element dequantisation to bf16 cost ~16% at batch 1 (59.9 -> 50.5 us at 1M tokens).
- slots at or past context_len are masked off (never read; their scores are -inf): only slots
  s < context_len of the first ceil(context_len / block_size) block-table entries are read. The
  tile loop has a fixed trip count (TILES) so Triton can pipeline it.

Differences from the reference: only the summation order inside the dot (the products are exact in
fp32). A q wider than the dot dtype (e.g. fp32 q) enters the dot as the sum of two parts, so it
keeps ~21 (fp16) or ~16 (bf16) significant bits instead of fp32's 24. `dtype=torch.float32` runs
an IEEE fp32 dot (correct but far slower).

Under TRITON_INTERPRET=1 (CPU tensors) the interpreter's bf16 dot and fp32 -> bf16 cast are wrong
(it multiplies the raw bit patterns; the cast truncates), so on CPU the kernel rounds to bf16 by
bit arithmetic and runs the dot in fp32 on the rounded values: same result, different path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_bf16_f32(x):
    """fp32 values rounded to bf16 (nearest even), kept in fp32 (the interpreter's stand-in for a cast)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _operand(x, DT: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 x rounded to the dot dtype DT: a DT tensor, or (EMULATE) an fp32 tensor of DT values."""
    if EMULATE:
        if DT == tl.bfloat16:
            return _round_bf16_f32(x)
        else:
            return x.to(DT).to(tl.float32)
    else:
        return x.to(DT)


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, cl_ptr, out_ptr,
    q_sb, q_sh, q_sd, w_sb, w_sh, k_sp, k_st, k_sd, ks_sp, ks_st, bt_sb, bt_sm, out_sb,
    H, max_context,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    TILES: tl.constexpr, HAS_SCALE: tl.constexpr, DT: tl.constexpr, SPLIT_Q: tl.constexpr,
    EMULATE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Scores of positions [chunk * TILES * BLOCK_S, +TILES * BLOCK_S) of sequence b (see module doc)."""
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(cl_ptr + b).to(tl.int32)
    start = chunk * (TILES * BLOCK_S)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    qt = tl.load(q_ptr + b * q_sb + d[:, None] * q_sd + h[None, :] * q_sh, mask=h[None, :] < H, other=0.0)
    qt = qt.to(tl.float32)  # [D, BLOCK_H]
    q_hi = _operand(qt, DT, EMULATE)
    if SPLIT_Q:  # q wider than DT: q = q_hi + q_lo to ~16 bits
        q_lo = _operand(qt - q_hi.to(tl.float32), DT, EMULATE)
    w = tl.load(w_ptr + b * w_sb + h * w_sh, mask=h < H, other=0.0).to(tl.float32)

    rows = tl.arange(0, BLOCK_S)
    out_row = out_ptr + b * out_sb
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        s0 = start + t * BLOCK_S
        live = s0 < ctx  # tiles at or past context_len read nothing and score -inf
        page = tl.load(bt_ptr + b * bt_sb + (s0 // PAGE) * bt_sm, mask=live, other=0).to(tl.int64)
        slot = s0 % PAGE + rows
        valid = s0 + rows < ctx
        k = tl.load(k_ptr + page * k_sp + slot[:, None] * k_st + d[None, :] * k_sd, mask=valid[:, None], other=0.0)
        kd = _operand(k.to(tl.float32), DT, EMULATE) if EMULATE else k.to(DT)  # e4m3 codes are exact in DT
        acc = tl.dot(kd, q_hi, input_precision=PRECISION)  # [BLOCK_S, BLOCK_H] fp32
        if SPLIT_Q:
            acc = tl.dot(kd, q_lo, acc, input_precision=PRECISION)
        score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        if HAS_SCALE:  # ReLU commutes with the positive per-token key scale
            score = score * tl.load(ks_ptr + page * ks_sp + slot * ks_st, mask=valid, other=0.0)
        pos = s0 + rows
        tl.store(out_row + pos, tl.where(valid, score, float("-inf")), mask=pos < max_context)


def _default_block_s(block_size: int) -> int:
    """128 tokens per tile where that divides block_size (the H200 sweep's best,
    benchmarks/results/sweep_decode.json), else the largest power of two dividing it."""
    return min(128, block_size & -block_size)


def _default_tiles(batch: int) -> tuple[int, int]:
    """(tiles per program, pipeline stages): one tile per program spreads a batch of 1 over every SM;
    large batches fill the GPU anyway and prefer long pipelined runs (H200: sweep_decode.json,
    scan_variants.json)."""
    return (1, 2) if batch <= 8 else (16, 3)


def paged_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    dtype: torch.dtype,
    max_context: int | None = None,
    out: torch.Tensor | None = None,
    *,
    block_s: int | None = None,
    tiles: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Decode-time indexer scan: one query per sequence scores every cached index key.

    q [B, Hi, D]; weights [B, Hi]; key_cache [P, block_size, D] (bf16 or e4m3, any strides: pages
    are read in place) with key_scales [P, block_size] fp32 for e4m3 (None otherwise); block_tables
    [B, M] page ids; context_lens [B]. Keys are dequantised to `dtype` before scoring. Returns fp32
    [B, max_context]: score[b, s] = sum_h weights[b, h] ReLU(q[b, h] . k_s), -inf for s >= context_lens[b].

    max_context: the output width, >= max(context_lens) (not checked); None takes
    int(context_lens.max()), a host sync (pass it under CUDA graphs). out: optional fp32 [B,
    max_context] buffer to fill (every element is written). block_s (tokens per tile, a power of two
    >= 16 dividing block_size; default 128 where it divides), tiles (tiles per program), num_warps, num_stages: launch
    tuning, no effect on the result.
    """
    B, H, D = q.shape
    _, page, Dk = key_cache.shape
    if Dk != D or D < 16 or D & (D - 1):
        raise ValueError(f"q has head dim {D} and keys {Dk}: they must agree and be a power of two >= 16")
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_DOT_DTYPES)}, got {dtype}")
    if (key_scales is not None) != (key_cache.dtype == torch.float8_e4m3fn):
        raise ValueError("key_scales must be given exactly when the key cache is e4m3")
    block_s = _default_block_s(page) if block_s is None else block_s
    default_tiles, default_stages = _default_tiles(B)
    tiles = default_tiles if tiles is None else tiles
    num_stages = default_stages if num_stages is None else num_stages
    if page % block_s or block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s {block_s} must be a power of two >= 16 dividing block_size {page}")
    if max_context is None:
        max_context = int(context_lens.max())
    if out is None:
        out = torch.empty(B, max_context, dtype=torch.float32, device=q.device)
    elif out.shape != (B, max_context) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be fp32 [B, max_context] = [{B}, {max_context}] with unit stride along tokens")
    if B == 0 or max_context == 0:
        return out
    ks = key_scales if key_scales is not None else key_cache  # unused placeholder without scales
    emulate = q.device.type != "cuda"
    dot_dtype = torch.float16 if key_scales is not None and dtype == torch.bfloat16 else dtype
    split_q = dot_dtype != torch.float32 and q.dtype not in (dot_dtype, torch.bfloat16)
    grid = (triton.cdiv(max_context, block_s * tiles), B)
    _indexer_scores_kernel[grid](
        q, weights, key_cache, ks, block_tables, context_lens, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), ks.stride(0), ks.stride(1),
        block_tables.stride(0), block_tables.stride(1), out.stride(0),
        H, max_context,
        D=D, PAGE=page, BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_S=block_s, TILES=tiles,
        HAS_SCALE=key_scales is not None, DT=_DOT_DTYPES[dot_dtype], SPLIT_Q=split_q, EMULATE=emulate,
        PRECISION="ieee" if emulate or dot_dtype == torch.float32 else None,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )
    return out
