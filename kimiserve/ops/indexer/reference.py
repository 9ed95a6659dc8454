"""Lightning-indexer scores (DeepSeek-V3.2 DSA, NoPE): which earlier tokens each query should read."""

import torch

from kimiserve.ops.dtypes import compute_dtype
from kimiserve.ops.quant.reference import dequantize_mxfp4
from kimiserve.ops.topk.reference import topk_reference


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """score[b, t, s] = sum_h weights[b, t, h] * ReLU(q[b, t, h] . k[b, s]).

    q: [B, T, Hi, D] index queries; k: [B, S, D] index keys (one per token, shared by heads);
    weights: [B, T, Hi] per-head weights with every scale already folded in. Causality is not
    applied here (see `kimiserve.ops.topk.reference.causal_topk`). Returns fp32 (or wider) [B, T, S].
    """
    dt = compute_dtype(q, k, weights)
    logits = torch.einsum("bthd,bsd->bths", q.to(dt), k.to(dt)).relu_()
    return torch.einsum("bths,bth->bts", logits, weights.to(dt))


def rotate_query(q: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """q [..., D] @ rotation [D, D] in fp32 (or q's dtype when wider), rounded to q's dtype."""
    dt = torch.promote_types(q.dtype, torch.float32)
    return (q.to(dt) @ rotation.to(dt)).to(q.dtype)


def gather_paged(cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of a paged cache [P, block_size, ...] at token positions [B, S] (>= 0) of each sequence's block table [B, M]."""
    bs = cache.shape[1]
    pages = torch.gather(block_tables, 1, positions // bs)
    return cache[pages, positions % bs]


def paged_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    dtype: torch.dtype,
    max_context: int | None = None,
    *,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-time indexer scan: one query per sequence scores every cached index key.

    q [B, Hi, D]; weights [B, Hi]; key_cache [P, block_size, D] (bf16 or e4m3) with key_scales
    [P, block_size] fp32 for e4m3 (None otherwise); block_tables [B, M] page ids; context_lens [B]
    (the query is the token at position context_len - 1, so all cached tokens are visible).
    bf16 keys are cast to `dtype` (the model dtype); e4m3 keys enter the dot as their exact code
    values and each token's score is multiplied by its fp32 key scale afterwards (the score of the
    dequantised key k * scale, without rounding k * scale to `dtype`). Returns fp32 [B, max_context]
    (default: the longest context, a host sync): score[b, s] = sum_h weights[b, h] ReLU(q[b, h] . k_s),
    -inf for s >= context_lens[b]. MXFP4 keys (uint8 key_cache [P, block_size, 16 * groups] of
    `quantize_mxfp4` codes, key_scales uint8 [P, block_size, groups] ue8m0; a last partial group
    zero-padded) are dequantised exactly to `dtype` (each value is e2m1 times a power of two).
    rotation: the orthonormal [D, D] matrix the keys were stored rotated by (`formats.rotate_index_keys`),
    or None: the query is rotated the same way first (q @ rotation in fp32, rounded to q's dtype), so
    that the scores are those of the unrotated query and keys.
    """
    if rotation is not None:
        q = rotate_query(q, rotation)
    S = int(context_lens.max()) if max_context is None else max_context
    pos = torch.arange(S, device=q.device).expand(q.shape[0], S)
    pos = torch.minimum(pos, (context_lens - 1).unsqueeze(1))  # padding rows read a valid slot; masked below
    keys = gather_paged(key_cache, block_tables, pos)
    if keys.dtype == torch.uint8:  # MXFP4: dequantised exactly (e2m1 times a power of two), first D dims
        keys = dequantize_mxfp4(keys, gather_paged(key_scales, block_tables, pos), torch.float32)[..., : q.shape[-1]]
        key_scales = None
    scores = indexer_scores(q.unsqueeze(1), keys.float().to(dtype), weights.unsqueeze(1))[:, 0].float()
    if key_scales is not None:  # = the scores of the dequantised keys: ReLU commutes with a positive scale
        scores = scores * gather_paged(key_scales, block_tables, pos)
    visible = torch.arange(S, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    return scores.masked_fill(~visible, float("-inf"))


def prefill_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    dtype: torch.dtype,
    max_context: int,
    *,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """The index scan of a prefill chunk: query rows q [n, Hi, D], weights [n, Hi] of ONE sequence
    whose pages are `block_table` [M]; row i sees the keys at positions < context_lens[i] (the row's
    position + 1). Returns fp32 [n, max_context]: `paged_indexer_scores` with that table for every row."""
    if block_table.dim() != 1:
        raise ValueError(f"block_table must be one sequence's page ids [M], got shape {tuple(block_table.shape)}")
    return paged_indexer_scores(q, weights, key_cache, key_scales, block_table.expand(q.shape[0], -1), context_lens,
                                dtype, max_context, rotation=rotation)


def paged_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`paged_indexer_scores` then `topk_reference`: token positions int64 [B, k], best first, -1
    padded (see `causal_topk` for the tie rule)."""
    scores = paged_indexer_scores(q, weights, key_cache, key_scales, block_tables, context_lens, dtype)
    return topk_reference(scores, k, context_lens)
