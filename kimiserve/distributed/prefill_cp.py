"""Token-sharded prefill (prefill context parallel, PCP): the math, as functions a layer calls.

A prompt's tokens [b_0, b_P) are split into P contiguous chunks, rank r of the PCP group taking
[b_r, b_{r+1}) (`PrefillShard`); b_0 > 0 when a cached prefix precedes them (a prefix-cache hit:
its KDA state and conv state restored, its latents and index keys in the pool). Every rank holds the
same weights (each its TP shard: nothing here depends on how heads are split). Per layer:

KDA (`kda_mix_cp`, in place of `KimiDeltaAttention.mix`)
    1. short conv: a rank's first W-1 tokens need the W-1 pre-conv q/k/v inputs before b_r, which
       may span several earlier chunks when chunks are shorter than W-1: `conv_halo` all-gathers each
       rank's last W-1 pre-conv inputs (3 * H * K * (W-1) values per rank) and each rank composes the
       window it starts from, in rank order, from the sequence's conv state; every rank also gets the
       conv state the whole prompt leaves (for decode).
    2. delta rule. Per head the step of `kimiserve.ops.kda.reference.recurrent_kda` is
           S <- Diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T          (S is K x V)
       i.e. S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T: the per-channel
       decay scales the K rows of the state before the delta update reads it, the update is a rank-1
       K x V term, o_t = S_t^T (K^-1/2 q_t) reads the state after the update. (Checked numerically in
       fp64 against `recurrent_kda` and `chunk_kda`: `tests/test_prefill_cp.py`.) The map S_{t-1} ->
       S_t is affine and acts on each of the V columns of S independently, so a chunk maps its start
       state S0 to A S0 + E, A = prod_t (I - beta_t k_t k_t^T) Diag(exp g_t) [K, K] (last step on the
       left), E the chunk's end state from zero [K, V]. `kda_chunk_summary` gets both from ONE call of
       the chunked kernel with V + K value columns [v | 0] from the state [0 | I] (the columns evolve
       independently: the last K columns run the recurrence from the identity with v = 0, which is A).
       `kda_start_state` all-gathers (A, E) of every rank (K (K + V) fp32 per head per rank) and folds
       in rank order: S_start[0] = the sequence's initial state, S_start[r+1] = A_r S_start[r] + E_r
       (fp32, or fp64 for fp64 inputs); every rank computes the same fold, so every rank also has the
       prompt's final state S_start[P] (bitwise the same on every rank: same inputs, same ops).
       `kda_prefill_cp` then either recomputes the chunk from its true start state ("recompute": the
       single-device kernel's own rounding profile; 2 kernel passes) or corrects the zero-start
       outputs of the summary pass ("correct": o_t = o0_t + S_start^T r_t, where r_t = P_t^T (K^-1/2
       q_t) is what the identity columns output, P_t the transition from the chunk start through t;
       1 kernel pass + a [T, K] x [K, V] product per head). Both equal the single-device chunked
       prefill within fp32 rounding when the kernel keeps fp32 outputs; a bf16 kernel (fla) rounds
       o0 and r to bf16 before the correction, which adds ~2 bf16 roundings to each output:
       "recompute" is the default, "correct" the faster choice once its bf16 error is accepted.

MLA + indexer (`mla_prefill_cp`, in place of the masked full-sequence attention)
    Each rank computes its chunk's latents (576 values per token at full size) and index keys (128);
    one all-gather (padded to the longest chunk) gives every rank every prompt token's latent and
    key, in position order; queries of rank r score keys [0, position] with the indexer, select with
    `causal_topk` (the single-device comparator and tie rule: equal scores give identical sets) and
    attend with `mla_absorbed`, in query blocks that bound the [rows, context] score buffers. Rank r
    needs only the chunks before it, but the all-gather costs the busiest (last) rank no more than
    a causal ring (both bring it T - T_{P-1} tokens), takes one round instead of P - 1, and leaves
    every rank every token, which is what the page pools need without DCP (`store_plan`).

Pages (`store_plan`, `redistribute_tokens`)
    Without DCP every rank writes every prompt token (its own and the gathered ones) to its pool.
    With DCP over D ranks and interleave I, token p lives on DCP rank (p // I) % D at local slot
    (p // (I D)) I + p % I. In `ParallelContext`'s layout every rank of a PCP group has the same
    dcp_rank (PCP groups are the ranks with one tp_rank), so after the all-gather each rank selects
    its tokens locally (no collective). When the ranks that keep the pages are not the ranks that
    computed them (decode on other ranks, a layout whose groups differ, or a path without the
    all-gather), `redistribute_tokens` moves exactly the rows each holder needs in one
    `all_to_all_single` over any group that contains both (all MLA layers' rows at once).

Traffic per rank per layer (all-gather of P chunks padded to the longest, T_max tokens; P - 1 of them
arrive from other ranks): MLA (P - 1) T_max (L + R + D) * bytes (bf16 full size: 1408 B per token);
KDA (P - 1) H_tp K (K + V) * 4 B (+ the conv halo (P - 1) 3 H_tp K (W - 1) * bytes). `CommStats`
counts what each collective ships; the tests check the counts against these formulas.

Costs of the KDA state passing. Work: "recompute" runs the chunked kernel twice over the chunk (the
summary pass with V + K value columns, then the real pass), "correct" once plus a [T, K] x [K, V]
product per head; both add a [K, K] x [K, V] product per earlier rank to the fold. Measured on the
CPU reference `chunk_kda` (fp32, 1 thread, T = 512, min of 7, a shared 2-core machine: +-20%): the
fused summary pass costs 1.1-1.3x one plain pass (H 4 x K = V 64: 1.08x; H 2 x 128: 1.29x), so
"recompute" is ~2.1-2.3x one pass and "correct" ~1.1-1.3x (the correction < 1.5% of a pass). On the
GPU the fla kernels' inter-chunk state pass and output kernel scale with V while the intra-chunk WY
step does not, so the fused pass should cost between 1x and 2x a pass (not measured here). fla-core's
KCP instead runs dedicated pre-process kernels that reuse the WY intermediates (w, u) of the intra-chunk
step and skip the outputs: its overhead is one more inter-chunk state pass; reaching that here needs
those kernels, not a change of the math. Traffic: one all-gather of H K (K + V) fp32 per rank per
layer (full size, TP 1: 96 x 128 x 256 x 4 B = 12.6 MB per rank, received (P - 1) times).

Wiring (per step, per PCP-sharded prompt): the scheduler sends every rank of the PCP group the same
prompt and `PrefillShard.from_context(ctx, b_0, b_P)` picks the rank's tokens (b_0 = cached tokens);
every rank runs every layer on its chunk (embeddings, MoE, norms are per token: unchanged). Per KDA
layer: `kda_mix_cp(layer, q, k, v, g, beta, shard, conv_state, state)` in place of `layer.mix`, with
the sequence's state page at b_0 (restored snapshot, or zeros); write the returned final conv and
recurrent states to the state page (same on every rank). Per MLA layer: `mla_layer_prefill_cp` (or
`mla_prefill_cp` with the layer's tensors) with the cached context's latents / index keys read from
the pool; then write `store_plan(b_0, b_P, ...)`'s rows of `.latent` / `.index_keys` to the pool.
Every call is a collective: every rank of the group calls it, in the same layer order, even with an
empty chunk. Logits: the last prompt token is on the last rank. A snapshot of the state before the
last token (prefix caching): shard [b_0, b_P - 1) and run the last token as today's one-token segment.

Size 1 (group None) is the same code with identity collectives and no second KDA pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from kimiserve.ops.dtypes import compute_dtype
from kimiserve.ops.indexer.reference import indexer_scores
from kimiserve.ops.mla.reference import mla_absorbed, split_kv_b
from kimiserve.ops.topk.reference import causal_topk, selection_mask

PREFILL_SCORE_BYTES = 256 << 20
"""Query rows per attention block are chosen so that one [rows, heads, context] fp32 buffer stays below this."""

KdaFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q, k, v, g, beta, initial_state [B, H, K, V]) -> (o shaped as v, final state [B, H, K, V]):
`DecodeOps.kda_prefill` (fla on GPU) or `kimiserve.ops.kda.paged.kda_prefill` (the reference)."""


