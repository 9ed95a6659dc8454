"""Training forms of the model (autograd on the reference ops): what `scripts/train_demo.py` runs.

A `TrainContext` passed as the model's attention context selects them: KDA runs its chunked form
(as for any full sequence), MLA attends densely or over the indexer's top-k (`sparse`), and the
indexer, which gets no gradient through a hard top-k, is trained DeepSeek-V3.2-style: a KL loss
between the MLA attention distribution (summed over heads, renormalised, detached) and the softmax
of the indexer's scores over the same keys; the indexer reads detached inputs, so that loss moves
the indexer alone. Routed experts run each token through its routed experts in training mode (the
pairs grouped by expert; one host sync for the counts), with optional MXFP4 fake quantisation
(straight-through) of their weights. KDA's intra-chunk scores are tiled matmuls (`chunk_kda_tiled`)
and MLA runs through `F.scaled_dot_product_attention`. The forms before these (`TrainContext.fast`
False, `RoutedExperts.train_every_expert`: per-pair [C, C, K] decays and every expert on every token,
both recomputed in the backward pass) compute the same, with many times the memory traffic; they
stay for A/B timing (`benchmarks/train_step.py`, `scripts/train_demo.py --reference-forms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint

from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4


@dataclass
class TrainContext:
    """Attention context of a training forward (full sequences from scratch, autograd on)."""

    sparse: bool = False
    """MLA attends only to the indexer's top-k keys (as served); False: dense causal attention."""
    kda_chunk_size: int = 64
    """Chunk of KDA's chunked form: its memory grows with it, its sequential steps shrink."""
    fast: bool = True
    """The forms that compute the same with less memory traffic: KDA's intra-chunk scores as tiled
    matmuls (`chunk_kda_tiled`) and MLA through `F.scaled_dot_product_attention` (the probabilities the
    indexer's KL needs recomputed without autograd); False: the forms before (per-pair [C, C, K]
    decays, attention through an autograd softmax), kept for A/B timing."""
    indexer_losses: list[torch.Tensor] = field(default_factory=list)
    """One KL term per MLA layer with an indexer, appended by the forward."""


def fake_quant_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """w rounded through MXFP4 (groups of 32 along the last dim) in the forward, identity gradient."""
    packed, scales = quantize_mxfp4(w.detach())
    return w + (dequantize_mxfp4(packed, scales, w.dtype) - w).detach()


def indexer_kl(probs: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over query tokens of KL(p || softmax(scores)) over the keys in `mask`.

    probs [B, H, T, S] attention probabilities (detached here), scores [B, T, S] indexer scores,
    mask [B, T, S] the keys attended (every row has at least one)."""
    target = probs.detach().sum(1)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)
    terms = torch.where(mask & (target > 0), target * (torch.log(target.clamp_min(1e-20)) - logq), 0.0)
    return terms.sum(-1).mean()


def mla_train_forward(attn, x: torch.Tensor, ctx: TrainContext) -> torch.Tensor:
    """`MLAAttention` training forward: x [B, T, d] -> [B, T, d]; appends the indexer's KL to ctx."""
    from kimiserve.ops.indexer.reference import indexer_scores
    from kimiserve.ops.mla.reference import split_kv_b
    from kimiserve.ops.topk.reference import causal_topk, selection_mask

    B, T, _ = x.shape
    q_nope, q_pe, q_latent = attn.query(x)
    c, k_pe = attn.latent(x)
    positions = torch.arange(T, device=x.device)
    mask = (positions.view(1, T) <= positions.view(T, 1)).expand(B, T, T)
    indexer = getattr(attn, "indexer", None)
    scores = None
    if indexer is not None:
        iq, iw = indexer.queries(x.detach(), q_latent.detach())
        scores = indexer_scores(iq, indexer.keys(x.detach()), iw)
        if ctx.sparse:
            mask = selection_mask(causal_topk(scores.detach(), positions, indexer.topk), T)
    w_kc, w_vc = split_kv_b(attn.kv_b_proj.weight, attn.num_heads, attn.nope)
    k_nope = torch.einsum("bsl,hdl->bshd", c, w_kc)
    v = torch.einsum("bsl,hdl->bshd", c, w_vc)
    if ctx.fast:
        H = attn.num_heads
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, H, -1)], dim=-1).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask.unsqueeze(1) if ctx.sparse else None, is_causal=not ctx.sparse,
            scale=attn.scale).transpose(1, 2).reshape(B, T, -1)
        if scores is not None:  # the KL's target: no autograd, so one matmul and in-place passes
            with torch.no_grad():
                logits = torch.matmul(q, k.transpose(-1, -2)).float().mul_(attn.scale)
                probs = torch.softmax(logits.masked_fill_(~mask.unsqueeze(1), float("-inf")), dim=-1)
    else:
        probs = _attention_probs(attn, q_nope, q_pe, k_nope, k_pe, mask)
        o = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v).reshape(B, T, -1)
    if scores is not None:
        ctx.indexer_losses.append(indexer_kl(probs, scores, mask))
    return attn.output(x, o)


