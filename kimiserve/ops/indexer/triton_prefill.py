"""The indexer scan of a prefill chunk as one Triton kernel: `prefill_indexer_scores`, the contract of
`reference.prefill_indexer_scores` (many query rows of ONE sequence score its cached keys).

The decode kernel (`triton.paged_indexer_scores`) runs one program per (query row, key chunk), so
a chunk of n query rows reads every key n times (from L2 at best: 132 bytes of an e4m3 key and its
scale for 2 x 32 x 128 FLOPs). Here a program owns BLOCK_Q consecutive query rows and a chunk of
keys: it loads the rows' queries once (each [D, Hi], in the dot dtype), then for each tile of
BLOCK_S keys (read in place from the page of the one block table) runs one [BLOCK_S, D] x [D, Hi]
dot per query row on the same key tile, ReLU, times that row's head weights, summed over heads, times
the key's fp32 scale, -inf at and past the row's context length. Keys are read BLOCK_Q times fewer.

Arithmetic as the decode kernel's (its `_operand` helper, the same dot dtypes: e4m3 codes exact in
fp16, bf16 keys in `dtype`, a q wider than the dot dtype split in two parts, IEEE fp32 dots for fp32
and under the interpreter); each score's products and sums are the decode kernel's, so the two agree
up to the fp32 summation order inside the dot. MXFP4 keys are not handled here: the wrapper hands
them to the decode kernel with the table expanded to every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.indexer.triton import (_DOT_DTYPES, _default_block_s, _dot_operands, _operand, _scores_out,
                                         paged_indexer_scores, rotate_query)

BLOCK_Q = 1
"""Query rows per program by default; 1 runs the decode kernel (one row per program) until the H200
sweep of benchmarks/prefill_attention.py picks a tile."""
TILES = 8  # key tiles per program


@triton.jit
def _prefill_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, cl_ptr, out_ptr,
    q_sb, q_sh, q_sd, w_sb, w_sh, k_sp, k_st, k_sd, ks_sp, ks_st, bt_sm, out_sb,
    B, H, max_context,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILES: tl.constexpr, HAS_SCALE: tl.constexpr, DT: tl.constexpr, SPLIT_Q: tl.constexpr,
    EMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Scores of key positions [chunk * TILES * BLOCK_S, +TILES * BLOCK_S) for query rows
    [qb * BLOCK_Q, +BLOCK_Q) (see the module doc)."""
    chunk = tl.program_id(0)
    qb = tl.program_id(1)
    start = chunk * (TILES * BLOCK_S)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    q_hi = ()  # per query row: [D, BLOCK_H] in the dot dtype (q_lo: the rest of a wide q)
    q_lo = ()
    w = ()
    ctx = ()
    ctx_max = 0
    for i in tl.static_range(BLOCK_Q):
        row = qb * BLOCK_Q + i
        live = row < B
        r64 = row.to(tl.int64)
        qt = tl.load(q_ptr + r64 * q_sb + d[:, None] * q_sd + h[None, :] * q_sh, mask=(h[None, :] < H) & live,
                     other=0.0).to(tl.float32)
        hi = _operand(qt, DT, EMULATE)
        q_hi = q_hi + (hi,)
        if SPLIT_Q:
            q_lo = q_lo + (_operand(qt - hi.to(tl.float32), DT, EMULATE),)
        w = w + (tl.load(w_ptr + r64 * w_sb + h * w_sh, mask=(h < H) & live, other=0.0).to(tl.float32),)
        c = tl.load(cl_ptr + row, mask=live, other=0).to(tl.int32)
        ctx = ctx + (c,)
        ctx_max = tl.maximum(ctx_max, c)

    rows = tl.arange(0, BLOCK_S)
    for t in range(TILES):
        s0 = start + t * BLOCK_S
        pos = s0 + rows
        if s0 < max_context:
            live = s0 < ctx_max  # a tile no row of the block sees reads nothing and scores -inf
            page = tl.load(bt_ptr + (s0 // PAGE) * bt_sm, mask=live, other=0).to(tl.int64)
            slot = s0 % PAGE + rows
            valid = pos < ctx_max
            k = tl.load(k_ptr + page * k_sp + slot[:, None] * k_st + d[None, :] * k_sd, mask=valid[:, None],
                        other=0.0)
            kd = _operand(k.to(tl.float32), DT, EMULATE) if EMULATE else k.to(DT)  # e4m3 codes are exact in DT
            if HAS_SCALE:
                ks = tl.load(ks_ptr + page * ks_sp + slot * ks_st, mask=valid, other=0.0)
            for i in tl.static_range(BLOCK_Q):
                acc = tl.dot(kd, q_hi[i], input_precision=PRECISION)  # [BLOCK_S, BLOCK_H] fp32
                if SPLIT_Q:
                    acc = tl.dot(kd, q_lo[i], acc, input_precision=PRECISION)
                score = tl.sum(tl.maximum(acc, 0.0) * w[i][None, :], axis=1)
                if HAS_SCALE:  # ReLU commutes with the positive per-token key scale
                    score = score * ks
                row = qb * BLOCK_Q + i
                tl.store(out_ptr + row.to(tl.int64) * out_sb + pos, tl.where(pos < ctx[i], score, float("-inf")),
                         mask=(pos < max_context) & (row < B))


def prefill_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    dtype: torch.dtype,
    max_context: int,
    out: torch.Tensor | None = None,
    *,
    rotation: torch.Tensor | None = None,
    block_s: int | None = None,
    block_q: int = BLOCK_Q,
    tiles: int = TILES,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """`reference.prefill_indexer_scores`: query rows q [n, Hi, D], weights [n, Hi] of one sequence
    whose pages are `block_table` [M] score its keys: fp32 [n, max_context], -inf at s >= context_lens[i].
    bf16 or e4m3 keys (with fp32 key_scales) run the query-tiled kernel (block_q rows per program; 1:
    the decode kernel); MXFP4 keys the decode kernel. block_s, block_q, tiles, num_warps, num_stages:
    launch tuning, no effect on the result beyond the fp32 summation order."""
    if block_table.dim() != 1:
        raise ValueError(f"block_table must be one sequence's page ids [M], got shape {tuple(block_table.shape)}")
    n = q.shape[0]
    if key_cache.dtype == torch.uint8 or block_q == 1:  # MXFP4 keys, or tiles of one row: the decode kernel
        return paged_indexer_scores(q, weights, key_cache, key_scales, block_table.expand(n, -1), context_lens, dtype,
                                    max_context, out, rotation=rotation)
    if rotation is not None:
        q = rotate_query(q, rotation)
    _, H, D = q.shape
    _, page, Dk = key_cache.shape
    if Dk != D or D < 16 or D & (D - 1):
        raise ValueError(f"q has head dim {D} and keys {Dk}: they must agree and be a power of two >= 16")
    if (key_scales is not None) != (key_cache.dtype == torch.float8_e4m3fn):
        raise ValueError("key_scales must be given exactly when the key cache is e4m3")
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_DOT_DTYPES)}, got {dtype}")
    block_s = _default_block_s(page) if block_s is None else block_s
    if page % block_s or block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s {block_s} must be a power of two >= 16 dividing block_size {page}")
    out = _scores_out(out, "n", n, max_context, q.device)
    if n == 0 or max_context == 0:
        return out
    emulate = q.device.type != "cuda"
    dot_dtype, split_q = _dot_operands(q, key_scales, dtype)
    ks = key_scales if key_scales is not None else key_cache  # unused placeholder without scales
    grid = (triton.cdiv(max_context, block_s * tiles), triton.cdiv(n, block_q))
    _prefill_scores_kernel[grid](
        q, weights, key_cache, ks, block_table, context_lens, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), ks.stride(0), ks.stride(1),
        block_table.stride(0), out.stride(0),
        n, H, max_context,
        D=D, PAGE=page, BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_S=block_s, BLOCK_Q=block_q, TILES=tiles,
        HAS_SCALE=key_scales is not None, DT=_DOT_DTYPES[dot_dtype], SPLIT_Q=split_q, EMULATE=emulate,
        PRECISION="ieee" if emulate or dot_dtype == torch.float32 else None, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


__all__ = ["prefill_indexer_scores"]