# -------------------------------------------------------------------------------------------------
# the group and its chunks
# -------------------------------------------------------------------------------------------------
@dataclass
class CommStats:
    """What the collectives of a prefill shipped, per kind: calls, bytes this rank sent to and
    received from other ranks (payload: an all-gather of n padded bytes sends and receives (P-1) n)."""

    calls: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, sent: int, received: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.sent[kind] = self.sent.get(kind, 0) + sent
        self.received[kind] = self.received.get(kind, 0) + received


@dataclass(frozen=True)
class PrefillShard:
    """Rank `rank` of a PCP group of len(bounds) - 1 ranks holds prompt tokens [bounds[rank],
    bounds[rank + 1]) (absolute positions in the sequence; bounds[0] = the tokens already cached).
    group: the torch.distributed group (`ParallelContext.pcp_group`), None at size 1."""

    bounds: tuple[int, ...]
    rank: int = 0
    group: object | None = None
    stats: CommStats | None = None

    def __post_init__(self):
        b = self.bounds
        if len(b) < 2 or any(x > y for x, y in zip(b, b[1:])) or b[0] < 0:
            raise ValueError(f"chunk bounds must be non-decreasing positions b_0 <= ... <= b_P, got {b}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a group of more than one rank needs its process group")

    @classmethod
    def split(cls, start: int, end: int, size: int, rank: int = 0, group: object | None = None,
              stats: CommStats | None = None) -> "PrefillShard":
        """Tokens [start, end) in `size` contiguous chunks of near-equal length (the first
        (end - start) % size chunks one longer)."""
        n, extra = divmod(end - start, size)
        bounds = [start]
        for r in range(size):
            bounds.append(bounds[-1] + n + (r < extra))
        return cls(tuple(bounds), rank, group, stats)

    @classmethod
    def from_context(cls, ctx, start: int, end: int, stats: CommStats | None = None) -> "PrefillShard":
        """The chunk of this rank of `ctx`'s PCP group (a `ParallelContext`)."""
        return cls.split(start, end, ctx.pcp_size, ctx.pcp_rank, ctx.pcp_group if ctx.pcp_size > 1 else None, stats)

    @property
    def size(self) -> int:
        return len(self.bounds) - 1

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def lengths(self) -> list[int]:
        return [self.bounds[r + 1] - self.bounds[r] for r in range(self.size)]

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def positions(self, device=None) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=device)