def _attention_probs(attn, q_nope, q_pe, k_nope, k_pe, mask: torch.Tensor) -> torch.Tensor:
    """fp32 MLA attention probabilities [B, H, T, S] over the keys in `mask` [B, T, S]."""
    logits = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    return torch.softmax((logits * attn.scale).float().masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)


def routed_experts_train_forward(experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                 every_expert: bool = False) -> torch.Tensor:
    """`RoutedExperts` training forward (float weights): each token through its routed experts (the pairs
    sorted by expert, one matmul chain per expert: one host sync for the counts), combined with the
    routing weights, so gradients reach the router through `weights`. every_expert: every expert on
    every token with unrouted pairs weighted 0 instead (the same sums and gradients, 1/k of the
    experts' work useful; recomputed in the backward pass). Counts the tokens routed to each expert
    into `experts.routed_load` (for the bias-based load balancing)."""
    if experts.mxfp4:
        raise ValueError("training needs float routed experts: build the model with routed_experts_mxfp4=False")
    w1, w2, w3 = (getattr(experts, n) for n in experts.NAMES)
    if experts.fake_quant:
        w1, w2, w3 = fake_quant_mxfp4(w1), fake_quant_mxfp4(w2), fake_quant_mxfp4(w3)
    E = experts.num_experts
    load = torch.bincount(ids.reshape(-1), minlength=E).detach()
    experts.routed_load = load if experts.routed_load is None else experts.routed_load + load
    if not every_expert:
        return _routed_pairs(experts.act, x, w1, w2, w3, ids, weights, load.tolist())
    dense = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter(1, ids, weights.to(x.dtype))
    # recomputed in the backward pass: the [E, N, I] activations would be a step's largest saved tensors
    return torch.utils.checkpoint.checkpoint(_every_expert, experts.act, x, w1, w2, w3, dense, use_reentrant=False)


def _routed_pairs(act, x, w1, w2, w3, ids, weights, counts: list[int]):
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]), the (token, expert) pairs grouped by expert."""
    k = ids.shape[1]
    order = ids.reshape(-1).argsort(stable=True)
    tokens = order // k
    parts = []  # experts by unbind: its backward stacks once (indexing w[e] writes a whole zero tensor per expert)
    for xe, w1e, w2e, w3e in zip(x[tokens].split(counts), *(w.to(x.dtype).unbind(0) for w in (w1, w2, w3))):
        parts.append(act(xe @ w1e.T, xe @ w3e.T) @ w2e.T)
    y = torch.cat(parts) * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    return x.new_zeros(x.shape[0], w2.shape[1]).index_add(0, tokens, y)


def _every_expert(act, x, w1, w2, w3, dense):
    """sum_e dense[n, e] * expert_e(x[n]) with experts w1/w3 [E, I, h], w2 [E, h, I]."""
    a = act(torch.einsum("nh,eih->eni", x, w1.to(x.dtype)), torch.einsum("nh,eih->eni", x, w3.to(x.dtype)))
    return torch.einsum("eni,ehi,ne->nh", a, w2.to(x.dtype), dense)


def enable_training(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Put `model` in training mode with gradients on every floating parameter except the routers'
    score-correction biases (moved by load balancing, not by gradients); returns the trained ones."""
    model.train()
    trained = []
    for name, p in model.named_parameters():
        p.requires_grad_(p.is_floating_point() and not name.endswith("e_score_correction_bias"))
        if p.requires_grad:
            trained.append(p)
    return trained


def train_logits(model, input_ids: torch.Tensor, ctx: TrainContext, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits of a training forward: [B, T, vocab], or of the flattened positions `rows` only [R, vocab]."""
    h = model.model(input_ids, ctx)
    if rows is not None:
        h = h.reshape(-1, h.shape[-1])[rows]
    return model.logits(h)
