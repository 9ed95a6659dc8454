"""Multi-head latent attention over cached latents, expanded and absorbed forms.

Per token the cache holds c (kv_lora_rank values, normed) and k_pe (qk_rope_head_dim values,
shared by all heads, never rotated: the model is NoPE). kv_b_proj maps c to per-head k_nope and
v: w_kc [H, dn, L], w_vc [H, dv, L]. `mask` [B, T, S] says which keys each query reads (causal
and, with an indexer, the selected top-k).
"""

import torch

from kimiserve.ops.dtypes import compute_dtype
from kimiserve.ops.quant.reference import dequantize_nvfp4


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (dn + dv), L] -> (w_kc [H, dn, L], w_vc [H, dv, L])."""
    w = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def _softmax_masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)


def mla_expanded(q_nope, q_pe, c, k_pe, w_kc, w_vc, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """Attention with per-head keys and values materialised from the latent.

    q_nope [B, T, H, dn], q_pe [B, T, H, dr], c [B, S, L], k_pe [B, S, dr] -> [B, T, H, dv] (q's dtype).
    """
    dt = compute_dtype(q_nope, c, w_kc)
    c = c.to(dt)
    k_nope = torch.einsum("bsl,hdl->bshd", c, w_kc.to(dt))
    v = torch.einsum("bsl,hdl->bshd", c, w_vc.to(dt))
    logits = torch.einsum("bthd,bshd->bhts", q_nope.to(dt), k_nope)
    logits = logits + torch.einsum("bthr,bsr->bhts", q_pe.to(dt), k_pe.to(dt))
    probs = _softmax_masked(logits * scale, mask)
    return torch.einsum("bhts,bshd->bthd", probs, v).to(q_nope.dtype)


def mla_absorbed(q_nope, q_pe, c, k_pe, w_kc, w_vc, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """The same attention computed in latent space: q is absorbed into w_kc, w_vc applied after.

    This is the decode form: it reads only the cached latents (c, k_pe) of the selected tokens.
    """
    dt = compute_dtype(q_nope, c, w_kc)
    q_latent = torch.einsum("bthd,hdl->bthl", q_nope.to(dt), w_kc.to(dt))
    logits = torch.einsum("bthl,bsl->bhts", q_latent, c.to(dt))
    logits = logits + torch.einsum("bthr,bsr->bhts", q_pe.to(dt), k_pe.to(dt))
    probs = _softmax_masked(logits * scale, mask)
    out_latent = torch.einsum("bhts,bsl->bthl", probs, c.to(dt))
    return torch.einsum("bthl,hdl->bthd", out_latent, w_vc.to(dt)).to(q_nope.dtype)


def paged_sparse_mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    latent_scale: float | None,
    block_tables: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode attention in latent space over the selected tokens only, read through page tables.

    q_latent [B, H, L] (q_nope absorbed into w_kc), q_pe [B, H, R]; latent_cache [P, block_size, L + R]
    (bf16, or e4m3 times `latent_scale`), or uint8 [P, block_size, 9 * ceil((L + R) / 16)] NVFP4 rows
    (`kimiserve.ops.quant.reference.quantize_nvfp4`, `latent_scale` the global scale); block_tables [B, M]; indices [B, k] token positions, -1 = none.
    Latents are dequantised to `dtype` (the model dtype), the rest runs in fp32 (or wider).
    Returns the attention output in latent space [B, H, L] (apply w_vc after). Every row must
    select at least one token (a decode query always sees itself); a row of only -1 gives NaN.
    """
    L = q_latent.shape[-1]
    valid = indices >= 0
    pos = indices.clamp_min(0)
    bs = latent_cache.shape[1]
    pages = torch.gather(block_tables, 1, pos // bs)
    c = latent_cache[pages, pos % bs]
    if c.dtype == torch.uint8:  # NVFP4 rows, latent_scale their global scale
        c = dequantize_nvfp4(c, latent_scale, torch.float32, L + q_pe.shape[-1])
    else:  # [B, k, L + R]
        c = c.float()
        if latent_scale is not None:
            c = c * latent_scale
    dt = compute_dtype(q_latent)
    c = c.to(dtype).to(dt)
    logits = torch.einsum("bhl,bkl->bhk", q_latent.to(dt), c[..., :L])
    logits = logits + torch.einsum("bhr,bkr->bhk", q_pe.to(dt), c[..., L:])
    probs = torch.softmax((logits * scale).masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    return torch.einsum("bhk,bkl->bhl", probs, c[..., :L])


def paged_sparse_mla_prefill(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    latent_scale: float | None,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MLA of a prefill chunk's query rows [n, H, L] / [n, H, R], all of ONE sequence whose pages
    are `block_table` [M], each over its own selected tokens indices [n, k]: `paged_sparse_mla_decode`
    with that table for every row, the result [n, H, L] rounded to `dtype` (the model dtype; into
    `out` when given)."""
    if block_table.dim() != 1:
        raise ValueError(f"block_table must be one sequence's page ids [M], got shape {tuple(block_table.shape)}")
    res = paged_sparse_mla_decode(q_latent, q_pe, latent_cache, latent_scale, block_table.expand(q_latent.shape[0], -1),
                                  indices, scale, dtype).to(dtype)
    return res if out is None else out.copy_(res)


def paged_dense_mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    latent_scale: float | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    max_context: int | None = None,
) -> torch.Tensor:
    """Dense decode: `paged_sparse_mla_decode` over every cached token (contexts <= top-k, models
    without an indexer, and the baseline the sparse path is measured against). max_context: >= every
    context length (default: the longest, a host sync)."""
    S = int(context_lens.max()) if max_context is None else max_context
    idx = torch.arange(S, device=q_latent.device).expand(len(context_lens), S)
    idx = idx.masked_fill(idx >= context_lens.unsqueeze(1), -1)
    return paged_sparse_mla_decode(q_latent, q_pe, latent_cache, latent_scale, block_tables, idx, scale, dtype)


def paged_sparse_mla_decode_lse(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    latent_scale: float | None,
    block_tables: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_sparse_mla_decode` that also returns the log-sum-exp of each (row, head)'s scaled
    logits over its selected tokens: (out [B, H, L], lse [B, H]), both in the compute dtype (fp32
    or wider). The partial result of one rank of decode context parallelism (`kimiserve.distributed.dcp`):
    partials over disjoint token sets merge exactly as out = sum_r exp(lse_r - LSE) out_r with
    LSE = log sum_r exp(lse_r). A row that selects no token (indices all -1) gives out 0 and lse -inf
    (zero weight in the merge), not NaN, whatever the unread slot 0 of its first page holds. Same
    gather, dequantisation and logits as `paged_sparse_mla_decode`; out equals its result within
    fp32 rounding wherever a row selects a token (the softmax is written as exp(x - lse))."""
    L = q_latent.shape[-1]
    valid = indices >= 0
    pos = indices.clamp_min(0)
    bs = latent_cache.shape[1]
    pages = torch.gather(block_tables, 1, pos // bs)
    c = latent_cache[pages, pos % bs]
    if c.dtype == torch.uint8:  # NVFP4 rows, latent_scale their global scale
        c = dequantize_nvfp4(c, latent_scale, torch.float32, L + q_pe.shape[-1])
    else:  # [B, k, L + R]
        c = c.float()
        if latent_scale is not None:
            c = c * latent_scale
    dt = compute_dtype(q_latent)
    # unselected slots (-1 read as slot 0 of the row's first page) may hold anything, NaN included: zero them
    c = c.to(dtype).to(dt).masked_fill(~valid.unsqueeze(-1), 0.0)
    logits = torch.einsum("bhl,bkl->bhk", q_latent.to(dt), c[..., :L])
    logits = logits + torch.einsum("bhr,bkr->bhk", q_pe.to(dt), c[..., L:])
    logits = (logits * scale).masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf where the row selects nothing
    probs = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))  # exp(-inf) = 0 there
    return torch.einsum("bhk,bkl->bhl", probs, c[..., :L]), lse


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul in the compute dtype: x [B, H, I], w [H, I, O] -> [B, H, O] (fp32 for bf16
    operands). The decode path's absorption of the query into latent space (w = w_kc) and the output's
    projection back (w = w_vc transposed)."""
    dt = compute_dtype(x, w)
    return torch.einsum("bhi,hio->bho", x.to(dt), w.to(dt))
