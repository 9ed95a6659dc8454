"""Triton batch-invariant MLA attention and indexer scores (the GPU forms of
`reference.sparse_latent_attention` and `reference.indexer_scores`).

Both read a query row's context from a flat latent / key buffer (`flat[base[g] + p]` is row g's
context position p: a sequence's context stored once, not once per query row) and tile only over
that row's own positions, in a fixed order:
- attention: one program per (row, block of heads) walks the row's listed positions in blocks of
  `BLOCK_N` in list order, logits by `tl.dot` over fixed `BLOCK_D` chunks of the latent width (bf16
  operands, fp32 accumulate), an online softmax in fp32 and the probabilities (bf16) times the
  latents into an fp32 accumulator; the loop stops at the row's own count, so neither the batch nor
  the width the lists were padded to changes a row's bits;
- indexer: one program per (row, block of context positions) computes sum_h w[h] ReLU(q[h] . key)
  with one `tl.dot` over the whole index width and a fixed-shape sum over the heads.
Other bits than the CPU's tree sums: the engine and the trainer both run these on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H, BLOCK_N, BLOCK_D = 16, 32, 64
"""Attention tiles: heads per program, listed positions per step, latent columns per logit dot."""
BLOCK_S = 64
"""Indexer: context positions per program."""


@triton.jit
def _attention_kernel(q_ptr, lat_ptr, base_ptr, listed_ptr, count_ptr, out_ptr, scale,
                      H, sqg, sqh, slt, slg, sog, soh,
                      L: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
                      BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    g = tl.program_id(0)
    hb = tl.program_id(1)
    hh = hb * BH + tl.arange(0, BH)
    mh = hh < H
    base = tl.load(base_ptr + g).to(tl.int64)
    count = tl.load(count_ptr + g)
    nn = tl.arange(0, BN)
    dd = tl.arange(0, BD)
    ll = tl.arange(0, BL)
    q_row = q_ptr + g.to(tl.int64) * sqg + hh[:, None].to(tl.int64) * sqh
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BL), tl.float32)
    for j0 in range(0, count, BN):
        mn = j0 + nn < count
        pos = tl.load(listed_ptr + g.to(tl.int64) * slg + j0 + nn, mask=mn, other=0).to(tl.int64)
        rows = lat_ptr + (base + pos)[None, :] * slt
        logits = tl.zeros((BH, BN), tl.float32)
        for d0 in tl.static_range(0, D, BD):
            md = d0 + dd < D
            qd = tl.load(q_row + (d0 + dd)[None, :], mask=mh[:, None] & md[None, :], other=0.0)
            kd = tl.load(rows + (d0 + dd)[:, None], mask=md[:, None] & mn[None, :], other=0.0)
            logits = tl.dot(qd.to(tl.bfloat16), kd.to(tl.bfloat16), logits)
        logits = tl.where(mn[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vals = tl.load(lat_ptr + (base + pos)[:, None] * slt + ll[None, :], mask=mn[:, None] & (ll[None, :] < L),
                       other=0.0)
        acc = tl.dot(p.to(tl.bfloat16), vals.to(tl.bfloat16), acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + g.to(tl.int64) * sog + hh[:, None] * soh + ll[None, :], out, mask=mh[:, None] & (ll[None, :] < L))


def sparse_latent_attention(q: torch.Tensor, latents: torch.Tensor, base: torch.Tensor, listed: torch.Tensor,
                            count: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """q [G, H, D] (absorbed query and rope part), latents [T, D] (flat contexts), base [G], listed
    [G, n] positions (the first count[g] of row g used, count[g] >= 1) -> [G, H, latent_dim] fp32."""
    G, H, D = q.shape
    out = torch.empty(G, H, latent_dim, dtype=torch.float32, device=q.device)
    if G == 0:
        return out
    q = q.contiguous() if q.stride(-1) != 1 else q
    latents = latents.contiguous() if latents.stride(-1) != 1 else latents
    listed = listed.contiguous()
    grid = (G, triton.cdiv(H, BLOCK_H))
    _attention_kernel[grid](q, latents, base.to(torch.int64).contiguous(), listed, count.to(torch.int32).contiguous(),
                            out, scale, H, q.stride(0), q.stride(1), latents.stride(0), listed.stride(0),
                            out.stride(0), out.stride(1), L=latent_dim, D=D, BL=triton.next_power_of_2(latent_dim),
                            BH=BLOCK_H, BN=BLOCK_N, BD=BLOCK_D, num_warps=4)
    return out


@triton.jit
def _indexer_kernel(q_ptr, w_ptr, key_ptr, base_ptr, lens_ptr, out_ptr, Hi, S, sqg, sqh, swg, skt, sog,
                    D: tl.constexpr, BHI: tl.constexpr, BDK: tl.constexpr, BS: tl.constexpr):
    g = tl.program_id(0)
    sb = tl.program_id(1)
    ss = sb * BS + tl.arange(0, BS)
    hh = tl.arange(0, BHI)
    dd = tl.arange(0, BDK)
    base = tl.load(base_ptr + g).to(tl.int64)
    n = tl.load(lens_ptr + g)
    ms = ss < n
    q = tl.load(q_ptr + g.to(tl.int64) * sqg + hh[:, None] * sqh + dd[None, :], mask=(hh[:, None] < Hi) & (dd[None, :] < D),
                other=0.0)
    w = tl.load(w_ptr + g.to(tl.int64) * swg + hh, mask=hh < Hi, other=0.0).to(tl.float32)
    keys = tl.load(key_ptr + (base + ss.to(tl.int64))[None, :] * skt + dd[:, None], mask=ms[None, :] & (dd[:, None] < D),
                   other=0.0)
    dots = tl.dot(q.to(tl.bfloat16), keys.to(tl.bfloat16))  # [BHI, BS]
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    tl.store(out_ptr + g.to(tl.int64) * sog + ss, tl.where(ms, score, float("-inf")), mask=ss < S)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, base: torch.Tensor, lens: torch.Tensor,
                   width: int) -> torch.Tensor:
    """q [G, Hi, D], weights [G, Hi], keys [T, D] (flat contexts), base [G], lens [G] -> scores [G, width]
    fp32 of row g's positions s < lens[g] (-inf beyond)."""
    G, Hi, D = q.shape
    out = torch.empty(G, width, dtype=torch.float32, device=q.device)
    if G == 0 or width == 0:
        return out
    q = q.contiguous() if q.stride(-1) != 1 else q
    keys = keys.contiguous() if keys.stride(-1) != 1 else keys
    weights = weights.contiguous()
    grid = (G, triton.cdiv(width, BLOCK_S))
    _indexer_kernel[grid](q, weights, keys, base.to(torch.int64).contiguous(), lens.to(torch.int32).contiguous(), out,
                          Hi, width, q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), out.stride(0),
                          D=D, BHI=max(16, triton.next_power_of_2(Hi)), BDK=max(16, triton.next_power_of_2(D)),
                          BS=BLOCK_S, num_warps=4)
    return out