def all_gather_equal(x: torch.Tensor, shard: PrefillShard, kind: str) -> list[torch.Tensor]:
    """Every rank's x (same shape and dtype everywhere), in rank order."""
    if shard.size == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x, group=shard.group)
    if shard.stats is not None:
        n = x.numel() * x.element_size() * (shard.size - 1)
        shard.stats.record(kind, n, n)
    return parts


def gather_chunks(x: torch.Tensor, shard: PrefillShard, kind: str = "gather_chunks") -> torch.Tensor:
    """Token rows x [B, T_r, ...] of every rank's chunk, concatenated in position order: [B, b_P - b_0,
    ...]. One all-gather, each chunk padded to the longest (the padding is never read)."""
    if x.shape[1] != shard.length:
        raise ValueError(f"rank {shard.rank} holds {shard.length} tokens, got {x.shape[1]} rows")
    if shard.size == 1:
        return x
    pad = shard.max_length - shard.length
    fill = float("nan") if x.is_floating_point() else 0  # poison: the padding must never be read
    padded = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], dim=1) if pad else x
    parts = all_gather_equal(padded, shard, kind)
    return torch.cat([p[:, :n] for p, n in zip(parts, shard.lengths)], dim=1)


# -------------------------------------------------------------------------------------------------
# KDA: state passing
# -------------------------------------------------------------------------------------------------
def _reference_kda(q, k, v, g, beta, initial_state):
    from kimiserve.ops.kda.paged import kda_prefill

    return kda_prefill(q, k, v, g, beta, initial_state)


def _state_dtype(*tensors) -> torch.dtype:
    return compute_dtype(*tensors)  # fp32, fp64 for fp64 inputs


class KdaSummary(NamedTuple):
    transition: torch.Tensor
    """A [B, H, K, K]: the chunk maps a start state S0 to A @ S0 + end_from_zero."""
    end_from_zero: torch.Tensor
    """E [B, H, K, V]: the chunk's end state from a zero start."""
    o_from_zero: torch.Tensor | None = None
    """[B, T, H, V] the outputs from a zero start (kernel dtype)."""
    readout: torch.Tensor | None = None
    """r [B, T, H, K] = P_t^T (K^-1/2 q_t): the output's linear dependence on the start state."""


