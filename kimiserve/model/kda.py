"""Kimi Delta Attention layer: full-sequence form and paged (serving) form with state pages."""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from torch import nn

from kimiserve.config import ModelConfig
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.model.batch import ForwardBatch
from kimiserve.model.layers import Linear, Source, Weights, make_param, read, sharded_loader, source_shape
from kimiserve.model.parallel_layers import ColumnParallelLinear, RowParallelLinear, context, divide
from kimiserve.model.training import TrainContext
from kimiserve.ops.backend import REFERENCE_OPS
from kimiserve.ops.kda.paged import KDADecodeWeights, short_conv
from kimiserve.ops.kda.reference import chunk_kda, chunk_kda_batched, chunk_kda_tiled, kda_gate, recurrent_kda
from kimiserve.ops.norm.reference import gated_rms_norm
from kimiserve.ops.pointwise import vector_sigmoid


def a_log_loader(rank: int, parts: int):
    """A_log ships as [H] (HF module), [1, 1, H, 1] (Kimi-Linear) or zero-padded 1-D (K3: [128] for
    H = 96); the rank reads its H / parts heads (and checks the padding, which no rank holds)."""
    def load(param: nn.Parameter, loaded: Source, name: str) -> None:
        local = param.shape[0]
        heads = local * parts
        shape = source_shape(loaded)
        total = math.prod(shape)
        if len(shape) == 1 and total >= heads:
            dim = 0
        elif len(shape) == 4 and total == heads:
            dim = max(range(4), key=lambda i: shape[i])  # the one dim of size H
        else:
            raise ValueError(f"tensor {name} has shape {shape}, the model expects ({heads},) or (1, 1, {heads}, 1)")
        if total > heads and torch.any(read(loaded, 0, heads, total) != 0):
            raise ValueError(f"tensor {name} has {total} entries; past the first {heads} (heads) they must be zero padding")
        part = read(loaded, dim, rank * local, (rank + 1) * local)
        param.data.copy_(part.reshape(-1))

    load.shard = (0, rank, parts)
    return load


def conv_loader(rank: int, parts: int):
    """Depthwise conv weights ship as nn.Conv1d's [C, 1, W]; kept as [C / parts, W] (the rank's channels)."""
    def load(param: nn.Parameter, loaded: Source, name: str) -> None:
        local, width = param.shape
        shape = source_shape(loaded)
        if shape not in ((local * parts, 1, width), (local * parts, width)):
            raise ValueError(f"tensor {name} has shape {shape}, the model expects {(local * parts, 1, width)}")
        part = read(loaded) if parts == 1 else read(loaded, 0, rank * local, (rank + 1) * local)
        param.data.copy_(part.reshape(local, width))

    load.shard = (0, rank, parts)
    return load


