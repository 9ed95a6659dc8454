"""The batch-invariant MLA read of a packed batch: each query row's indexer top-k over its own
context (skipped where no row's context exceeds k: then every visible position is listed, the list
the top-k would give) and the absorbed attention over the listed positions, from flat context buffers
(`latents[base[g] + p]` / `keys[base[g] + p]` is row g's context position p, p < lens[g]).

On the CPU: row groups gathered from the flat buffers and `reference.indexer_topk` /
`reference.sparse_latent_attention` (tree sums). On CUDA: the Triton kernels of
`ops.batch_invariant.triton_attention` (fixed tiles over the row's own positions), the top-k by a
stable sort of the row's scores (ties to the earlier token), the backward through plain torch
attention over the same listed positions (other bits, same math: only the forward is compared).
"""

from __future__ import annotations

import torch

from kimiserve.ops.batch_invariant import reference as bi

CPU_CHUNK_ELEMENTS = 1 << 22
"""CPU row groups keep their [rows, heads, context, width] products about this size."""
BACKWARD_CHUNK_ELEMENTS = 1 << 28
"""CUDA backward row groups keep their gathered [rows, listed, width] latents about this size."""


def _triton():
    try:
        from kimiserve.ops.batch_invariant import triton_attention
    except ImportError:
        return None
    return triton_attention


def _attention_torch(q: torch.Tensor, latents: torch.Tensor, base: torch.Tensor, listed: torch.Tensor,
                     count: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """Plain torch form of the kernel's math (autograd): q [G, H, D] -> [G, H, L] fp32."""
    valid = torch.arange(listed.shape[1], device=q.device) < count.unsqueeze(1)
    rows = max(1, BACKWARD_CHUNK_ELEMENTS // max(1, listed.shape[1] * latents.shape[-1]))
    parts = []
    for lo in range(0, q.shape[0], rows):
        sl = slice(lo, lo + rows)
        picked = latents[(base[sl].unsqueeze(1) + torch.where(valid[sl], listed[sl], 0))].float()  # [g, n, D]
        logits = torch.einsum("ghd,gnd->ghn", q[sl].float(), picked) * scale
        probs = torch.softmax(logits.masked_fill(~valid[sl, None], float("-inf")), -1)
        parts.append(torch.einsum("ghn,gnl->ghl", probs, picked[..., :latent_dim]))
    return torch.cat(parts)


class _LatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, latents, base, listed, count, scale, latent_dim):
        ctx.save_for_backward(q, latents, base, listed, count)
        ctx.scale, ctx.latent_dim = scale, latent_dim
        return _triton().sparse_latent_attention(q, latents, base, listed, count, scale, latent_dim)

    @staticmethod
    def backward(ctx, grad):
        q, latents, base, listed, count = ctx.saved_tensors
        with torch.enable_grad():
            qq, ll = q.detach().requires_grad_(True), latents.detach().requires_grad_(True)
            out = _attention_torch(qq, ll, base, listed, count, ctx.scale, ctx.latent_dim)
            gq, gl = torch.autograd.grad(out, (qq, ll), grad)
        return gq.to(q.dtype), gl.to(latents.dtype), None, None, None, None, None


def _listed_cuda(tri, iq, iw, keys, base, lens, topk: int, S: int):
    if iq is None or S <= topk:  # every visible position is listed whatever the scores
        listed = torch.arange(S, device=lens.device).expand(len(lens), S)
        return listed, lens
    scores = tri.indexer_scores(iq, iw.float(), keys, base, lens, S)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(topk, S)]
    count = torch.clamp(lens, max=topk)
    order = torch.where(torch.arange(order.shape[1], device=lens.device) < count.unsqueeze(1), order, S)
    return torch.sort(order, dim=-1).values, count


def mla_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor | None,
                  base: torch.Tensor, lens: torch.Tensor, iq: torch.Tensor | None, iw: torch.Tensor | None,
                  topk: int, scale: float, width: int | None = None) -> torch.Tensor:
    """q_abs [N, H, L], q_pe [N, H, R], latents [T, L + R], keys [T, Di] (None: no indexer, every
    visible position is attended), base / lens [N], iq [N, Hi, Di], iw [N, Hi] -> [N, H, L] fp32.
    width: a bound on lens known on the host (a decode step's context width; on CUDA no host sync
    then), else lens.max(). A row's bits do not depend on it (a row of at most topk positions lists
    them all, whether its indexer runs or not)."""
    N, H, L = q_abs.shape
    S = width if width is not None else int(lens.max()) if N else 0
    tri = _triton() if bi.on_triton(q_abs) else None
    if tri is not None:
        listed, count = _listed_cuda(tri, iq, iw, keys, base, lens, topk, S)
        q = torch.cat([q_abs.float(), q_pe.float()], dim=-1)
        return _LatentAttention.apply(q, latents, base, listed, count, scale, L)
    width = max(latents.shape[-1] * H, iq.shape[1] * iq.shape[2] if iq is not None else 0)
    group = max(1, CPU_CHUNK_ELEMENTS // max(1, S * width))
    parts = []
    for lo in range(0, N, group):
        rows = slice(lo, min(N, lo + group))
        pos = lens[rows] - 1
        Sg = int(pos.max()) + 1
        ctx = torch.minimum(torch.arange(Sg, device=lens.device).unsqueeze(0), pos.unsqueeze(1))
        idx = base[rows].unsqueeze(1) + ctx
        ctx_latents = latents[idx]
        if iq is not None and Sg > topk:
            listed = bi.indexer_topk(iq[rows], iw[rows], keys[idx], lens[rows], topk)
        else:
            listed = torch.arange(Sg, device=lens.device).expand(len(pos), Sg)
            listed = torch.where(listed < lens[rows].unsqueeze(1), listed, Sg)
        parts.append(bi.sparse_latent_attention(q_abs[rows], q_pe[rows], ctx_latents, listed, scale))
    return torch.cat(parts) if parts else q_abs.new_zeros(0, H, L, dtype=torch.float32)
