"""Causal top-k selection of tokens by indexer score.

Tie rule (every kernel must match it): among equal scores the earlier token (smaller index)
wins. Positions after the query are never selected; when fewer than k tokens are visible the
row is padded with -1.
"""

import torch


def causal_topk(scores: torch.Tensor, query_positions: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best visible tokens per query, best first.

    scores: [B, T, S]; query_positions: [B, T] or [T] (token s is visible to the query at
    position p when s <= p). Returns int64 [B, T, k], -1 where fewer than k tokens are visible.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    B, T, S = scores.shape
    pos = query_positions.expand(B, T) if query_positions.dim() == 1 else query_positions
    visible = torch.arange(S, device=scores.device).view(1, 1, S) <= pos.unsqueeze(-1)
    masked = scores.masked_fill(~visible, float("-inf"))
    # a stable descending sort keeps equal scores in index order: the earlier token wins
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    valid = torch.gather(visible, -1, order)
    order = order.masked_fill(~valid, -1)
    if order.shape[-1] < k:
        order = torch.cat([order, order.new_full((B, T, k - order.shape[-1]), -1)], dim=-1)
    return order


def selection_mask(indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Boolean [B, T, S] mask with True at the selected (non -1) indices."""
    B, T, _ = indices.shape
    mask = torch.zeros(B, T, num_keys + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, torch.where(indices < 0, num_keys, indices), True)
    return mask[..., :num_keys]


def topk_reference(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of scores [B, S]: `causal_topk` for one query at position lengths[b] - 1 (all S when
    lengths is None), int64 [B, k] best first, -1 padded; selected -inf scores are replaced by -1
    (the Triton `topk_indices` never selects them). The oracle of `kimiserve.ops.topk.triton`:
    compare selected SETS (the kernel returns them in position order)."""
    B, S = scores.shape
    if lengths is None:
        lengths = torch.full((B,), S, dtype=torch.int64, device=scores.device)
    idx = causal_topk(scores.unsqueeze(1), (lengths.to(torch.int64) - 1).view(B, 1), k)[:, 0]
    picked = torch.gather(scores, 1, idx.clamp_min(0))
    return idx.masked_fill((idx < 0) | (picked == float("-inf")), -1)