def kda_chunk_summary(q, k, v, g, beta, kda_fn: KdaFn | None = None) -> KdaSummary:
    """(A, E) of one chunk, and the zero-start outputs and readouts, from ONE call of the chunked
    kernel with V + K value columns: v' = [v | 0], start state [0 | I]. q, k L2-normalised (after the
    short conv) [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log decay; beta [B, T, H]. A and E are fp32
    (fp64 for fp64 inputs); an empty chunk has A = I, E = 0."""
    kda_fn = kda_fn or _reference_kda
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = _state_dtype(q, k, v, g, beta)
    eye = torch.eye(K, dtype=dt, device=k.device).expand(B, H, K, K)
    if T == 0:
        return KdaSummary(eye.clone(), torch.zeros(B, H, K, V, dtype=dt, device=k.device),
                          v.new_empty(B, 0, H, V), q.new_empty(B, 0, H, K))
    v_ext = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    start = torch.cat([torch.zeros(B, H, K, V, dtype=dt, device=k.device), eye], dim=-1)
    o, state = kda_fn(q, k, v_ext, g, beta, start)
    state = state.to(dt)
    return KdaSummary(state[..., V:].contiguous(), state[..., :V].contiguous(), o[..., :V], o[..., V:])


def kda_transition(k, g, beta, kda_fn: KdaFn | None = None) -> torch.Tensor:
    """A [B, H, K, K] alone: the recurrence run from the identity with v = 0 (q does not matter)."""
    kda_fn = kda_fn or _reference_kda
    B, T, H, K = k.shape
    dt = _state_dtype(k, g, beta)
    eye = torch.eye(K, dtype=dt, device=k.device).expand(B, H, K, K).contiguous()
    if T == 0:
        return eye
    return kda_fn(k, k, k.new_zeros(B, T, H, K), g, beta, eye)[1].to(dt)


