"""Multi-head latent attention with the K3.1 lightning indexer: full-sequence and paged (serving) forms."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kimiserve.cache.formats import latent_scale_of, roundtrip_index_key, roundtrip_latent
from kimiserve.config import ModelConfig
from kimiserve.model.batch import CacheRoundTrip, ForwardBatch
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.model.layers import Linear, RMSNorm, Weights
from kimiserve.model.training import TrainContext, mla_train_forward
from kimiserve.model.parallel_layers import ColumnParallelLinear, RowParallelLinear, context, divide
from kimiserve.ops.indexer.reference import indexer_scores
from kimiserve.ops.mla.reference import mla_absorbed, split_kv_b
from kimiserve.ops.norm.reference import layer_norm, rms_norm
from kimiserve.ops.topk.reference import causal_topk, selection_mask

# HF builds q_a_layernorm / kv_a_layernorm with KimiRMSNorm's default eps, not rms_norm_eps
LORA_NORM_EPS = 1e-6
INDEX_KEY_NORM_EPS = 1e-6
# in-place prefill scores at most this many bytes of [query rows, context] at a time
PREFILL_SCORE_BYTES = 256 << 20


class Indexer(nn.Module):
    """Scores earlier tokens for each query: sum_h w_h ReLU(q_h . k_s) (DeepSeek-V3.2 DSA, no rope).

    The index query comes from the q-LoRA latent (from the hidden state when there is no q-LoRA),
    the index key from the hidden state through a LayerNorm, the head weights from the hidden state.
    Replicated under tensor parallelism: every rank computes every index head (a score sums over
    all heads, so split heads would all-reduce a score row per query per layer).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d, Hi, D = config.hidden_size, config.index_n_heads, config.index_head_dim
        self.num_heads, self.head_dim, self.topk = Hi, D, config.index_topk
        self.wq_b = Linear(config.q_lora_rank or d, Hi * D, dtype)
        self.wk = Linear(d, D, dtype)
        self.k_norm = Weights(D, dtype=dtype, bias=True)  # LayerNorm
        self.weights_proj = Linear(d, Hi, dtype)

    def keys(self, x: torch.Tensor, norm: Callable = layer_norm) -> torch.Tensor:
        """One index key per token: [B, T, D]; norm: the key LayerNorm's op (`DecodeOps.layer_norm` on the
        serving path)."""
        return self.keys_from_projection(self.wk(x), norm)

    def keys_from_projection(self, projected: torch.Tensor, norm: Callable = layer_norm) -> torch.Tensor:
        """The index keys of wk's output (the key LayerNorm)."""
        return norm(projected, self.k_norm.weight, self.k_norm.bias, INDEX_KEY_NORM_EPS)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [B, T, Hi, D], head weights [B, T, Hi] with both scales folded in)."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.num_heads, self.head_dim)
        w = self.weights_proj(x).float() * (self.num_heads ** -0.5 * self.head_dim ** -0.5)
        return q, w

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Top-k indices into `keys` [B, S, D] for queries at `positions` [T]: [B, T, topk], -1 padded."""
        q, w = self.queries(x, q_latent)
        return causal_topk(indexer_scores(q, keys, w), positions, self.topk)


class MLAAttention(nn.Module):
    """MLA with its heads split over the TP ranks (q_b or q_proj, kv_b, g_proj column-parallel by
    heads, o_proj row-parallel: one all-reduce); the latent (q_a, kv_a and their norms) and the
    indexer are replicated, so every rank caches every token's whole latent and index key."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, cache_index: int = 0,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.cache_index = cache_index  # which MLA layer of the cache pages this is
        p = context(parallel)
        d, H = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(H, p.tp_size, "MLA heads (num_attention_heads)")  # this rank's heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.qk_head_dim ** -0.5
        if config.q_lora_rank is not None:
            self.q_a_proj = Linear(d, config.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, H * config.qk_head_dim, dtype, p)
        else:
            self.q_proj = ColumnParallelLinear(d, H * config.qk_head_dim, dtype, p)
        self.kv_a_proj_with_mqa = Linear(d, config.kv_latent_dim, dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, H * (self.nope + self.v_dim), dtype, p)
        self.o_proj = RowParallelLinear(H * self.v_dim, d, dtype, p)
        if config.mla_use_output_gate:
            self.g_proj = ColumnParallelLinear(d, H * self.v_dim, dtype, p)
        if config.has_indexer:
            self.indexer = Indexer(config, dtype)

    def input_projections(self) -> tuple:
        """The projections of the layer's input x at the top of the layer: q_a (or q), kv_a and the index key's wk."""
        first = self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj
        return (first, self.kv_a_proj_with_mqa) + ((self.indexer.wk,) if hasattr(self, "indexer") else ())

    def query(self, x: torch.Tensor, norm: Callable = rms_norm,
              projected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [B, T, H, dn], q_pe [B, T, H, dr], q-LoRA latent or x for the indexer); norm: the
        q-LoRA RMSNorm's op (`DecodeOps.rms_norm` on the serving path); projected: q_a's (or q's) output of x
        when computed already."""
        B, T, _ = x.shape
        if hasattr(self, "q_a_proj"):
            latent = self.q_a_layernorm(self.q_a_proj(x) if projected is None else projected, norm)
            q = self.q_b_proj(latent)
        else:
            latent, q = x, self.q_proj(x) if projected is None else projected
        q = q.view(B, T, self.num_heads, self.nope + self.rope)
        return q[..., : self.nope], q[..., self.nope :], latent

    def latent(self, x: torch.Tensor, norm: Callable = rms_norm,
               projected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds per token: (normed latent c [B, T, L], k_pe [B, T, dr]); projected: kv_a's
        output of x when computed already."""
        kv = self.kv_a_proj_with_mqa(x) if projected is None else projected
        c, k_pe = kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank :]
        return self.kv_a_layernorm(c, norm), k_pe

    def forward(self, x: torch.Tensor, ctx: ForwardBatch | CacheRoundTrip | None = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]. Full sequence from scratch, or (ctx a ForwardBatch) packed serving tokens.

        With a CacheRoundTrip the full-sequence form reads latents and index keys as the cache would
        return them, which makes it the oracle of the serving path for lossy cache dtypes. With a
        TrainContext, the training form (`kimiserve.model.training`).
        """
        if isinstance(ctx, ForwardBatch):
            return self.forward_paged(x, ctx)
        if isinstance(ctx, TrainContext):
            return mla_train_forward(self, x, ctx)
        B, T, _ = x.shape
        q_nope, q_pe, q_latent = self.query(x)
        c, k_pe = self.latent(x)
        keys = self.indexer.keys(x) if hasattr(self, "indexer") else None
        if ctx is not None:
            latent = roundtrip_latent(torch.cat([c, k_pe], dim=-1), ctx.kv_cache_dtype, ctx.latent_scale(self.cache_index))
            c, k_pe = latent[..., : self.kv_lora_rank], latent[..., self.kv_lora_rank :]
            if keys is not None:
                keys = roundtrip_index_key(keys, ctx.kv_cache_dtype, ctx.rotates_index_keys)
        positions = torch.arange(T, device=x.device)
        if keys is not None:
            mask = selection_mask(self.indexer.select(x, q_latent, keys, positions), T)
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, T, T)
        w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope)
        o = mla_absorbed(q_nope, q_pe, c, k_pe, w_kc, w_vc, self.scale, mask).reshape(B, T, -1)
        return self.output(x, o)

    def output(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None = None,
               gating: Callable | None = None) -> torch.Tensor:
        """o_proj of the attention output o (in x's dtype, or with `gating`, `DecodeOps.gate_output`, any float
        dtype), times the output gate sigmoid(g_proj(x)) first (gate: g_proj's output of x when computed already)."""
        if hasattr(self, "g_proj") and gate is None:
            gate = self.g_proj(x)
        if gating is not None:
            return self.o_proj(gating(o, gate, x.dtype))
        return self.o_proj(o if gate is None else o * torch.sigmoid(gate))

    def forward_paged(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Packed tokens x [1, N, d] of several sequences: write their latents and index keys to the
        cache, then attend over each sequence's cached context. One-token sequences run batched
        through the paged decode ops; a longer chunk runs through their prefill forms (`attend_chunk`)
        when `ops.prefill_in_place` (the kernels read the pages in place), else by gathering its
        context into the masked full-sequence form (the reference)."""
        if batch.pcp is not None:
            return self.forward_token_sharded(x, batch)
        layer, pool, ops = self.cache_index, batch.pool, batch.ops
        N, L = x.shape[1], self.kv_lora_rank
        # the projections of x through `ops.linears` (one GEMM on request)
        reads = self.input_projections() + ((self.g_proj,) if hasattr(self, "g_proj") else ())
        projected = ops.linears(x, reads)
        gate = projected[-1] if hasattr(self, "g_proj") else None
        q_nope, q_pe, q_latent = self.query(x, ops.rms_norm, projected[0])
        c, k_pe = self.latent(x, ops.rms_norm, projected[1])
        keys = self.indexer.keys_from_projection(projected[2], ops.layer_norm)[0] if hasattr(self, "indexer") else None
        latent_rows = torch.cat([c, k_pe], dim=-1)[0]
        if batch.write_rows is not None:  # DCP: this rank stores only the tokens it owns
            latent_rows = latent_rows[batch.write_rows]
            keys = keys[batch.write_rows] if keys is not None else None
        pool.write_mla(layer, batch.write_pages, batch.write_offsets, latent_rows, keys, ops.write_mla_tokens)
        w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope)
        if batch.decode_only:  # the rows themselves, no gather or scatter
            o = self.attend_pages(x[0], q_nope[0], q_pe[0], q_latent[0], w_kc, w_vc, batch.decode_block_tables,
                                  batch.decode_context_lens, batch.decode_max_context, batch)
            return self.output(x, o.reshape(1, N, -1), gate, ops.gate_output)
        o = x.new_empty(1, N, self.num_heads, self.v_dim)
        rows = batch.decode_rows
        if rows.numel():
            o[0, rows] = self.attend_pages(x[0, rows], q_nope[0, rows], q_pe[0, rows], q_latent[0, rows], w_kc, w_vc,
                                           batch.decode_block_tables, batch.decode_context_lens,
                                           batch.decode_max_context, batch).to(o.dtype)
        rows = batch.verify_rows
        if rows is not None:
            o[0, rows] = self.attend_pages(x[0, rows], q_nope[0, rows], q_pe[0, rows], q_latent[0, rows], w_kc, w_vc,
                                           batch.verify_block_tables, batch.verify_context_lens,
                                           batch.verify_max_context, batch).to(o.dtype)
        for chunk in batch.prefill_chunks:
            if chunk.verify:
                continue
            S = chunk.context_end
            if ops.prefill_in_place and batch.dcp is None:
                span = slice(chunk.start, chunk.end)
                o[0, span] = self.attend_chunk(x[0, span], q_nope[0, span], q_pe[0, span], q_latent[0, span], w_kc,
                                               w_vc, chunk, batch)
                continue
            if batch.dcp is not None:  # DCP: no rank holds a whole context
                table = chunk.block_table.to(x.device).unsqueeze(0)
                step = max(1, PREFILL_SCORE_BYTES // (4 * S))  # bounds the [rows, S] fp32 score buffer
                for lo in range(chunk.start, chunk.end, step):
                    r = slice(lo, min(chunk.end, lo + step))
                    n = r.stop - r.start
                    o[0, r] = self.attend_pages(x[0, r], q_nope[0, r], q_pe[0, r], q_latent[0, r], w_kc, w_vc,
                                                table.expand(n, -1), batch.positions[r] + 1, S, batch).to(o.dtype)
                continue
            span = slice(chunk.start, chunk.end)
            ctx_pos = torch.arange(S, device=x.device)
            pages = chunk.block_table.to(x.device)[ctx_pos // pool.block_size]
            offsets = ctx_pos % pool.block_size
            latent = pool.read_latents(layer, pages, offsets, x.dtype).unsqueeze(0)
            positions = batch.positions[span]
            if keys is not None:
                cached_keys = pool.read_index_keys(layer, pages, offsets, x.dtype).unsqueeze(0)
                mask = selection_mask(self.indexer.select(x[:, span], q_latent[:, span], cached_keys, positions), S)
            else:
                mask = (ctx_pos.unsqueeze(0) <= positions.unsqueeze(1)).unsqueeze(0)
            o[:, span] = mla_absorbed(
                q_nope[:, span], q_pe[:, span], latent[..., :L], latent[..., L:], w_kc, w_vc, self.scale, mask
            )
        return self.output(x, o.reshape(1, N, -1), gate, ops.gate_output)

    def attend_chunk(self, x, q_nope, q_pe, q_latent, w_kc, w_vc, chunk, batch: ForwardBatch) -> torch.Tensor:
        """A prefill chunk's rows [n, ...] (of one sequence, at positions batch.positions[chunk rows]) attend
        over the cached tokens up to each row's own through the paged ops, reading the pages in place.
        The query's absorption into latent space and the output's projection back run as one batched
        matmul each over the whole chunk in the model dtype (tensor cores; the sparse kernel rounds its
        query operand to that dtype anyway); the index scan (`ops.prefill_indexer_scores`), top-k and
        sparse MLA (`ops.sparse_mla_prefill`) run in row steps that bound the [rows, context] fp32 score
        buffer; dense MLA where no row sees more tokens than the indexer keeps. Returns [n, H, v_dim]."""
        layer, pool, ops = self.cache_index, batch.pool, batch.ops
        n, S, dt = x.shape[0], chunk.context_end, x.dtype
        table = chunk.block_table.to(x.device)
        lens = batch.positions[chunk.start : chunk.end] + 1
        q_abs = torch.matmul(q_nope.transpose(0, 1), w_kc.to(dt)).transpose(0, 1)  # [n, H, L]
        latent_scale = latent_scale_of(pool.kv_cache_dtype, pool.latent_scales[layer])
        sparse = hasattr(self, "indexer") and S > self.indexer.topk
        if sparse:
            iq, iw = self.indexer.queries(x.unsqueeze(0), q_latent.unsqueeze(0))
            iq, iw = iq[0], iw[0]
            key_scales = pool.index_scale[layer] if pool.index_scale else None
        out = x.new_empty(n, self.num_heads, self.kv_lora_rank)
        step = max(1, PREFILL_SCORE_BYTES // (4 * S))  # bounds the [rows, S] fp32 score buffer
        for lo in range(0, n, step):
            r = slice(lo, min(n, lo + step))
            if sparse:
                scores = ops.prefill_indexer_scores(iq[r], iw[r], pool.index_key[layer], key_scales, table, lens[r], dt,
                                                    S, rotation=pool.index_rotation)
                idx = ops.topk(scores, self.indexer.topk, lens[r])
                ops.sparse_mla_prefill(q_abs[r], q_pe[r], pool.latent[layer], latent_scale, table, idx, self.scale, dt,
                                       out=out[r])
            else:
                out[r] = ops.dense_mla_decode(q_abs[r], q_pe[r], pool.latent[layer], latent_scale,
                                              table.expand(r.stop - r.start, -1), lens[r], self.scale, dt, S)
        return torch.matmul(out.transpose(0, 1), w_vc.transpose(1, 2).to(dt)).transpose(0, 1)

    def forward_token_sharded(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`forward_paged` for this rank's share x [1, T_r, d] of a token-sharded prefill chunk
        (`batch.pcp`): one all-gather gives every rank the chunk's latents and index keys, every rank
        writes all of them to its pages (each rank's pool holds every token), then this rank's queries
        attend over the cached tokens before them read back from the pool, as the one-rank prefill does
        (`distributed.prefill_cp.mla_prefill_cp`: the indexer's exact top-k, sparse MLA)."""
        from kimiserve.distributed.prefill_cp import PrefillShard, gather_chunks, mla_prefill_cp

        layer, pool, ops, shard = self.cache_index, batch.pool, batch.ops, batch.pcp
        chunk = batch.chunks[0]
        q_nope, q_pe, q_latent = self.query(x)
        c, k_pe = self.latent(x)
        latent = torch.cat([c, k_pe], dim=-1)
        indexer = getattr(self, "indexer", None)
        keys = indexer.keys(x) if indexer is not None else None
        width = latent.shape[-1]
        rows = gather_chunks(torch.cat([latent, keys.to(latent.dtype)], dim=-1) if keys is not None else latent,
                             shard, "mla_tokens")[0]
        table = chunk.block_table.to(x.device)
        positions = torch.arange(shard.bounds[0], shard.bounds[-1], device=x.device)
        if batch.dcp is None:
            pool.write_mla(layer, table[positions // pool.block_size], positions % pool.block_size, rows[:, :width],
                           rows[:, width:] if keys is not None else None, ops.write_mla_tokens)
            ctx = torch.arange(shard.end, device=x.device)  # every token up to this rank's last query
            pages, offsets = table[ctx // pool.block_size], ctx % pool.block_size
            cached = pool.read_latents(layer, pages, offsets, x.dtype).unsqueeze(0)
            cached_keys = (pool.read_index_keys(layer, pages, offsets, x.dtype).unsqueeze(0)
                           if keys is not None else None)
        else:
            cached, cached_keys = self._token_sharded_dcp_context(rows, width, positions, table, batch)
        mine = PrefillShard((shard.start, shard.end))  # the attention of this rank's queries alone
        iq = iw = None
        if indexer is not None:
            iq, iw = indexer.queries(x, q_latent)
        w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope)
        res = mla_prefill_cp(q_nope, q_pe, cached[:, shard.start:], w_kc, w_vc, self.scale, mine,
                             index_keys=None if cached_keys is None else cached_keys[:, shard.start:],
                             index_q=iq, index_w=iw, topk=indexer.topk if indexer is not None else None,
                             context_latent=cached[:, :shard.start],
                             context_keys=None if cached_keys is None else cached_keys[:, :shard.start])
        return self.output(x, res.o.reshape(1, x.shape[1], -1))

    def _token_sharded_dcp_context(self, rows, width, positions, table, batch: ForwardBatch):
        """Token-sharded prefill under DCP: this rank stores only the chunk tokens its DCP rank owns; the
        attention context is the cached tokens before the chunk (each DCP rank reads its share, one
        all-gather reassembles them in position order) followed by the gathered chunk tokens as the
        cache returns them (the format's round trip, per token)."""
        from kimiserve.cache.formats import roundtrip_index_key, roundtrip_latent
        from kimiserve.distributed.dcp import dcp_global_position, dcp_local_count

        layer, pool, ops, dcp, shard = self.cache_index, batch.pool, batch.ops, batch.dcp, batch.pcp
        bs, D = pool.block_size, dcp.size
        mine = (positions // bs) % D == dcp.rank
        own = positions[mine]
        keys = rows[:, width:] if rows.shape[1] > width else None
        pool.write_mla(layer, table[own // (bs * D)], own % bs, rows[mine, :width],
                       keys[mine] if keys is not None else None, ops.write_mla_tokens)
        lat = roundtrip_latent(rows[:, :width], pool.kv_cache_dtype, pool.latent_scales[layer])
        if keys is not None:
            keys = roundtrip_index_key(keys, pool.kv_cache_dtype, pool.layout.index_key_rotation)
        b0 = shard.bounds[0]
        dev, dt = rows.device, rows.dtype
        context = torch.zeros(b0, rows.shape[1], dtype=dt, device=dev)
        if b0:
            n_local = dcp_local_count(b0, dcp.rank, bs, D)
            local = torch.arange(n_local, device=dev)
            pages, offsets = table[local // bs], local % bs
            part = pool.read_latents(layer, pages, offsets, dt)
            if keys is not None:
                part = torch.cat([part, pool.read_index_keys(layer, pages, offsets, dt)], dim=-1)
            width_max = dcp_local_count(b0, 0, bs, D)  # rank 0 holds the most
            padded = torch.cat([part, part.new_zeros(width_max - n_local, part.shape[1])])
            import torch.distributed as dist

            parts = [torch.empty_like(padded) for _ in range(D)]
            dist.all_gather(parts, padded.contiguous(), group=dcp.group)
            for r, got in enumerate(parts):
                n = dcp_local_count(b0, r, bs, D)
                context[dcp_global_position(torch.arange(n, device=dev), r, bs, D)] = got[:n]
        chunk_rows = torch.cat([lat, keys], dim=-1) if keys is not None else lat
        full = torch.cat([context, chunk_rows])[: shard.end].unsqueeze(0)
        return full[..., :width], (full[..., width:] if keys is not None else None)

    def attend_pages(self, x, q_nope, q_pe, q_latent, w_kc, w_vc, tables, lens, max_context: int,
                     batch: ForwardBatch) -> torch.Tensor:
        """Query rows [n, ...] (row i at position lens[i] - 1 of the sequence with page table tables[i])
        attend over the cached tokens before them through the paged decode ops: the index scan, top-k
        and sparse MLA; or dense MLA without an indexer, and where no row sees more tokens than the
        indexer keeps (max_context <= top-k: it would select them all). Returns [n, H, v_dim] in the
        compute dtype."""
        layer, pool, ops = self.cache_index, batch.pool, batch.ops
        q_abs = ops.head_matmul(q_nope, w_kc)
        if batch.dcp is not None:  # each rank holds a share of the tokens: exact top-k merge + LSE merge
            from kimiserve.distributed.dcp import dcp_sparse_decode

            iq = iw = None
            if hasattr(self, "indexer"):
                iq, iw = self.indexer.queries(x.unsqueeze(0), q_latent.unsqueeze(0))
                iq, iw = iq[0], iw[0]
            out = dcp_sparse_decode(q_abs, q_pe, iq, iw, pool, layer, tables, lens, max_context,
                                    self.indexer.topk if hasattr(self, "indexer") else None, self.scale, x.dtype,
                                    batch.dcp, pool.block_size, indexer_scores=ops.indexer_scores, topk_op=ops.topk)
            return ops.head_matmul(out, w_vc.transpose(1, 2))
        latent_scale = latent_scale_of(pool.kv_cache_dtype, pool.latent_scales[layer])
        if hasattr(self, "indexer") and max_context > self.indexer.topk:
            iq, iw = self.indexer.queries(x.unsqueeze(0), q_latent.unsqueeze(0))
            scales = pool.index_scale[layer] if pool.index_scale else None
            # keys stored rotated (pool.index_rotation, else None): the scan rotates the query, q.k = (qH).(kH)
            scores = ops.indexer_scores(iq[0], iw[0], pool.index_key[layer], scales, tables, lens, x.dtype, max_context,
                                        rotation=pool.index_rotation)
            idx = ops.topk(scores, self.indexer.topk, lens)
            out = ops.sparse_mla_decode(q_abs, q_pe, pool.latent[layer], latent_scale, tables, idx, self.scale, x.dtype)
        else:
            out = ops.dense_mla_decode(q_abs, q_pe, pool.latent[layer], latent_scale, tables, lens, self.scale, x.dtype,
                                       max_context)
        return ops.head_matmul(out, w_vc.transpose(1, 2))
