"""The MoE router's selection as one Triton kernel (issue 15: the decode step's glue): `route`, the
contract of `reference.route` (noaux_tc): fp32 sigmoid (or softmax) scores of the router logits, the
correction bias added for the choice only, with groups only the experts of the topk_group best groups
(a group scores the sum of its two best biased scores) eligible, the top_k experts by biased score in
decreasing order, their unbiased scores renormalised to sum to one (+1e-20) and scaled.

One program per token holds its E logits as a [groups, experts per group] tile (E up to `MAX_EXPERTS`)
and picks the k experts by k max-reductions; equal scores go to the lower expert id. Only rounding
(the exp, the sum of the k weights) differs from the reference; the reference runs for wider rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.moe import reference

MAX_EXPERTS = 8192
MAX_TOP_K = 64


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, EG, logits_stride, scaling,
                  G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, PAIR: tl.constexpr, RENORM: tl.constexpr,
                  BG: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BG)[:, None]
    j = tl.arange(0, BE)[None, :]
    valid = (g < G) & (j < EG)
    e = g * EG + j
    logit = tl.load(logits_ptr + row * logits_stride + e, mask=valid, other=float("-inf"))
    if SOFTMAX:
        ex = tl.where(valid, tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0)), 0.0)
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
    else:
        scores = tl.sigmoid(logit)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        m1 = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == m1[:, None], j, BE), axis=1)
        group_score = m1
        if PAIR:  # the two best of each group
            group_score += tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
        gi = tl.arange(0, BG)
        group_score = tl.where(gi < G, group_score, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            avail = (gi < G) & ~keep
            best = tl.max(tl.where(avail, group_score, float("-inf")), axis=0)
            pick = tl.min(tl.where(avail & (group_score == best), gi, BG), axis=0)
            keep = keep | (gi == pick)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    taken = e < 0
    slots = tl.arange(0, BK)
    ids = tl.zeros([BK], dtype=tl.int64)
    weights = tl.zeros([BK], dtype=tl.float32)
    big = G * EG
    for t in tl.static_range(TOP_K):
        avail = valid & ~taken
        best = tl.max(tl.max(tl.where(avail, choice, float("-inf")), axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(avail & (choice == best), e, big), axis=1), axis=0)
        idx = tl.minimum(idx, big - 1)  # a NaN score matches nothing: still a valid expert id
        sel = e == idx
        taken = taken | sel
        ids = tl.where(slots == t, idx.to(tl.int64), ids)
        weights = tl.where(slots == t, tl.sum(tl.sum(tl.where(sel, scores, 0.0), axis=1), axis=0), weights)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = slots < TOP_K
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=out)
    tl.store(w_ptr + row * TOP_K + slots, weights * scaling, mask=out)


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, *,
          score_func: str = "sigmoid", num_expert_group: int = 1, topk_group: int = 1, renormalize: bool = True,
          scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route` in one kernel: fp32 logits [N, E] -> (ids int64 [N, k], weights fp32 [N, k])."""
    if score_func not in ("sigmoid", "softmax"):
        raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")
    N, E = router_logits.shape
    grouped = num_expert_group > 1 and topk_group < num_expert_group
    G = num_expert_group if grouped else 1
    if (E > MAX_EXPERTS or top_k > min(E, MAX_TOP_K) or E % G or N == 0
            or (correction_bias is not None and correction_bias.shape != (E,))):
        return reference.route(router_logits, correction_bias, top_k, score_func=score_func,
                               num_expert_group=num_expert_group, topk_group=topk_group, renormalize=renormalize,
                               scaling_factor=scaling_factor)
    logits = router_logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    EG = E // G
    BG, BE = triton.next_power_of_2(G), triton.next_power_of_2(EG)
    _route_kernel[(N,)](logits, bias, ids, weights, E, EG, logits.stride(0), float(scaling_factor), G=G,
                        TOPK_GROUP=topk_group, TOP_K=top_k, SOFTMAX=score_func == "softmax",
                        HAS_BIAS=correction_bias is not None, GROUPED=grouped, PAIR=EG >= 2, RENORM=renormalize and top_k > 1,
                        BG=BG, BE=BE, BK=triton.next_power_of_2(top_k), num_warps=max(1, min(8, BG * BE // 256)))
    return ids, weights
