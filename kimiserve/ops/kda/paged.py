"""The KDA delta-rule ops the serving path calls (`DecodeOps.kda_prefill` / `kda_decode`), in pure
torch: the references the fla versions (`kimiserve.ops.kda.fla`) are checked against.

q, k [B, T, H, K] L2-normalised by the caller; v [B, T, H, V]; g log decay [B, T, H, K] (<= 0);
beta [B, T, H]; states fp32 [H, K, V] per sequence; scale K^-0.5 (see `reference`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kimiserve.ops.conv.reference import causal_conv1d
from kimiserve.ops.kda.reference import chunk_kda, kda_gate, recurrent_kda
from kimiserve.ops.norm.reference import gated_rms_norm, l2_normalize
from kimiserve.ops.pointwise import vector_sigmoid


def kda_prefill(q, k, v, g, beta, initial_state, cu_seqlens=None):
    """Chunked form from initial_state [N, H, K, V] fp32: over [N, T] tokens, or (cu_seqlens int64
    [N + 1] on the CPU) over the N sequences packed in [1, total] (sequence j is tokens cu_seqlens[j] to
    cu_seqlens[j + 1]). Returns (o in v's dtype, shaped as v; final states [N, H, K, V])."""
    if cu_seqlens is None:
        return chunk_kda(q, k, v, g, beta, initial_state=initial_state)
    return each_packed_sequence(kda_prefill, q, k, v, g, beta, initial_state, cu_seqlens)


def each_packed_sequence(prefill, q, k, v, g, beta, initial_state, cu_seqlens):
    """`prefill` (the unpacked form of a kda_prefill) run on each of the sequences packed in [1, total]
    along cu_seqlens (int64 [N + 1] on the CPU); outputs concatenated back, final states stacked."""
    bounds = cu_seqlens.tolist()
    runs = [prefill(*(t[:, bounds[j] : bounds[j + 1]] for t in (q, k, v, g, beta)), initial_state[j : j + 1])
            for j in range(len(bounds) - 1)]
    return torch.cat([o for o, _ in runs], dim=1), torch.cat([state for _, state in runs])


def kda_decode(q, k, v, g, beta, states: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Recurrent form for one token per sequence (q [Bd, 1, H, K], ...) continuing from the states
    of pages page_ids [Bd] (distinct) of the pool's state view states [P, H, K, V]; writes the new
    states back to those pages (gather, run, scatter) and returns o [Bd, 1, H, V]."""
    o, state = recurrent_kda(q, k, v, g, beta, initial_state=states[page_ids])
    states[page_ids] = state
    return o


class KDADecodeWeights(NamedTuple):
    """What one KDA layer's decode step needs besides the token's projections (this rank's heads)."""

    q_conv: torch.Tensor
    """[H * K, W] fp32 depthwise conv weights, and k_conv, v_conv likewise"""
    k_conv: torch.Tensor
    v_conv: torch.Tensor
    A_log: torch.Tensor
    """[H] fp32"""
    dt_bias: torch.Tensor
    """[H * K] fp32"""
    lower_bound: float | None
    norm_weight: torch.Tensor
    """[V] fp32, the gated RMSNorm's weight"""
    eps: float


def short_conv(q, k, v, weights: KDADecodeWeights, num_heads: int, conv_state=None):
    """KDA's short conv over [B, T] tokens from conv_state [B, 3, H * K, W-1] (zeros when None).
    Returns (q, k [B, T, H, K] L2-normalised, v [B, T, H, V], new conv state)."""
    B, T, _ = q.shape
    heads = lambda t: t.view(B, T, num_heads, -1)  # noqa: E731
    cs = (None, None, None) if conv_state is None else conv_state.unbind(1)
    q, cq = causal_conv1d(q, weights.q_conv, cs[0])
    k, ck = causal_conv1d(k, weights.k_conv, cs[1])
    v, cv = causal_conv1d(v, weights.v_conv, cs[2])
    return l2_normalize(heads(q)), l2_normalize(heads(k)), heads(v), torch.stack([cq, ck, cv], dim=1)


def kda_decode_step(q, k, v, f, b, gate, weights: KDADecodeWeights, conv, states, page_ids,
                    kda_decode=kda_decode):
    """One KDA layer's decode step for one token per sequence, after the projections: q, k, v, f (the
    gate projection), gate (the output gate) [Bd, H * K] and b [Bd, H] (beta's logits) in the model
    dtype; conv [P, 3, H * K, W - 1] and states [P, H, K, V] fp32 the pool's views, page_ids [Bd]
    distinct. Short conv from and to the conv pages, the gate, beta, the delta rule on the state pages
    (`kda_decode`), the gated RMSNorm. Returns o [Bd, H, V] in the model dtype (the o_proj input)."""
    Bd, H = b.shape
    one = lambda t: t.unsqueeze(1)  # noqa: E731  [Bd, 1, ...]: a batch of one-token sequences
    qh, kh, vh, new_conv = short_conv(one(q), one(k), one(v), weights, H, conv[page_ids])
    conv[page_ids] = new_conv
    g = kda_gate(one(f).view(Bd, 1, H, -1), weights.A_log, weights.dt_bias, weights.lower_bound)
    beta = vector_sigmoid(one(b).float())
    o = kda_decode(qh, kh, vh, g, beta, states, page_ids)[:, 0]
    return gated_rms_norm(o, gate.view(Bd, H, -1), weights.norm_weight, weights.eps)


def kda_verify_steps(q, k, v, f, b, gate, weights: KDADecodeWeights, conv, states, page_ids, grid, lengths, active,
                     out, conv_slots, state_slots, decode_step=kda_decode_step):
    """A KDA layer's verify positions (speculative decoding) with a state slot per position: T positions of B
    chunks, position t of chunk j the packed row grid[j, t] (grid [B, T] int64) of q, k, v, f, gate [N, H * K]
    and b [N, H] (the step's rows); active[t] the chunks that have a position t (an index tensor, None for
    all), lengths [B] int64 the same as counts (None: every chunk has T). Chunk j starts from its pages
    page_ids[j] of conv [P, 3, H * K, W - 1] and states [P, H, K, V], which are only read. Position t runs
    through `decode_step` (a `kda_decode_step`; the arithmetic of a decode step at the batch of position t's
    chunks) on slot t, which holds the states after position t: conv_slots [T, B, 3, H * K, W - 1] and
    state_slots [T, B, H, K, V] (a chunk's slots past its last position hold its last state here; other
    forms may leave them unwritten). Writes o [H, V] of every active position to out[grid[j, t]] (out
    [N, H, V]; other rows are not written) and returns out. The reference form (a loop of the decode step)."""
    del lengths  # the host's `active` says the same
    B, T = grid.shape
    ids = torch.arange(B, dtype=torch.int64, device=grid.device)
    rows = grid.t().contiguous()  # contiguous gathers: the CPU ops' bits depend on the layout (e.g. sigmoid)
    xs = tuple(x[rows] for x in (q, k, v, f, b, gate))  # [T, B, ...]
    conv_slots[0], state_slots[0] = conv[page_ids], states[page_ids]
    every = []  # outputs of the leading positions every chunk has, written at once
    for t in range(T):
        if t:
            conv_slots[t], state_slots[t] = conv_slots[t - 1], state_slots[t - 1]
        sel = active[t] if active is not None else None
        if sel is None:
            every.append(decode_step(*(x[t] for x in xs), weights, conv_slots[t], state_slots[t], ids))
        else:
            out[rows[t, sel]] = decode_step(*(x[t][sel] for x in xs), weights, conv_slots[t], state_slots[t], ids[sel])
    if every:
        out[rows[: len(every)]] = torch.stack(every)
    return out
