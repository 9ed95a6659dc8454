"""Kimi Delta Attention (KDA): gate, recurrent form and chunked form, in pure torch.

Shapes follow fla: q, k [B, T, H, K]; v [B, T, H, V]; g (log decay, <= 0) [B, T, H, K];
beta [B, T, H]; state [B, H, K, V]. Per step and head:

    S <- Diag(exp g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

q and k are expected L2-normalised by the caller. The state is kept in fp32 (fp64 inputs stay
fp64); outputs come back in v's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimiserve.ops.dtypes import compute_dtype
from kimiserve.ops.pointwise import vector_sigmoid, vector_softplus


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log decay from the gate projection f [..., H, K].

    K3 (lower_bound set): g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)), in (lower_bound, 0).
    Kimi-Linear (None):   g = -exp(A_log[h]) * softplus(f + dt_bias).
    A_log: [H]; dt_bias: [H * K]. Returned in the compute dtype (fp32 or wider).
    """
    dt = compute_dtype(f)
    H, K = f.shape[-2], f.shape[-1]
    a = torch.exp(A_log.to(dt)).view(H, 1)
    x = f.to(dt) + dt_bias.to(dt).view(H, K)
    if lower_bound is not None:
        return lower_bound * vector_sigmoid(a * x)
    return -a * vector_softplus(x)


