"""Lightning-indexer scores (DeepSeek-V3.2 DSA, NoPE): which earlier tokens each query should read."""

import torch

from kimiserve.ops.dtypes import compute_dtype


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """score[b, t, s] = sum_h weights[b, t, h] * ReLU(q[b, t, h] . k[b, s]).

    q: [B, T, Hi, D] index queries; k: [B, S, D] index keys (one per token, shared by heads);
    weights: [B, T, Hi] per-head weights with every scale already folded in. Causality is not
    applied here (see `kimiserve.ops.topk.reference.causal_topk`). Returns fp32 (or wider) [B, T, S].
    """
    dt = compute_dtype(q, k, weights)
    logits = torch.einsum("bthd,bsd->bths", q.to(dt), k.to(dt)).relu_()
    return torch.einsum("bths,bth->bts", logits, weights.to(dt))
