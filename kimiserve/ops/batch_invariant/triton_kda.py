"""Triton batch-invariant KDA recurrence (the GPU form of `reference.kda_recurrence`).

One program per (segment, head, block of V columns) holds its [K, BV] fp32 state tile and runs the
segment's tokens in order, each token the delta-rule step of `reference.kda_step` (decay, residual
against the state, rank-1 update, output read) with fixed-shape reductions over K. Every token's
arithmetic is the same instructions on its own segment's values whatever the other segments, the
segment's length (a prefill chunk of any size, one decode token, a whole training sequence) or the
program's place in the grid; the state between chunks is the fp32 state itself. So prefill, decode,
chunked prefill and the trainer give a token the same bits (the recurrent form: the chunked form's
intra-chunk solve would tie a token's bits to its chunk's composition). Other bits than the CPU's
tree sums: the engine and the trainer both run it on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32
"""V columns per program (fixed: the reduction over K does not depend on it, the tile shape does)."""


@triton.jit
def _recurrence_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, final_ptr, snap_ptr,
                       starts_ptr, lengths_ptr, snap_t_ptr, scale, H, pages_ptr, sp, spage,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PAGED: tl.constexpr):
    """PAGED (decode: segment b is row b, one token, no snapshot): its state is page pages_ptr[b * sp] of
    state_ptr ([pages, H, K, V], page stride spage), and its final state goes back there (final_ptr is
    state_ptr)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    if PAGED:
        start = b.to(tl.int64)
        length = 1
        snap_t = -1
    else:
        start = tl.load(starts_ptr + b).to(tl.int64)
        length = tl.load(lengths_ptr + b)
        snap_t = tl.load(snap_t_ptr + b)
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    if PAGED:
        tile = tl.load(pages_ptr + b * sp).to(tl.int64) * spage + h * K * V + kk[:, None] * V + vv[None, :]
    else:
        tile = (b.to(tl.int64) * H + h) * K * V + kk[:, None] * V + vv[None, :]
    m_tile = mk[:, None] & mv[None, :]
    S = tl.load(state_ptr + tile, mask=m_tile, other=0.0)
    for t in range(0, length):
        if not PAGED:
            if t == snap_t:
                tl.store(snap_ptr + tile, S, mask=m_tile)
        row = (start + t) * H + h
        q = tl.load(q_ptr + row * K + kk, mask=mk, other=0.0)
        k = tl.load(k_ptr + row * K + kk, mask=mk, other=0.0)
        g = tl.load(g_ptr + row * K + kk, mask=mk, other=0.0)
        v = tl.load(v_ptr + row * V + vv, mask=mv, other=0.0)
        beta = tl.load(beta_ptr + row)
        S = S * tl.exp(g)[:, None]
        residual = v - tl.sum(S * k[:, None], axis=0)
        S = S + (beta * k)[:, None] * residual[None, :]
        o = tl.sum(S * (q * scale)[:, None], axis=0)
        tl.store(o_ptr + row * V + vv, o, mask=mv)
    if PAGED:
        tl.debug_barrier()  # every read of the page's tile done before it is overwritten
    tl.store(final_ptr + tile, S, mask=m_tile)


def recurrence(q, k, v, g, beta, state, starts, lengths, snap_t, scale: float, decode: bool = False):
    """q, k, g [N, H, K], v [N, H, V], beta [N, H] (fp32, rows of segment b at starts[b] ..
    starts[b] + lengths[b] - 1), state [B, H, K, V] fp32, snap_t [B] int (-1: none) ->
    (o [N, H, V], final states [B, H, K, V], the states before token snap_t [B, H, K, V]).
    decode: the caller's promise that every row is a one-token segment of its own and no snapshot is
    taken, so o is written whole and the snapshots are not read: both left unfilled (two kernels less)."""
    N, H, K = q.shape
    V = v.shape[-1]
    B = state.shape[0]
    q, k, g, v, beta = (t.float().contiguous() for t in (q, k, g, v, beta))
    state = state.float().contiguous()
    alloc = torch.empty if decode else torch.zeros
    o = alloc(N, H, V, dtype=torch.float32, device=q.device)
    final = torch.empty_like(state)
    snaps = torch.empty_like(state) if decode else torch.zeros_like(state)
    if B:
        grid = (B, H, triton.cdiv(V, BLOCK_V))
        _recurrence_kernel[grid](q, k, v, g, beta, o, state, final, snaps,
                                 starts.to(torch.int64).contiguous(), lengths.to(torch.int32).contiguous(),
                                 snap_t.to(torch.int32).contiguous(), scale, H, starts, 0, 0,
                                 K=K, V=V, BK=triton.next_power_of_2(K), BV=BLOCK_V, PAGED=False, num_warps=4)
    return o, final, snaps


def recurrence_paged(q, k, v, g, beta, state_pages: torch.Tensor, pages: torch.Tensor, scale: float) -> torch.Tensor:
    """`recurrence` of decode rows (row n a one-token segment of its own, no snapshot) from and back to the
    state pages: q, k, g [N, H, K], v [N, H, V], beta [N, H], state_pages [pages, H, K, V] fp32 (the pool's,
    any page stride), pages [N] (any stride) -> o [N, H, V]; the rows' pages then hold their final states
    (the bits of `recurrence`: the same steps; rows must have pages of their own)."""
    N, H, K = q.shape
    V = v.shape[-1]
    if state_pages.dtype != torch.float32 or state_pages.shape[1:] != (H, K, V) or pages.shape != (N,):
        raise ValueError(f"recurrence_paged: state_pages {tuple(state_pages.shape)} {state_pages.dtype}, pages "
                         f"{tuple(pages.shape)} for q {tuple(q.shape)}, v {tuple(v.shape)}")
    if state_pages[0].stride() != (K * V, V, 1):
        raise ValueError("recurrence_paged: each state page must be contiguous [H, K, V]")
    q, k, g, v, beta = (t.float().contiguous() for t in (q, k, g, v, beta))
    o = torch.empty(N, H, V, dtype=torch.float32, device=q.device)
    if N:
        _recurrence_kernel[(N, H, triton.cdiv(V, BLOCK_V))](
            q, k, v, g, beta, o, state_pages, state_pages, state_pages, pages, pages, pages, scale, H, pages,
            pages.stride(0), state_pages.stride(0), K=K, V=V, BK=triton.next_power_of_2(K), BV=BLOCK_V, PAGED=True,
            num_warps=4)
    return o
