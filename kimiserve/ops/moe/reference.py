"""MoE routing (noaux_tc) and expert computation."""

from __future__ import annotations

from typing import Callable

import torch


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    score_func: str = "sigmoid",
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select experts per token from fp32 router logits [N, E].

    Scores are sigmoid (or softmax) of the logits; the correction bias is added for the choice
    only, the weights are the unbiased scores of the chosen experts, renormalised to sum to one
    and scaled. With groups, only experts of the topk_group best groups (a group scores the sum
    of its two best biased scores) are eligible. Returns (ids int64 [N, k], weights fp32 [N, k]).
    """
    logits = router_logits.float()
    if score_func == "sigmoid":
        scores = logits.sigmoid()
    elif score_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    N, E = choice.shape
    if num_expert_group > 1 and topk_group < num_expert_group:
        grouped = choice.view(N, num_expert_group, E // num_expert_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // num_expert_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling_factor


def experts_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for every token n.

    x: [N, h]; expert_fn(e, rows) runs expert e on rows of x (h -> h). Outputs are combined in
    fp32 and returned in x's dtype.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        y = expert_fn(e, x[token_idx])
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot].unsqueeze(-1).float())
    return out.to(x.dtype)
