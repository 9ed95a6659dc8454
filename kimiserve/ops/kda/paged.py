"""The KDA delta-rule ops the serving path calls (`DecodeOps.kda_prefill` / `kda_decode`), in pure
torch: the references the fla versions (`kimiserve.ops.kda.fla`) are checked against.

q, k [B, T, H, K] L2-normalised by the caller; v [B, T, H, V]; g log decay [B, T, H, K] (<= 0);
beta [B, T, H]; states fp32 [H, K, V] per sequence; scale K^-0.5 (see `reference`).
"""

from __future__ import annotations

import torch

from kimiserve.ops.kda.reference import chunk_kda, recurrent_kda


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