def _prepare(q, k, v, g, beta, initial_state, scale):
    """Check shapes; return (compute dtype, output dtype, scale)."""
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H] with B, T, H = {B, T, H}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be {(B, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}")
    return compute_dtype(q, k, v, g, beta, initial_state), v.dtype, K ** -0.5 if scale is None else scale


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V])."""
    dt, out_dtype, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt).clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)
        k_t = k[:, t]
        residual = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + (beta[:, t, :, None, None] * k_t.unsqueeze(-1)) * residual.unsqueeze(-2)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale)
    return o.to(out_dtype), S


def _split_chunks(q, k, v, g, beta, dt: torch.dtype, C: int):
    """[B, T, ...] inputs in `dt`, zero-padded to whole chunks of C steps (a padded step has k = 0 and
    g = 0: it leaves the state untouched) and laid out per chunk: q, k, g [B, H, N, C, K], v
    [B, H, N, C, V], beta [B, H, N, C]; with the chunk's causal and strictly-causal masks [C, C] and eye."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = (-T) % C
    q, k, v, g = (F.pad(t.to(dt), (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta.to(dt), (0, 0, 0, pad))
    N = (T + pad) // C
    q, k, g = (t.view(B, N, C, H, K).permute(0, 3, 1, 2, 4) for t in (q, k, g))
    v = v.view(B, N, C, H, V).permute(0, 3, 1, 2, 4)
    beta = beta.view(B, N, C, H).permute(0, 3, 1, 2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    eye = torch.eye(C, dtype=dt, device=q.device)
    return q, k, v, g, beta, causal, strict, eye


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel KDA (WY form), equal to `recurrent_kda` up to rounding.

    Inside a chunk with cumulative log decay G_i (per channel) and entry state S0, the per-step
    deltas D_i = beta_i (v_i - S'_i^T k_i) solve (I + A) D = diag(beta) (V - (exp(G) * K) S0), with
    A_ij = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) for j < i. Then
    o_i = scale (exp(G_i) * q_i)^T S0 + scale sum_{j<=i} (q_i . (exp(G_i - G_j) * k_j)) D_j and
    S_C = exp(G_C) * S0 + sum_j (exp(G_C - G_j) * k_j) D_j^T. Decays enter only as exp of
    differences G_i - G_j <= 0, so nothing overflows however strong the decay.
    """
    dt, out_dtype, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    q, k, v, g, beta, causal, strict, eye = _split_chunks(q, k, v, g, beta, dt, C)
    N = q.shape[2]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt).clone()
    o = torch.empty_like(v)
    for n in range(N):
        q_c, k_c, v_c, b_c = q[:, :, n] * scale, k[:, :, n], v[:, :, n], beta[:, :, n]
        G = g[:, :, n].cumsum(dim=-2)  # [B, H, C, K]
        diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf"))
        decay = torch.exp(diff)  # [B, H, C(i), C(j), K], exp(G_i - G_j) for j <= i, else 0
        A = torch.einsum("bhik,bhijk,bhjk->bhij", k_c, decay, k_c) * b_c.unsqueeze(-1)
        A = A.masked_fill(~strict, 0.0)
        rhs = torch.cat([b_c.unsqueeze(-1) * v_c, b_c.unsqueeze(-1) * (torch.exp(G) * k_c)], dim=-1)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        U, W = UW[..., :V], UW[..., V:]
        D = U - W @ S  # [B, H, C, V]
        Aqk = torch.einsum("bhik,bhijk,bhjk->bhij", q_c, decay, k_c)
        o[:, :, n] = (torch.exp(G) * q_c) @ S + Aqk @ D
        G_last = G[:, :, -1:]  # [B, H, 1, K]
        S = torch.exp(G_last).transpose(-1, -2) * S + (torch.exp(G_last - G) * k_c).transpose(-1, -2) @ D
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S


def _wy_terms(q, k, v, G, beta, A, eye):
    """The state-independent terms of every chunk at once, from the scaled q, k, v [B, H, N, C, .], the
    cumulative log decays G, beta [B, H, N, C, 1] and the strictly lower k-k scores A [B, H, N, C, C]:
    (U, W) solving (I + A) [U W] = [beta v, beta exp(G) k], the entry-state reader exp(G) q, the exit-state
    writer (exp(G_C - G) k)^T [B, H, N, K, C] and the entry state's keep factor exp(G_C)^T [B, H, N, K, 1]."""
    V = v.shape[-1]
    rhs = torch.cat([beta * v, beta * (torch.exp(G) * k)], dim=-1)
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    G_last = G[..., -1:, :]  # [B, H, N, 1, K]
    k_out = (torch.exp(G_last - G) * k).transpose(-1, -2)
    return UW[..., :V], UW[..., V:], torch.exp(G) * q, k_out, torch.exp(G_last).transpose(-1, -2)


def chunk_kda_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_kda` with everything that does not depend on the state computed for all chunks at once
    (decays, the triangular solve, the intra-chunk scores); only the state recurrence loops over the
    chunks, a few matmuls each. Same result up to rounding; a few times fewer (larger) kernels, which
    is what a launch-bound training step on a GPU wants. Memory: all chunks' [C, C, K] decays at once."""
    dt, out_dtype, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    q, k, v, g, beta, causal, strict, eye = _split_chunks(q, k, v, g, beta, dt, C)
    N = q.shape[2]
    beta = beta.unsqueeze(-1)  # [B, H, N, C, 1]
    q = q * scale
    G = g.cumsum(dim=-2)
    decay = torch.exp((G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf")))
    A = (torch.einsum("bhnik,bhnijk,bhnjk->bhnij", k, decay, k) * beta).masked_fill(~strict, 0.0)
    U, W, q_in, k_out, keep = _wy_terms(q, k, v, G, beta, A, eye)
    Aqk = torch.einsum("bhnik,bhnijk,bhnjk->bhnij", q, decay, k)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for n in range(N):
        D = U[:, :, n] - W[:, :, n] @ S
        outs.append(q_in[:, :, n] @ S + Aqk[:, :, n] @ D)
        S = keep[:, :, n] * S + k_out[:, :, n] @ D
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S


def _tile_size(C: int, gate_bound: float | None, max_exponent: float = 40.0) -> int:
    """The largest power-of-two tile (dividing C) over which (tile - 1) steps of decay at most `gate_bound`
    each stay within exp(max_exponent) (1: no bound)."""
    s = 1
    while gate_bound is not None and C % (2 * s) == 0 and (2 * s - 1) * gate_bound <= max_exponent:
        s *= 2
    return s


def _decayed_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_c a_ic k_jc exp(G_ic - G_jc) for every pair of steps i, j of a chunk, for a = k and a = q (only
    j <= i is meaningful; the rest is finite garbage for the caller to mask), as matmuls: q, k, G
    [..., C, K] -> (the k-k scores, the q-k scores) [..., C, C].

    The chunk's columns are cut into tiles of s steps; with e the last step of column tile b,
    exp(G_i - G_j) = exp(G_i - G_e) exp(G_e - G_j): the column factor is in [exp(-(s-1) bound), 1], the
    row factor <= 1 for rows after the tile and <= exp((s-1) bound) inside it (`_tile_size` keeps
    that small); rows before the tile (all j > i) are zeroed before the exp, so nothing overflows."""
    C, K = G.shape[-2:]
    nt = C // s
    G_end = G[..., s - 1 :: s, :]  # [..., nt, K]
    rows = torch.arange(C, device=G.device)
    before = rows.view(1, C) < (torch.arange(nt, device=G.device) * s).view(nt, 1)  # [nt, C]: rows before tile b
    row = torch.exp((G.unsqueeze(-3) - G_end.unsqueeze(-2)).masked_fill(before[..., None], float("-inf")))
    tiles = lambda t: t.reshape(*t.shape[:-2], nt, s, K)  # noqa: E731
    col = (torch.exp(G_end.unsqueeze(-2) - tiles(G)) * tiles(k)).transpose(-1, -2)  # [..., nt, K, s]
    both = row.unsqueeze(-4) * torch.stack([k, q], dim=-3).unsqueeze(-3)  # [..., 2, nt, C, K]
    scores = (both @ col.unsqueeze(-4)).movedim(-3, -2).reshape(*G.shape[:-2], 2, C, C)
    return scores[..., 0, :, :], scores[..., 1, :, :]


def chunk_kda_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    gate_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_kda_batched` (the training form) with the intra-chunk scores A and Aqk as matmuls over tiles
    of steps (`_decayed_scores`) instead of per-pair [C, C, K] decays: a step's intermediates shrink from
    C*K to (C/s)*K values a head, the bulk of a training step's memory traffic otherwise. Equal to it up
    to rounding. gate_bound: the largest |g| of a step (-lower_bound of the K3 gate), which sets the tile
    s; None (an unbounded gate): s = 1, the per-pair decays' cost again."""
    dt, out_dtype, scale = _prepare(q, k, v, g, beta, initial_state, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    q, k, v, g, beta, causal, strict, eye = _split_chunks(q, k, v, g, beta, dt, C)
    N = q.shape[2]
    s = _tile_size(C, gate_bound)
    beta = beta.unsqueeze(-1)  # [B, H, N, C, 1]
    q = q * scale
    G = g.cumsum(dim=-2)
    A, Aqk = _decayed_scores(q, k, G, s)
    A = (A * beta).masked_fill(~strict, 0.0)
    Aqk = Aqk.masked_fill(~causal, 0.0)
    U, W, q_in, k_out, keep = _wy_terms(q, k, v, G, beta, A, eye)
    # the state recurrence on [B * H] batches, each product-and-add one baddbmm (fewer kernels a chunk);
    # per-chunk views by unbind: its backward stacks once (indexing [:, :, n] would write a whole zero
    # tensor per chunk in the backward, traffic growing with the square of the chunk count)
    flat = lambda t: t.reshape(B * H, *t.shape[2:])  # noqa: E731
    S = flat(q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt))
    outs = []
    for U_n, W_n, q_n, Aqk_n, keep_n, k_n in zip(*(flat(t).unbind(1) for t in (U, W, q_in, Aqk, keep, k_out))):
        D = torch.baddbmm(U_n, W_n, S, alpha=-1)
        outs.append(torch.baddbmm(torch.bmm(q_n, S), Aqk_n, D))
        S = torch.baddbmm(keep_n * S, k_n, D)
    o = torch.stack(outs, dim=1).view(B, H, N, C, V).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S.view(B, H, K, V)
