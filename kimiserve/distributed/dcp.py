"""Decode context parallel (DCP) attention: a sequence's tokens spread over the D ranks of a DCP
group, an exact top-k merge of the ranks' candidates, attention by the owners, a log-sum-exp merge.

Placement (interleave I, a multiple of the page size; D ranks): token p of a sequence lives on DCP
rank (p // I) % D at local position (p // (I * D)) * I + p % I of that rank's own token sequence,
so each rank stores its tokens contiguously in its own pages (one block table per sequence per
rank, written only by that rank). Of a sequence's first L tokens, rank r holds
(L // (I * D)) * I + clamp(L % (I * D) - r * I, 0, I); rank 0 holds the most.

One decode step of one MLA layer on each rank of the group (`dcp_sparse_decode`):

1. heads: DCP sits inside the TP group, so a rank has its TP shard's query heads only; the group
   all-gathers the absorbed queries (q_abs and q_pe, fp32) so every rank attends for all D x
   H_local heads of the group over its own tokens. The indexer is replicated (every rank has every
   index head), so the index scan needs no exchange.
2. selection (the indexer, context > index_topk): each rank scans its own index keys
   (`paged_indexer_scores` over its local pages: [B, S_local] fp32), keeps its local top-c
   (c = min(k, tokens rank 0 holds of the longest context): the same c on every rank), and the
   ranks all-gather only the (score, global position) pairs, 8 bytes each. Every rank then takes
   the global top-k of the D x c candidates with the single-device comparator (`topk_reference`:
   a stable descending sort of the scores in position order: higher score first, among equal
   scores the smaller position; -inf never; -1 padding). This is exact: a token in the global
   top-k has fewer than k tokens before it in that total order, so fewer than k of its own rank's
   tokens (a rank's local order is its tokens' global order, the local position being increasing
   in the global one), so it is in its rank's local top-k. Given bit-identical scores the
   selection is bit-identical to `topk_reference` over every token's score, order included.
   Dense (no indexer, or context <= k: every token selected): each rank takes all its tokens.
3. attention: each rank runs sparse MLA over the selected tokens it owns, for all the group's
   heads, keeping the log-sum-exp per (row, head) (`paged_sparse_mla_decode_lse`; a rank that owns
   none of a row's tokens gives out 0, lse -inf: zero weight).
4. merge: an all-to-all sends each rank the partial outputs and lses of its own heads from every
   rank ([D, B, H_local, L + 1] fp32); it merges them in rank order:
   out = sum_r exp(lse_r - M) out_r / sum_r exp(lse_r - M), M = max_r lse_r. The result equals
   single-device sparse MLA within fp32 rounding.

Collectives per rank per step per MLA layer (batch B, all linear in B): one all-gather of
B x H_local x (L + R) x 4 bytes (queries), one all-gather of B x c x 8 bytes (candidates; none in
the dense case) and one all-to-all of B x D x H_local x (L + 1) x 4 bytes (partials); see
benchmarks/dcp_traffic.py for the bytes each rank sends.

Pure torch + torch.distributed (gloo and NCCL); at D = 1 every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from kimiserve.cache.formats import latent_scale_of
from kimiserve.ops.indexer.reference import paged_indexer_scores
from kimiserve.ops.mla.reference import paged_sparse_mla_decode_lse
from kimiserve.ops.topk.reference import topk_reference

NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------ placement
def _clamp(x, lo: int, hi: int):
    if isinstance(x, torch.Tensor):
        return x.clamp(lo, hi)
    return min(max(x, lo), hi)


def check_interleave(interleave: int, block_size: int | None = None, dcp_size: int = 1) -> None:
    """ValueError unless interleave is a positive multiple of block_size (when given) and dcp_size >= 1."""
    if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1:
        raise ValueError(f"the DCP interleave must be a positive integer, got {interleave!r}")
    if block_size is not None and interleave % block_size:
        raise ValueError(f"the DCP interleave ({interleave}) must be a multiple of the page size ({block_size}) "
                         f"so that each rank's tokens fill whole pages of its own")
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or dcp_size < 1:
        raise ValueError(f"the DCP size must be a positive integer, got {dcp_size!r}")


def dcp_owner(pos, interleave: int, dcp_size: int):
    """The DCP rank holding token position(s) pos: (pos // I) % D (ints or integer tensors, pos >= 0)."""
    return (pos // interleave) % dcp_size


def dcp_local_position(pos, interleave: int, dcp_size: int):
    """Where token pos sits in its owner's own token sequence: (pos // (I * D)) * I + pos % I."""
    return (pos // (interleave * dcp_size)) * interleave + pos % interleave


def dcp_global_position(local, rank, interleave: int, dcp_size: int):
    """Inverse of `dcp_local_position` for rank `rank`: (local // I) * I * D + rank * I + local % I.
    Tensors keep -1 (no token) as -1."""
    g = (local // interleave) * interleave * dcp_size + rank * interleave + local % interleave
    if isinstance(g, torch.Tensor) and isinstance(local, torch.Tensor):
        g = torch.where(local < 0, torch.full_like(g, -1), g)
    return g


def dcp_local_count(length, rank, interleave: int, dcp_size: int):
    """How many of a sequence's first `length` tokens rank `rank` holds (ints or tensors, vectorised):
    (L // (I * D)) * I + clamp(L % (I * D) - rank * I, 0, I)."""
    cycle = interleave * dcp_size
    return (length // cycle) * interleave + _clamp(length % cycle - rank * interleave, 0, interleave)


def dcp_local_tokens(positions: torch.Tensor, rank: int, interleave: int, dcp_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the cache writes: (bool mask of the positions this rank owns, their local positions; -1 elsewhere).
    A new token at position p goes to page local_table[lp // block_size], offset lp % block_size, lp
    its local position, on its owner only."""
    mine = dcp_owner(positions, interleave, dcp_size) == rank
    local = dcp_local_position(positions, interleave, dcp_size)
    return mine, torch.where(mine, local, torch.full_like(local, -1))


def dcp_local_pages(length, rank, interleave: int, dcp_size: int, block_size: int):
    """Pages of rank `rank`'s block table for a sequence of `length` tokens: ceil(local count / block_size)."""
    n = dcp_local_count(length, rank, interleave, dcp_size)
    return -(-n // block_size)


# ------------------------------------------------------------------------------------------ the group
@dataclass(frozen=True)
class DcpGroup:
    """A rank's DCP group: the process group (None at size 1), its rank in it, its size."""

    group: object | None
    rank: int
    size: int

    @classmethod
    def of(cls, ctx) -> "DcpGroup":
        """From a `ParallelContext` (the DCP group is dcp consecutive ranks of the TP group)."""
        return cls(ctx.dcp_group, ctx.dcp_rank, ctx.dcp_size)

    @classmethod
    def single(cls) -> "DcpGroup":
        return cls(None, 0, 1)


def _as_group(dcp) -> DcpGroup:
    return dcp if isinstance(dcp, DcpGroup) else DcpGroup.of(dcp)


def _all_gather(t: torch.Tensor, dcp: DcpGroup, async_op: bool = False):
    """[D, *t.shape]: every rank's t in group-rank order (and the work handle when async_op)."""
    t = t.contiguous()
    if dcp.size == 1:
        out = t.unsqueeze(0)
        return (out, None) if async_op else out
    out = t.new_empty(dcp.size * t.shape[0], *t.shape[1:]) if t.dim() else t.new_empty(dcp.size)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, t if t.dim() else t.view(1), group=dcp.group, async_op=async_op)
    out = out.view(dcp.size, *t.shape)
    return (out, work) if async_op else out


def _all_to_all(t: torch.Tensor, dcp: DcpGroup) -> torch.Tensor:
    """t [D, ...]: chunk j goes to group rank j; returns [D, ...] with chunk r from group rank r."""
    t = t.contiguous()
    if dcp.size == 1:
        return t
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=dcp.group)
    return out


# ------------------------------------------------------------------------------------------ selection
@dataclass
class DcpSelection:
    positions: torch.Tensor
    """int64 [B, k]: the selected global token positions, best first, -1 padded (bit-identical to
    `topk_reference` over every token's score; the same on every rank)."""
    local: torch.Tensor
    """int64 [B, k]: where positions[b, j] is this rank's token, its local position (index into this
    rank's own token sequence / page table), else -1."""
    scores: torch.Tensor
    """fp32 [B, k]: the selected scores (-inf at the padding)."""


def dcp_topk_merge(local_scores: torch.Tensor, local_lens: torch.Tensor, k: int, dcp, interleave: int, *,
                   candidates: int | None = None, topk: Callable = topk_reference) -> DcpSelection:
    """The exact global top-k from each rank's local scores.

    local_scores: fp32 [B, S_local] scores of this rank's tokens by local position (columns at or
    past local_lens[b] are ignored; `paged_indexer_scores` over the rank's own pages gives them);
    local_lens [B]: this rank's token counts; k: index_topk; dcp: a `DcpGroup` or `ParallelContext`;
    candidates: how many (score, position) pairs each rank sends per row, the same on every rank,
    <= k (default k; `dcp_sparse_decode` passes min(k, tokens rank 0 holds of the longest context),
    a bound on every rank's token count); topk: the local top-k op ((scores, k, lens) -> positions,
    any order, -1 padded: `topk_reference` or the Triton `topk_indices`).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    dcp = _as_group(dcp)
    c = k if candidates is None else candidates
    if not 1 <= c <= k:
        raise ValueError(f"candidates must be in [1, k={k}], got {c}")
    B, S = local_scores.shape
    scores = local_scores.float()
    if S < c:  # fewer local columns than candidates: pad (never selected)
        scores = torch.cat([scores, scores.new_full((B, c - S), NEG_INF)], dim=1)
    idx = topk(scores, c, local_lens)
    valid = idx >= 0
    s = torch.gather(scores, 1, idx.clamp_min(0)).masked_fill(~valid, NEG_INF)
    valid &= s != NEG_INF
    gpos = dcp_global_position(idx, dcp.rank, interleave, dcp.size).masked_fill(~valid, -1)
    # one collective: (score bits, position) as int32 pairs, 8 bytes per candidate
    packed = torch.stack([s.masked_fill(~valid, NEG_INF).view(torch.int32), gpos.to(torch.int32)], dim=-1)
    everyone = _all_gather(packed, dcp)  # [D, B, c, 2]
    everyone = everyone.permute(1, 0, 2, 3).reshape(B, dcp.size * c, 2)
    cand_s = everyone[..., 0].contiguous().view(torch.float32)
    cand_p = everyone[..., 1].to(torch.int64)
    # the single-device comparator: candidates in position order, then a stable descending sort
    order = torch.sort(torch.where(cand_p >= 0, cand_p, torch.iinfo(torch.int64).max), dim=1, stable=True).indices
    cand_p = torch.gather(cand_p, 1, order)
    cand_s = torch.gather(cand_s, 1, order).masked_fill(cand_p < 0, NEG_INF)
    best = torch.sort(cand_s, dim=1, descending=True, stable=True).indices[:, :k]
    sel_s = torch.gather(cand_s, 1, best)
    sel_p = torch.gather(cand_p, 1, best)
    dead = (sel_p < 0) | (sel_s == NEG_INF)
    sel_p = sel_p.masked_fill(dead, -1)
    sel_s = sel_s.masked_fill(dead, NEG_INF)
    if sel_p.shape[1] < k:
        sel_p = torch.cat([sel_p, sel_p.new_full((B, k - sel_p.shape[1]), -1)], dim=1)
        sel_s = torch.cat([sel_s, sel_s.new_full((B, k - sel_s.shape[1]), NEG_INF)], dim=1)
    mine = (sel_p >= 0) & (dcp_owner(sel_p, interleave, dcp.size) == dcp.rank)
    local = torch.where(mine, dcp_local_position(sel_p, interleave, dcp.size), torch.full_like(sel_p, -1))
    return DcpSelection(sel_p, local, sel_s)


# ------------------------------------------------------------------------------------------ heads and merge
def dcp_gather_heads(q_abs: torch.Tensor, q_pe: torch.Tensor, dcp, async_op: bool = False):
    """All-gather the DCP group's queries: q_abs [B, H_local, L], q_pe [B, H_local, R] -> the group's
    [B, D * H_local, L] and [B, D * H_local, R] in the compute dtype (fp32 or wider; exact), group
    rank j's heads at j * H_local. With async_op returns a function that waits and returns them."""
    dcp = _as_group(dcp)
    dt = torch.promote_types(torch.promote_types(q_abs.dtype, q_pe.dtype), torch.float32)
    B, H, L = q_abs.shape
    packed = torch.cat([q_abs.to(dt), q_pe.to(dt)], dim=-1)  # [B, H, L + R]
    gathered, work = _all_gather(packed, dcp, async_op=True)

    def finish():
        if work is not None:
            work.wait()
        allq = gathered.permute(1, 0, 2, 3).reshape(B, dcp.size * H, -1)
        return allq[..., :L], allq[..., L:]

    return finish if async_op else finish()


def lse_merge(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Merge partial attention outputs over disjoint token sets: outs [D, ..., L], lses [D, ...] ->
    [..., L] = sum_r w_r outs[r] / sum_r w_r, w_r = exp(lses[r] - max_r lses[r]), summed in index
    order. A partial with lse -inf has weight 0 and its output is ignored (even NaN); where every
    lse is -inf (no token at all) the result is 0."""
    m = lses.amax(dim=0)
    m = m.masked_fill(m == NEG_INF, 0.0)
    w = torch.exp(lses - m)  # 0 where lse = -inf
    live = (w > 0).unsqueeze(-1)
    num = torch.where(live, w.unsqueeze(-1) * outs, torch.zeros((), dtype=outs.dtype, device=outs.device)).sum(0)
    den = w.sum(0).unsqueeze(-1)
    merged = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))
    if out is None:
        return merged
    out.copy_(merged)
    return out


def dcp_merge_all(part: torch.Tensor, lse: torch.Tensor, dcp, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank gets the whole merged output: part [B, H, L], lse [B, H] (the same heads on every
    rank, its own tokens) are all-gathered and merged in rank order."""
    dcp = _as_group(dcp)
    packed = _all_gather(torch.cat([part, lse.to(part.dtype).unsqueeze(-1)], dim=-1), dcp)  # [D, B, H, L + 1]
    return lse_merge(packed[..., :-1], packed[..., -1], out)


def dcp_merge_heads(part: torch.Tensor, lse: torch.Tensor, dcp, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each rank gets its own heads' merged output: part [B, D * H_local, L] and lse [B, D * H_local]
    (all the group's heads over this rank's tokens) -> [B, H_local, L]. One all-to-all of
    [D, B, H_local, L + 1] (partials with their lse), merged in rank order."""
    dcp = _as_group(dcp)
    B, H, L = part.shape
    if H % dcp.size:
        raise ValueError(f"{H} heads do not split over {dcp.size} DCP ranks")
    packed = torch.cat([part, lse.to(part.dtype).unsqueeze(-1)], dim=-1).view(B, dcp.size, H // dcp.size, L + 1)
    received = _all_to_all(packed.transpose(0, 1), dcp)  # [D, B, H_local, L + 1], chunk r from rank r
    return lse_merge(received[..., :-1], received[..., -1], out)


# ------------------------------------------------------------------------------------------ the decode step
def dcp_sparse_decode(
    q_abs: torch.Tensor,
    q_pe: torch.Tensor,
    index_q: torch.Tensor | None,
    index_w: torch.Tensor | None,
    pool,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context: int,
    topk: int | None,
    scale: float,
    dtype: torch.dtype,
    dcp,
    interleave: int,
    *,
    local_lens: torch.Tensor | None = None,
    indexer_scores: Callable = paged_indexer_scores,
    topk_op: Callable = topk_reference,
    sparse_mla_lse: Callable = paged_sparse_mla_decode_lse,
    out: torch.Tensor | None = None,
    return_selection: bool = False,
):
    """One MLA layer's decode attention under DCP, in place of scan + top-k + sparse MLA in `attend_pages`.

    Every rank of the DCP group calls it with:
    q_abs [B, H_local, L]: its TP shard's absorbed queries (q_nope @ w_kc, compute dtype);
    q_pe [B, H_local, R]; index_q [B, Hi, Di], index_w [B, Hi]: the replicated indexer's queries and
    head weights (all index heads; None without an indexer); pool, layer: its own `PagePool` and the
    MLA layer's cache index; block_tables [B, M_local]: its own pages of each row's sequence (padded
    with any valid page id, e.g. 0); context_lens [B]: the GLOBAL context lengths (the query is the
    token at context_len - 1, already written to its owner's pages); max_context: >= every global
    context length, on the host (the same on every rank; it decides dense vs sparse exactly as
    `attend_pages` does: sparse when an indexer is present and max_context > topk); topk:
    index_topk (None: dense); scale: softmax scale; dtype: the model dtype; dcp: a `ParallelContext`
    or `DcpGroup`; interleave: I (a multiple of pool.block_size). local_lens: this rank's token
    counts (default: from context_lens). indexer_scores / topk_op / sparse_mla_lse: the ops (the
    `DecodeOps` indexer_scores and topk; an lse-returning sparse MLA).

    Returns [B, H_local, L] in the compute dtype: this rank's heads' attention output in latent
    space, as single-device `attend_pages` gives before w_vc (within fp32 rounding), written into
    `out` when given; with return_selection, (that, `DcpSelection` or None in the dense case).
    """
    dcp = _as_group(dcp)
    D, rank = dcp.size, dcp.rank
    check_interleave(interleave, pool.block_size, D)
    if local_lens is None:
        local_lens = dcp_local_count(context_lens, rank, interleave, D)
    local_max = dcp_local_count(max_context, rank, interleave, D)
    finish_heads = dcp_gather_heads(q_abs, q_pe, dcp, async_op=True)  # overlaps the scan where the backend can
    B = q_abs.shape[0]
    selection = None
    if index_q is not None and topk is not None and max_context > topk:
        if local_max > 0:
            scales = pool.index_scale[layer] if pool.index_scale else None
            # a row with no token here reads slot 0 (valid: tables are padded with a real page) and is masked
            scores = indexer_scores(index_q, index_w, pool.index_key[layer], scales, block_tables,
                                    local_lens.clamp_min(1), dtype, local_max, rotation=pool.index_rotation)
            scores = scores.masked_fill((local_lens == 0).unsqueeze(1), NEG_INF)
        else:
            scores = torch.full((B, 0), NEG_INF, device=q_abs.device)
        candidates = min(topk, dcp_local_count(max_context, 0, interleave, D))
        selection = dcp_topk_merge(scores, local_lens, topk, dcp, interleave, candidates=candidates, topk=topk_op)
        idx = selection.local
    else:  # dense: every token selected, each rank attends over all of its own
        idx = torch.arange(local_max, device=q_abs.device).expand(B, local_max)
        idx = idx.masked_fill(idx >= local_lens.unsqueeze(1), -1)
    q_all, q_pe_all = finish_heads()
    latent_scale = latent_scale_of(pool.kv_cache_dtype, pool.latent_scales[layer])
    part, lse = sparse_mla_lse(q_all, q_pe_all, pool.latent[layer], latent_scale, block_tables, idx, scale, dtype)
    merged = dcp_merge_heads(part, lse, dcp, out)
    return (merged, selection) if return_selection else merged