class KimiDeltaAttention(nn.Module):
    """KDA with its heads split over the TP ranks: q/k/v projections and their conv channels, f_b, b,
    A_log, dt_bias and the output gate (g_proj or g_b) hold the rank's H / tp heads (column-parallel by
    heads), o_proj is row-parallel (one all-reduce); f_a, g_a and the per-head-dim o_norm are
    replicated. A rank's state pages hold its heads only."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, cache_index: int = 0,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.cache_index = cache_index  # which KDA layer's state page of a sequence this is
        p = context(parallel)
        d, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        P = H * K
        Hl = divide(H, p.tp_size, "KDA heads (linear_attn_config.num_heads)")
        Pl = Hl * K
        self.num_heads, self.head_dim, self.eps = Hl, K, config.rms_norm_eps  # this rank's heads
        self.lower_bound = config.gate_lower_bound
        column = lambda i, o: ColumnParallelLinear(i, o, dtype, p)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = (column(d, P) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            Weights(Pl, config.kda_conv_size, dtype=torch.float32, loader=conv_loader(p.tp_rank, p.tp_size),
                    full_shape=(P, config.kda_conv_size)) for _ in range(3)
        )
        self.f_a_proj = Linear(d, K, dtype)
        self.f_b_proj = column(K, P)
        self.b_proj = column(d, H)
        self.A_log = make_param(Hl, dtype=torch.float32, loader=a_log_loader(p.tp_rank, p.tp_size), full_shape=(H,))
        self.dt_bias = make_param(Pl, dtype=torch.float32, loader=sharded_loader(0, p.tp_rank, p.tp_size),
                                  full_shape=(P,))
        if config.kda_full_rank_output_gate:
            self.g_proj = column(d, P)
        else:
            self.g_a_proj = Linear(d, K, dtype)
            self.g_b_proj = column(K, P)
        self.o_norm = Weights(K, dtype=torch.float32)
        self.o_proj = RowParallelLinear(P, d, dtype, p)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]: full sequences from a zero state, or (ctx a ForwardBatch) packed
        serving tokens continuing from each sequence's state page. Other contexts do not concern KDA."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        # the projections of x through `ops.linears` (one GEMM on request on the serving path)
        ops = ctx.ops if isinstance(ctx, ForwardBatch) else REFERENCE_OPS
        full_rank_gate = hasattr(self, "g_proj")
        q, k, v, b, gate, f_low = ops.linears(x, (self.q_proj, self.k_proj, self.v_proj, self.b_proj,
                                                  self.g_proj if full_rank_gate else self.g_a_proj, self.f_a_proj))
        f = self.f_b_proj(f_low)
        if not full_rank_gate:
            gate = self.g_b_proj(gate)
        if isinstance(ctx, ForwardBatch) and ctx.pcp is None:
            o = self.paged_forward(q, k, v, f, b, gate, ctx)
        else:
            o = self.mix_and_norm(q, k, v, f, b, gate, ctx)
        return self.o_proj(o.reshape(B, T, H * K))

    def mix_and_norm(self, q, k, v, f, b, gate, ctx: object = None) -> torch.Tensor:
        """Gate, beta, the mix (full sequences, or `paged_mix` on a ForwardBatch) and the gated RMSNorm
        over all [B, T] tokens."""
        B, T, _ = q.shape
        heads = lambda t: t.view(B, T, self.num_heads, self.head_dim)  # noqa: E731
        g = kda_gate(heads(f), self.A_log, self.dt_bias, self.lower_bound)
        beta = vector_sigmoid(b.float())
        norm = gated_rms_norm
        if isinstance(ctx, ForwardBatch):
            o = self.paged_mix(q, k, v, g, beta, ctx)
            norm = ctx.ops.gated_rms_norm
        else:
            train = isinstance(ctx, TrainContext)
            o, _, _ = self.mix(q, k, v, g, beta, chunk_size=ctx.kda_chunk_size if train else 64, train=train,
                               tiled=train and ctx.fast)
        return norm(o, heads(gate), self.o_norm.weight, self.eps)

    def paged_forward(self, q, k, v, f, b, gate, batch: ForwardBatch) -> torch.Tensor:
        """Packed serving tokens [1, N] after the projections -> the o_proj input [1, N, H, V]: the
        one-token (decode) rows through `batch.ops.kda_decode_step` (short conv, gates, delta rule on
        their state pages, norm: one fused kernel on CUDA), the other rows through `mix_and_norm`."""
        B, T, _ = q.shape
        rows = batch.decode_rows
        if batch.decode_only:  # the rows themselves, no gather or scatter
            return batch.ops.kda_decode_step(q[0], k[0], v[0], f[0], b[0], gate[0], self.decode_weights, batch.pool.conv,
                                             batch.pool.recurrent, batch.decode_state_pages[:, self.cache_index])[None]
        if any(not c.verify for c in batch.prefill_chunks):
            o = self.mix_and_norm(q, k, v, f, b, gate, batch)
        else:
            o = v.new_empty(B, T, self.num_heads, self.head_dim)
        if rows.numel():
            pick = lambda t: t[0, rows]  # noqa: E731
            o[0, rows] = batch.ops.kda_decode_step(
                pick(q), pick(k), pick(v), pick(f), pick(b), pick(gate), self.decode_weights,
                batch.pool.conv, batch.pool.recurrent, batch.decode_state_pages[:, self.cache_index])
        if batch.verify_grid is not None:
            self.verify_steps(q, k, v, f, b, gate, batch, o)
        return o

    @property
    def decode_weights(self) -> KDADecodeWeights:
        return KDADecodeWeights(self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, self.A_log,
                                self.dt_bias, self.lower_bound, self.o_norm.weight, self.eps)

    def short_conv(self, q, k, v, conv_state=None):
        """Short conv over [B, T] tokens from conv_state [B, 3, P, W-1] (zeros when None). Returns
        (q, k [B, T, H, K] L2-normalised, v [B, T, H, V], new conv state)."""
        return short_conv(q, k, v, self.decode_weights, self.num_heads, conv_state)

    def mix(self, q, k, v, g, beta, conv_state=None, state=None, recurrent=False, chunk_size: int = 64,
            train: bool = False, tiled: bool = False):
        """Short conv + delta rule over [B, T] tokens from (conv_state [B, 3, P, W-1], state [B, H, K, V])
        (zeros when None). Returns (o [B, T, H, V], new conv state, new recurrent state).

        train: the chunked form with all chunks batched but the state recurrence (fewer, larger kernels),
        recomputed in the backward pass (its [C, C, K] decays per token are the bulk of a step's memory);
        tiled: with the intra-chunk scores as tiled matmuls instead (`chunk_kda_tiled`, tiles set by the gate's
        bound), not recomputed: its intermediates are a few per-token vectors a head."""
        q, k, v, conv = self.short_conv(q, k, v, conv_state)
        if recurrent:
            o, state = recurrent_kda(q, k, v, g, beta, initial_state=state)
        elif tiled:
            bound = None if self.lower_bound is None else -self.lower_bound
            o, state = chunk_kda_tiled(q, k, v, g, beta, None, state, chunk_size, bound)
        elif train:
            o, state = torch.utils.checkpoint.checkpoint(chunk_kda_batched, q, k, v, g, beta, None, state, chunk_size,
                                                         use_reentrant=False)
        else:
            o, state = chunk_kda(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
        return o, conv, state

    def paged_mix(self, q, k, v, g, beta, batch: ForwardBatch) -> torch.Tensor:
        """`mix` for the packed tokens [1, N] of the prefill chunks (decode and verify rows are left to
        `paged_forward`, whose rows of the result are not written here): together in varlen chunked
        form (`batch.ops.kda_prefill`), each reading and writing its state page of this layer; a chunk
        with snapshot pages also leaves the state before its last token there (its last token runs in
        a second varlen pass, from the snapshot)."""
        if batch.pcp is not None:
            return self.paged_mix_token_sharded(q, k, v, g, beta, batch)
        pool, i, ops = batch.pool, self.cache_index, batch.ops
        o = v.new_empty(*v.shape[:2], self.num_heads, self.head_dim)
        chunks = [c for c in batch.prefill_chunks if not c.verify]
        if chunks:
            first, last = [], []  # (start, end, state page read, state page written)
            for c in chunks:
                page = c.state_pages[i]
                if c.snapshot_state_pages is None:
                    first.append((c.start, c.end, page, page))
                else:
                    snap = c.snapshot_state_pages[i]
                    first.append((c.start, c.end - 1, page, snap))
                    last.append((c.end - 1, c.end, snap, page))
            for segments in (first, last):
                if segments:
                    self.prefill_segments(q, k, v, g, beta, segments, o, pool, ops)
        return o

    def verify_steps(self, q, k, v, f, b, gate, batch: ForwardBatch, o: torch.Tensor) -> None:
        """Verify chunks (the pending token plus K drafts, rows `batch.verify_grid` [B, T]): position t
        of every chunk through `ops.kda_decode_step`, the op (and so the arithmetic) of a decode step, on
        copies of the chunks' conv and state pages; the pages stay at the committed state and the
        inputs are kept for `replay_verified`, so a rejected draft costs no recompute of the prefix. With
        `batch.verify_slots` (`ops.kda_verify_steps` set), every position in one `ops.kda_verify_steps` call
        instead, which leaves the states after each position in the slots (the commit copies one per chunk)."""
        pool, i = batch.pool, self.cache_index
        if batch.verify_slots is not None:  # one op for every position, the states after each kept in slots
            B, T = batch.verify_grid.shape
            conv_slots, state_slots = batch.verify_slots.layer(i, B, T)
            batch.ops.kda_verify_steps(q[0], k[0], v[0], f[0], b[0], gate[0], self.decode_weights, pool.conv,
                                       pool.recurrent, batch.verify_state_pages[:, i], batch.verify_grid,
                                       batch.verify_lengths, batch.verify_active, o[0], conv_slots, state_slots)
            return
        grid = batch.verify_grid.t().contiguous()  # [T, B]: position-major, position t of every chunk contiguous
        xs = tuple(t[0][grid] for t in (q, k, v, f, b, gate))  # copies [T, B, ...]: no view of the whole step
        batch.verify_inputs[i] = xs[:5]
        pages = batch.verify_state_pages[:, i]
        conv, states = pool.conv[pages], pool.recurrent[pages]  # copies, addressed as pages 0..B-1
        ids = torch.arange(grid.shape[1], dtype=torch.int64, device=grid.device)
        every = []  # outputs of the leading positions every chunk has, written at once
        for t, active in enumerate(batch.verify_active):
            if active is None:
                every.append(batch.ops.kda_decode_step(*(x[t] for x in xs), self.decode_weights, conv, states, ids))
            else:
                o[0, grid[t, active]] = batch.ops.kda_decode_step(*(x[t][active] for x in xs), self.decode_weights,
                                                                  conv, states, ids[active])
        if every:
            o[0, grid[: len(every)]] = torch.stack(every)

    def replay_verified(self, pool, ops, inputs: tuple[torch.Tensor, ...], steps: list[tuple]) -> None:
        """Advance state pages over kept verify tokens: for each position t, steps[t] = (rows, pages):
        the chunks (rows of `ForwardBatch.verify_inputs[cache_index]`, [T, B, ...]; a slice or an index
        tensor) whose token t is kept, and the state pages [n] they advance in place, through
        `ops.kda_decode_step` exactly as the verify forward ran them (its output is not needed)."""
        q, k, v, f, b = inputs
        for t, (rows, pages) in enumerate(steps):
            x = [y[t][rows] for y in (q, k, v, f, b)]
            ops.kda_decode_step(*x, x[0], self.decode_weights, pool.conv, pool.recurrent, pages)

    def prefill_segments(self, q, k, v, g, beta, segments, o, pool, ops) -> None:
        """Packed rows [start, end) of each segment continue from the state pages `src` and leave
        their final state in `dst`: short conv per segment, then one varlen chunked-form call."""
        src = torch.stack([s for _, _, s, _ in segments])
        dst = torch.stack([d for _, _, _, d in segments])
        conv_in = pool.conv[src]
        parts = []
        for j, (start, end, _, _) in enumerate(segments):
            qh, kh, vh, conv = ops.short_conv(q[:, start:end], k[:, start:end], v[:, start:end], self.decode_weights,
                                              self.num_heads, conv_in[j : j + 1])
            pool.conv[dst[j : j + 1]] = conv
            parts.append((qh, kh, vh, g[:, start:end], beta[:, start:end]))
        lengths = [end - start for start, end, _, _ in segments]
        cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        packed = parts[0] if len(parts) == 1 else [torch.cat(t, dim=1) for t in zip(*parts)]
        out, states = ops.kda_prefill(*packed, pool.recurrent[src], cu_seqlens)
        pool.recurrent[dst] = states
        for (start, end, _, _), offset in zip(segments, cu_seqlens.tolist()):
            o[:, start:end] = out[:, offset : offset + end - start]

    def paged_mix_token_sharded(self, q, k, v, g, beta, batch: ForwardBatch) -> torch.Tensor:
        """`paged_mix` for this rank's share of a token-sharded prefill chunk (`batch.pcp`): the KDA
        states cross the shards (`distributed.prefill_cp.kda_mix_cp`: every rank folds the earlier
        shards' transitions); every rank writes the same final state to the sequence's state page. With
        a snapshot the shards run up to the prompt's last token, whose owner (the last rank) runs it
        from the snapshot and broadcasts the final state."""
        import torch.distributed as dist

        from kimiserve.distributed.prefill_cp import PrefillShard, kda_mix_cp

        pool, i, shard = batch.pool, self.cache_index, batch.pcp
        chunk = batch.chunks[0]
        page = chunk.state_pages[i : i + 1]
        conv0, state0 = pool.conv[page], pool.recurrent[page]
        kda_fn = batch.ops.kda_prefill
        snapshot = chunk.snapshot_state_pages
        if snapshot is None:
            o, conv, state = kda_mix_cp(self, q, k, v, g, beta, shard, conv0, state0, kda_fn)
            pool.conv[page], pool.recurrent[page] = conv.to(pool.conv.dtype), state.to(pool.recurrent.dtype)
            return o
        last = shard.rank == shard.size - 1
        bounds = (*shard.bounds[:-1], shard.bounds[-1] - 1)  # the last rank keeps the last token back
        head = PrefillShard(bounds, shard.rank, shard.group, shard.stats)
        n = head.length
        o_head, conv_s, state_s = kda_mix_cp(self, q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], head,
                                             conv0, state0, kda_fn)
        snap = snapshot[i : i + 1]
        pool.conv[snap], pool.recurrent[snap] = conv_s.to(pool.conv.dtype), state_s.to(pool.recurrent.dtype)
        conv_f = torch.empty_like(pool.conv[page])
        state_f = torch.empty_like(pool.recurrent[page])
        o = v.new_empty(*v.shape[:2], self.num_heads, self.head_dim)
        o[:, :n] = o_head
        if last:
            qh, kh, vh, conv = self.short_conv(q[:, n:], k[:, n:], v[:, n:], conv_s.to(pool.conv.dtype))
            out, state = kda_fn(qh, kh, vh, g[:, n:], beta[:, n:], state_s.to(pool.recurrent.dtype), None)
            o[:, n:] = out
            conv_f.copy_(conv)
            state_f.copy_(state)
        if shard.size > 1:
            owner = dist.get_global_rank(shard.group, shard.size - 1)
            dist.broadcast(conv_f, src=owner, group=shard.group)
            dist.broadcast(state_f, src=owner, group=shard.group)
        pool.conv[page], pool.recurrent[page] = conv_f, state_f
        return o

