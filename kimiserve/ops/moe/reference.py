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
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for every token n.

    x: [N, h]; expert_fn(e, rows) runs expert e on rows of x (h -> h). Outputs are combined in
    fp32 and returned in `out_dtype` (default x's dtype).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        y = expert_fn(e, x[token_idx])
        out.index_add_(0, token_idx, y.float() * weights[token_idx, slot].unsqueeze(-1).float())
    return out.to(out_dtype or x.dtype)


def fused_moe_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w3_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the fused MoE kernel (`ops.moe.triton.fused_moe`) computes, on stacked expert weights.

    w1 (gate) / w3 (up) [E, I, h], w2 (down) [E, h, I] in any float dtype, or MXFP4 (uint8 packed
    [E, out, in/2] with ue8m0 scales [E, out, in/32]), dequantised to x's dtype; act(gate, up) as
    `activation.reference` defines it (situ_and_mul / silu_and_mul). Each expert: gate and up in x's
    dtype (fp32 accumulation), act, down in x's dtype; slots combined in fp32 (`experts_forward`).
    The same math as `RoutedExperts.run_expert` with `experts_forward`.
    """
    from kimiserve.ops.quant.reference import dequantize_mxfp4

    def weight(w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
        if w.dtype == torch.uint8:
            return dequantize_mxfp4(w[e], scale[e], x.dtype)
        return w[e].to(x.dtype)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = rows @ weight(w1, w1_scale, e).T, rows @ weight(w3, w3_scale, e).T
        return act(gate, up) @ weight(w2, w2_scale, e).T

    return experts_forward(x, ids, weights, expert, w1.shape[0])