def fold_states(transitions: Sequence[torch.Tensor], ends: Sequence[torch.Tensor],
                initial_state: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The start state of every chunk, in order, and the end state of the last: [S_start[0], ...,
    S_start[P]] with S_start[0] = initial_state (zeros when None) and S_start[r+1] = A_r S_start[r] + E_r."""
    E0 = ends[0]
    S = torch.zeros_like(E0) if initial_state is None else initial_state.to(E0.dtype)
    starts = [S]
    for A, E in zip(transitions, ends):
        S = torch.matmul(A.to(E0.dtype), S) + E.to(E0.dtype)
        starts.append(S)
    return starts


def kda_start_state(summary: KdaSummary, shard: PrefillShard, initial_state: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """All-gather (A, E) of every rank (one collective, [B, H, K, K + V] fp32 each) and fold them in
    rank order from the sequence's initial state. Returns (this rank's start state, the prompt's
    final state, every chunk's start state [P + 1])."""
    A, E = summary.transition, summary.end_from_zero
    K = A.shape[-1]
    parts = all_gather_equal(torch.cat([A, E], dim=-1), shard, "kda_state")
    starts = fold_states([p[..., :K] for p in parts], [p[..., K:] for p in parts], initial_state)
    return starts[shard.rank], starts[-1], starts


class KdaCpResult(NamedTuple):
    o: torch.Tensor
    """[B, T_r, H, V] this rank's outputs (the kernel's dtype)."""
    start_state: torch.Tensor
    """The state the chunk starts from (fp32): the single-device state at b_r."""
    chunk_end_state: torch.Tensor
    """The state at b_{r+1}: the kernel's ("recompute") or the fold's ("correct")."""
    final_state: torch.Tensor
    """The prompt's final state (the state at b_P) from the fold: bitwise the same on every rank."""


def kda_prefill_cp(q, k, v, g, beta, shard: PrefillShard, initial_state: torch.Tensor | None = None,
                   kda_fn: KdaFn | None = None, mode: str = "recompute") -> KdaCpResult:
    """The delta rule over this rank's chunk of a token-sharded prompt, continuing from the true
    state at b_r. q, k (L2-normalised, after the short conv), v, g, beta: this rank's tokens, as
    `chunk_kda` takes them; initial_state [B, H, K, V]: the sequence's state at b_0 (zeros when None:
    no cached prefix). mode "recompute" (summary pass, fold, second kernel pass from the start state)
    or "correct" (summary pass, fold, o = o0 + r @ S_start). Collective: every rank must call it."""
    if mode not in ("recompute", "correct"):
        raise ValueError(f"mode must be 'recompute' or 'correct', got {mode!r}")
    kda_fn = kda_fn or _reference_kda
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = _state_dtype(q, k, v, g, beta)
    if shard.size == 1:  # one rank: the plain kernel call
        S0 = torch.zeros(B, H, K, V, dtype=dt, device=k.device) if initial_state is None else initial_state.to(dt)
        if T == 0:
            return KdaCpResult(v.new_empty(B, 0, H, V), S0, S0, S0)
        o, S = kda_fn(q, k, v, g, beta, S0)
        return KdaCpResult(o, S0, S.to(dt), S.to(dt))
    summary = kda_chunk_summary(q, k, v, g, beta, kda_fn)
    start, final, starts = kda_start_state(summary, shard, initial_state)
    if T == 0:
        return KdaCpResult(v.new_empty(B, 0, H, V), start, start, final)
    if mode == "recompute":
        o, S = kda_fn(q, k, v, g, beta, start.contiguous())
        return KdaCpResult(o, start, S.to(dt), final)
    correction = torch.einsum("bthk,bhkv->bthv", summary.readout.to(dt), start)
    o = (summary.o_from_zero.to(dt) + correction).to(v.dtype)
    return KdaCpResult(o, start, starts[shard.rank + 1], final)


# -------------------------------------------------------------------------------------------------
# the short conv across chunk boundaries
# -------------------------------------------------------------------------------------------------
def conv_halo(x: torch.Tensor, shard: PrefillShard, width: int, conv_state: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv windows around a token-sharded prompt. x [B, T_r, C]: this rank's PRE-conv inputs;
    conv_state [B, C, W-1]: the W-1 inputs before b_0 (zeros when None). Returns (the W-1 inputs before
    b_r, the conv state this rank's chunk should start from [B, C, W-1]; the last W-1 inputs of the
    prompt, the conv state it leaves for decode, in conv_state's dtype (x's when None), as
    `causal_conv1d` leaves it). One all-gather of each rank's last min(W-1, T_r) inputs; chunks
    shorter than W-1 pass on inputs of earlier chunks (and of conv_state) through the composition."""
    B, T, C = x.shape
    w = width - 1
    out_dtype = x.dtype if conv_state is None else conv_state.dtype
    dt = x.dtype if conv_state is None else torch.promote_types(x.dtype, conv_state.dtype)  # holds both exactly
    window = x.new_zeros(B, C, w, dtype=dt) if conv_state is None else conv_state.to(dt)
    if w == 0:
        return window, window.to(out_dtype)
    tail = x[:, max(0, T - w):].transpose(1, 2).to(dt)  # [B, C, min(w, T)]
    if tail.shape[-1] < w:  # a chunk shorter than W-1: NaN-poisoned slots, never read
        tail = torch.cat([tail.new_full((B, C, w - tail.shape[-1]), float("nan")), tail], dim=-1)
    tails = all_gather_equal(tail.contiguous(), shard, "conv_halo")
    start = None
    for r, (t, n) in enumerate(zip(tails, shard.lengths)):
        if r == shard.rank:
            start = window
        n = min(w, n)
        window = torch.cat([window, t[..., w - n:]], dim=-1)[..., -w:]
    return start, window.to(out_dtype)


def kda_conv_halo(q, k, v, shard: PrefillShard, width: int, conv_state: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`conv_halo` for KDA's three convs in the layer's conv-state layout: q, k, v [B, T_r, P] pre-conv
    projections, conv_state [B, 3, P, W-1] (as `KimiDeltaAttention.short_conv` takes it). Returns
    (start conv state, final conv state), both [B, 3, P, W-1]: one collective for the three."""
    B, T, P = q.shape
    x = torch.cat([q, k, v], dim=-1)
    state = None if conv_state is None else conv_state.reshape(B, 3 * P, width - 1)
    start, final = conv_halo(x, shard, width, state)
    return start.reshape(B, 3, P, width - 1), final.reshape(B, 3, P, width - 1)


def kda_mix_cp(layer, q, k, v, g, beta, shard: PrefillShard, conv_state: torch.Tensor | None = None,
               state: torch.Tensor | None = None, kda_fn: KdaFn | None = None, mode: str = "recompute"):
    """`KimiDeltaAttention.mix` for this rank's chunk of a token-sharded prompt: q, k, v the chunk's
    pre-conv projections [B, T_r, P], g, beta its gates; conv_state [B, 3, P, W-1] and state [B, H, K, V]
    the sequence's at b_0 (the prefix-cache snapshot; zeros when None). Returns (o [B, T_r, H, V], the
    prompt's final conv state, the prompt's final recurrent state): the two states the sequence's
    state page must hold after the prompt, the same on every rank."""
    width = layer.q_conv1d.weight.shape[-1]
    start_conv, final_conv = kda_conv_halo(q, k, v, shard, width, conv_state)
    if q.shape[1]:
        qh, kh, vh, _ = layer.short_conv(q, k, v, start_conv)
    else:  # an empty chunk (a prompt shorter than the group): nothing to convolve, still in the collectives
        B, H, K = q.shape[0], layer.num_heads, layer.head_dim
        qh, kh, vh = q.view(B, 0, H, K), k.view(B, 0, H, K), v.view(B, 0, H, K)
    res = kda_prefill_cp(qh, kh, vh, g, beta, shard, state, kda_fn, mode)
    return res.o, final_conv, res.final_state


# -------------------------------------------------------------------------------------------------
# MLA and the indexer over a token-sharded prompt
# -------------------------------------------------------------------------------------------------
class MlaCpResult(NamedTuple):
    o: torch.Tensor
    """[B, T_r, H, dv]: this rank's attention output (before the output gate and o_proj)."""
    latent: torch.Tensor
    """[B, b_P, L + R]: every token's latent, cached context and prompt (for the pool writes)."""
    index_keys: torch.Tensor | None
    """[B, b_P, D]: every token's index key (None without an indexer)."""
    indices: torch.Tensor | None
    """[B, T_r, topk]: the selected positions of this rank's queries (-1 padded), None without an indexer."""


def mla_prefill_cp(q_nope, q_pe, latent, w_kc, w_vc, scale: float, shard: PrefillShard, *,
                   index_keys: torch.Tensor | None = None, index_q: torch.Tensor | None = None,
                   index_w: torch.Tensor | None = None, topk: int | None = None,
                   context_latent: torch.Tensor | None = None, context_keys: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, max_score_bytes: int = PREFILL_SCORE_BYTES) -> MlaCpResult:
    """Sparse (or dense) MLA for this rank's queries over every token before them.

    This rank's chunk: q_nope [B, T_r, H, dn], q_pe [B, T_r, H, dr], latent [B, T_r, L + R] (normed c and
    k_pe, as the cache stores them: apply any cache round trip before), index_keys [B, T_r, D],
    index_q [B, T_r, Hi, D], index_w [B, T_r, Hi] (`Indexer.queries`) and topk (all four, or none for
    dense MLA); w_kc [H, dn, L], w_vc [H, dv, L] (`split_kv_b`); context_latent [B, b_0, L + R] and
    context_keys [B, b_0, D]: the cached tokens before the prompt (read from the pool). One all-gather
    of latent (+ index keys, in one tensor when their dtypes agree). The query at position p scores
    keys [0, p] (`indexer_scores`), takes `causal_topk` (equal scores: equal sets, single-device tie
    rule) and attends over them (`mla_absorbed`), in blocks of query rows that keep one
    [rows, heads, context] fp32 buffer under max_score_bytes. out: [B, T_r, H, dv] to write into (a
    fresh NaN-poisoned tensor when None). Collective: every rank must call it."""
    B, T, H = q_nope.shape[:3]
    b0 = shard.bounds[0]
    indexed = index_keys is not None
    if indexed and (index_q is None or index_w is None or topk is None):
        raise ValueError("an indexer needs index_keys, index_q, index_w and topk")
    if (context_latent is None and b0) or (context_latent is not None and context_latent.shape[1] != b0):
        raise ValueError(f"the prompt starts at {b0}: context_latent must hold the {b0} cached tokens before it")
    if indexed and b0 and (context_keys is None or context_keys.shape[1] != b0):
        raise ValueError(f"context_keys must hold the {b0} cached tokens' index keys")
    LR = latent.shape[-1]
    if indexed and index_keys.dtype == latent.dtype:
        full = gather_chunks(torch.cat([latent, index_keys], dim=-1), shard, "mla_tokens")
        full_latent, full_keys = full[..., :LR], full[..., LR:]
    else:
        full_latent = gather_chunks(latent, shard, "mla_latent")
        full_keys = gather_chunks(index_keys, shard, "mla_index_keys") if indexed else None
    if b0:
        full_latent = torch.cat([context_latent.to(full_latent.dtype), full_latent], dim=1)
        if indexed:
            full_keys = torch.cat([context_keys.to(full_keys.dtype), full_keys], dim=1)
    L = w_kc.shape[-1]
    if out is None:
        out = q_nope.new_full((B, T, H, w_vc.shape[1]), float("nan"))
    indices = torch.full((B, T, topk), -1, dtype=torch.int64, device=q_nope.device) if indexed else None
    heads = max(H, index_q.shape[2] if indexed else 0)
    lo = 0
    while lo < T:
        rows = max(1, min(T - lo, max_score_bytes // max(1, 4 * B * heads * shard.end)))
        hi = lo + rows
        ctx_end = shard.start + hi  # keys [0, last position of the block]
        pos = torch.arange(shard.start + lo, shard.start + hi, device=q_nope.device)
        c = full_latent[:, :ctx_end]
        if indexed:
            scores = indexer_scores(index_q[:, lo:hi], full_keys[:, :ctx_end], index_w[:, lo:hi])
            idx = causal_topk(scores, pos, topk)
            indices[:, lo:hi] = idx
            mask = selection_mask(idx, ctx_end)
        else:
            mask = (torch.arange(ctx_end, device=pos.device).unsqueeze(0) <= pos.unsqueeze(1)).expand(B, -1, -1)
        out[:, lo:hi] = mla_absorbed(q_nope[:, lo:hi], q_pe[:, lo:hi], c[..., :L], c[..., L:], w_kc, w_vc, scale, mask)
        lo = hi
    return MlaCpResult(out, full_latent, full_keys, indices)


def mla_layer_prefill_cp(layer, x: torch.Tensor, shard: PrefillShard, *, context_latent=None, context_keys=None,
                         roundtrip=None, max_score_bytes: int = PREFILL_SCORE_BYTES) -> tuple[torch.Tensor, MlaCpResult]:
    """`MLAAttention`'s full-sequence forward for this rank's chunk x [B, T_r, d] of a token-sharded
    prompt: the layer's own projections, `mla_prefill_cp`, the layer's output gate and o_proj. roundtrip:
    a `CacheRoundTrip` (latents and index keys read as the cache returns them; applied per token,
    before the gather). Returns (the layer's output [B, T_r, d], the `MlaCpResult`)."""
    from kimiserve.cache.formats import roundtrip_index_key, roundtrip_latent

    q_nope, q_pe, q_latent = layer.query(x)
    c, k_pe = layer.latent(x)
    latent = torch.cat([c, k_pe], dim=-1)
    indexer = getattr(layer, "indexer", None)
    keys = indexer.keys(x) if indexer is not None else None
    if roundtrip is not None:
        latent = roundtrip_latent(latent, roundtrip.kv_cache_dtype, roundtrip.latent_scale(layer.cache_index))
        if keys is not None:
            keys = roundtrip_index_key(keys, roundtrip.kv_cache_dtype, roundtrip.rotates_index_keys)
    iq = iw = topk = None
    if indexer is not None:
        iq, iw = indexer.queries(x, q_latent)
        topk = indexer.topk
    w_kc, w_vc = split_kv_b(layer.kv_b_proj.weight, layer.num_heads, layer.nope)
    res = mla_prefill_cp(q_nope, q_pe, latent, w_kc, w_vc, layer.scale, shard, index_keys=keys, index_q=iq,
                         index_w=iw, topk=topk, context_latent=context_latent, context_keys=context_keys,
                         max_score_bytes=max_score_bytes)
    B, T = x.shape[:2]
    return layer.output(x, res.o.reshape(B, T, -1)), res


# -------------------------------------------------------------------------------------------------
# where the pages go
# -------------------------------------------------------------------------------------------------
def dcp_owner(positions: torch.Tensor, dcp_size: int, interleave: int) -> torch.Tensor:
    """The DCP rank that keeps each token: (p // I) % D."""
    return (positions // interleave) % dcp_size


def dcp_local_slot(positions: torch.Tensor, dcp_size: int, interleave: int) -> torch.Tensor:
    """Where a token sits among its owner's tokens: (p // (I D)) I + p % I."""
    return (positions // (interleave * dcp_size)) * interleave + positions % interleave


def _check_dcp(dcp_size: int, interleave: int) -> None:
    if dcp_size < 1 or interleave < 1:
        raise ValueError(f"dcp_size and interleave must be >= 1, got {dcp_size}, {interleave}")


def store_plan(start: int, end: int, dcp_size: int = 1, dcp_rank: int = 0, interleave: int = 1,
               device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which prompt tokens [start, end) a rank writes to its page pool, and where: (positions [n], local
    slots [n]) int64 ascending. Without DCP (dcp_size 1) every token, at its own position (the gathered
    rows of `MlaCpResult.latent` / `.index_keys` included); with DCP, the tokens of `dcp_rank`
    ((p // I) % D == dcp_rank) at slot (p // (I D)) I + p % I of the rank's own block table."""
    _check_dcp(dcp_size, interleave)
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank {dcp_rank} is outside {dcp_size} ranks")
    p = torch.arange(start, end, device=device)
    if dcp_size == 1:
        return p, p.clone()
    p = p[dcp_owner(p, dcp_size, interleave) == dcp_rank]
    return p, dcp_local_slot(p, dcp_size, interleave)


class StoredTokens(NamedTuple):
    positions: torch.Tensor
    """[n] int64, ascending: the tokens this rank keeps."""
    slots: torch.Tensor
    """[n] int64: their local slots (the positions themselves without DCP)."""
    rows: torch.Tensor
    """[n, ...]: their rows."""


def redistribute_tokens(rows: torch.Tensor, chunks: Sequence[tuple[int, int]], holders: Sequence[int | None],
                        dcp_size: int = 1, interleave: int = 1, group: object | None = None,
                        stats: CommStats | None = None) -> StoredTokens:
    """Move token rows from the ranks that computed them to the ranks that keep them, in one
    `all_to_all_single` over `group` (any group containing both; None: one rank).

    chunks[g] = (lo, hi): the tokens group rank g computed (disjoint; (0, 0) for none); rows [hi - lo,
    ...]: this rank's (any trailing shape: e.g. every MLA layer's latent and index key bytes at once).
    holders[g]: the DCP rank whose tokens group rank g keeps ((p // I) % D == holders[g]; every token
    when dcp_size is 1), or None for a rank that keeps nothing. Each rank sends each holder exactly the
    rows it keeps and receives exactly its own: with P sources and D holder classes a rank receives
    ~(T / D) rows. Returns this rank's `StoredTokens`, in position order."""
    _check_dcp(dcp_size, interleave)
    size = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_rank(group)
    if len(chunks) != size or len(holders) != size:
        raise ValueError(f"chunks and holders need one entry per rank of the group ({size})")
    lo, hi = chunks[me]
    if rows.shape[0] != hi - lo:
        raise ValueError(f"rank {me} computed tokens [{lo}, {hi}), got {rows.shape[0]} rows")
    device = rows.device

    def kept(p: torch.Tensor, holder: int | None) -> torch.Tensor:
        if holder is None:
            return torch.zeros_like(p, dtype=torch.bool)
        if dcp_size == 1:
            return torch.ones_like(p, dtype=torch.bool)
        return dcp_owner(p, dcp_size, interleave) == holder

    mine = torch.arange(lo, hi, device=device)
    sends = [kept(mine, h) for h in holders]
    send = torch.cat([rows[m] for m in sends]) if size > 1 else rows[sends[0]]
    incoming = [torch.arange(a, b, device=device) for a, b in chunks]
    incoming = [p[kept(p, holders[me])] for p in incoming]
    positions = torch.cat(incoming)
    if size == 1:
        received = send
    else:
        fill = float("nan") if rows.is_floating_point() else 0
        received = rows.new_full((positions.numel(), *rows.shape[1:]), fill)
        in_splits = [int(m.sum()) for m in sends]
        out_splits = [p.numel() for p in incoming]
        dist.all_to_all_single(received, send.contiguous(), out_splits, in_splits, group=group)
        if stats is not None:
            row = math.prod(rows.shape[1:]) * rows.element_size()
            stats.record("redistribute", row * (sum(in_splits) - in_splits[me]), row * (sum(out_splits) - out_splits[me]))
    order = torch.argsort(positions)
    positions = positions[order]
    slots = positions.clone() if dcp_size == 1 else dcp_local_slot(positions, dcp_size, interleave)
    return StoredTokens(positions, slots, received[order])
