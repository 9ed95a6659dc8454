"""The batch-invariant forward of a `KimiForCausalLM`: the same weights and math as the model's own
forward, but every op from `kimiserve.ops.batch_invariant.reference`, every token computed as a row
of its own, so a token's logits are bit-identical whatever else runs with it.

One forward serves both sides of RL:

- the engine (`PagedContext`, `--batch-invariant`): the packed tokens of a serving step, MLA latents
  and index keys written to and read back from the page pool, KDA states from the state pages;
- the trainer (`SequenceContext`, `kimiserve.rl.trainer`): whole (prompt + completion) sequences with
  autograd, latents and index keys put through the cache format's round trip as the pool would return
  them, KDA from a zero state.

Both reduce to the same per-token computation:
- each MLA query reads its sequence's context positions 0..p as the cache returns them; the indexer
  scores them (tree sums), keeps the top-k (ties to the earlier token, the list in position order) and
  the absorbed attention runs over that list (`sparse_latent_attention`), whatever the chunk;
- KDA runs the recurrent form one token at a time in both prefill and decode (the chunked form gives
  other bits), the short conv as a 4-tap tree sum from the conv state; a prompt snapshot is the state
  before the last token, as the default path keeps it;
- routed experts run per (token, slot) pair (grouped by expert) and are combined over the token's slots
  in slot order.

`lora` (a `kimiserve.lora.LoRABatch`, or None) adds each row's adapter to the projections it covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kimiserve.cache import formats
from kimiserve.model.batch import ForwardBatch
from kimiserve.model.mla import INDEX_KEY_NORM_EPS, MLAAttention
from kimiserve.model.model import KimiForCausalLM
from kimiserve.ops.batch_invariant import reference as bi
from kimiserve.ops.mla.reference import split_kv_b
from kimiserve.ops.quant.reference import hadamard

ATTENTION_CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 28}
"""MLA query rows are attended in groups whose [rows, heads, context, width] products stay about this
size (per device type; others use the CPU's)."""


@dataclass
class Segment:
    """One sequence's rows [start, end) of the packed batch, the first at position `context_start`."""

    start: int
    end: int
    context_start: int

    @property
    def length(self) -> int:
        return self.end - self.start


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x @ matrix (the symmetric Hadamard rotation) as a batch-invariant product, in fp32."""
    return bi.linear(x.float(), matrix.float())


class SequenceContext:
    """Whole sequences from position 0 (the trainer): latents and index keys through the cache
    format's round trip (`formats`, with the pool's latent scales), KDA from zero states."""

    def __init__(self, lengths: list[int], device, kv_cache_dtype: str = "bf16",
                 latent_scales: list[float] | None = None, index_key_rotation: bool | None = None):
        formats.check_kv_cache_dtype(kv_cache_dtype)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        self.segments = [Segment(a, b, 0) for a, b in zip(starts, starts[1:])]
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        self.row_start = torch.cat([torch.full((n,), a, dtype=torch.int64) for a, n in zip(starts, lengths)]).to(device)
        self.kv_cache_dtype, self.latent_scales = kv_cache_dtype, latent_scales
        self.rotates = formats.rotates_index_keys(kv_cache_dtype, index_key_rotation)
        self.device = device
        self._latents: dict[int, torch.Tensor] = {}
        self._keys: dict[int, torch.Tensor | None] = {}

    def store_mla(self, layer: int, latent_rows: torch.Tensor, keys: torch.Tensor | None) -> None:
        scale = self.latent_scales[layer] if self.latent_scales else 1.0
        fmt = self.kv_cache_dtype
        self._latents[layer] = straight_through(latent_rows, lambda t: formats.roundtrip_latent(t, fmt, scale))
        self._keys[layer] = None if keys is None else straight_through(keys, self._roundtrip_key)

    def _roundtrip_key(self, keys: torch.Tensor) -> torch.Tensor:
        fmt = self.kv_cache_dtype
        if not self.rotates:
            codes, scales = formats.store_index_key(keys, fmt)
            return formats.load_index_key(codes, scales, fmt, torch.float32, keys.shape[-1]).to(keys.dtype)
        h = hadamard(keys.shape[-1], torch.float32, keys.device)
        codes, scales = formats.store_index_key(rotate(keys, h), fmt)
        back = formats.load_index_key(codes, scales, fmt, torch.float32, keys.shape[-1])
        return rotate(back, h).to(keys.dtype)

    def read_mla(self, layer: int, rows: torch.Tensor):
        pos = self.positions[rows]
        S = int(pos.max()) + 1
        ctx = torch.minimum(torch.arange(S, device=self.device).unsqueeze(0), pos.unsqueeze(1))
        idx = self.row_start[rows].unsqueeze(1) + ctx
        keys = self._keys[layer]
        return self._latents[layer][idx], (keys[idx] if keys is not None else None), pos + 1

    def kda_initial(self, layer: int, num_heads: int, head_dim: int, conv_width: int, dtype):
        B = len(self.segments)
        conv = torch.zeros(B, 3, num_heads * head_dim, conv_width - 1, device=self.device)
        state = torch.zeros(B, num_heads, head_dim, head_dim, device=self.device)
        return conv, state

    def kda_snapshot_row(self, j: int) -> int | None:
        return None

    def kda_snapshot(self, layer: int, j: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        pass

    def kda_final(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        pass


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, fn) -> torch.Tensor:
    """fn(x) in value (bit for bit); the gradient passes through unchanged (the cache round trip's estimator)."""
    return _StraightThrough.apply(x, fn)


class PagedContext:
    """A serving step (`ForwardBatch`): rows' latents and index keys written to their page slots, each
    query's context read back from the pool; KDA states read from and written to the state pages."""

    def __init__(self, batch: ForwardBatch):
        self.batch, self.pool = batch, batch.pool
        self.segments = [Segment(c.start, c.end, c.context_start) for c in batch.chunks]
        self.positions = batch.positions
        device = batch.positions.device
        self.device = device
        n = int(batch.positions.numel())
        seg = torch.zeros(n, dtype=torch.int64)
        for j, c in enumerate(batch.chunks):
            seg[c.start : c.end] = j
        self.row_segment = seg.to(device)
        width = max(len(c.block_table) for c in batch.chunks)
        tables = torch.zeros(len(batch.chunks), width, dtype=torch.int64, device=device)
        for j, c in enumerate(batch.chunks):
            tables[j, : len(c.block_table)] = c.block_table
        self.tables = tables

    def store_mla(self, layer: int, latent_rows: torch.Tensor, keys: torch.Tensor | None) -> None:
        pool = self.pool
        if keys is not None and pool.layout.index_key_rotation:
            keys = rotate(keys, pool.index_rotation)
        self.batch.ops.write_mla_tokens(
            pool.latent[layer], pool.index_key[layer] if pool.index_key else None,
            pool.index_scale[layer] if pool.index_scale else None, self.batch.write_pages, self.batch.write_offsets,
            latent_rows, keys, pool.kv_cache_dtype, pool.latent_scales[layer])

    def read_mla(self, layer: int, rows: torch.Tensor):
        pool, bs = self.pool, self.pool.block_size
        pos = self.positions[rows]
        S = int(pos.max()) + 1
        ctx = torch.minimum(torch.arange(S, device=self.device).unsqueeze(0), pos.unsqueeze(1))
        tables = self.tables[self.row_segment[rows]]
        pages, offsets = torch.gather(tables, 1, ctx // bs), ctx % bs
        latents = pool.read_latents(layer, pages, offsets, torch.float32)
        keys = None
        if pool.index_key:
            scales = pool.index_scale[layer][pages, offsets] if pool.index_scale else None
            keys = formats.load_index_key(pool.index_key[layer][pages, offsets], scales, pool.kv_cache_dtype,
                                          torch.float32, pool.layout.index_dim)
            if pool.layout.index_key_rotation:
                keys = rotate(keys, pool.index_rotation)
        return latents, keys, pos + 1

    def kda_initial(self, layer: int, num_heads: int, head_dim: int, conv_width: int, dtype):
        pages = torch.stack([c.state_pages[layer] for c in self.batch.chunks])
        return self.pool.conv[pages].float(), self.pool.recurrent[pages].float()

    def kda_snapshot_row(self, j: int) -> int | None:
        c = self.batch.chunks[j]
        return None if c.snapshot_state_pages is None or c.num_tokens < 2 else c.num_tokens - 1

    def kda_snapshot(self, layer: int, j: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        page = self.batch.chunks[j].snapshot_state_pages[layer]
        self.pool.conv[page] = conv.to(self.pool.conv.dtype)
        self.pool.recurrent[page] = state

    def kda_final(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        pages = torch.stack([c.state_pages[layer] for c in self.batch.chunks])
        self.pool.conv[pages] = conv.to(self.pool.conv.dtype)
        self.pool.recurrent[pages] = state


def check_supported(model: KimiForCausalLM) -> None:
    """ValueError for what the batch-invariant forward does not cover."""
    p = model.parallel
    if p.tp_size > 1 or p.ep_size > 1 or p.dcp_size > 1 or p.pcp_size > 1:
        raise ValueError("batch_invariant runs one process: use tensor_parallel_size 1, no expert, decode or "
                         "prefill context parallelism")
    c = model.config
    if c.num_expert_group > 1 and c.topk_group < c.num_expert_group:
        raise ValueError("batch_invariant does not support grouped expert routing (num_expert_group > 1)")


class InvariantForward:
    """The batch-invariant forward over a model's own parameters (see the module doc)."""

    def __init__(self, model: KimiForCausalLM):
        check_supported(model)
        self.model, self.config = model, model.config
        self.names = {id(m): name for name, m in model.named_modules()}
        self.lora = None

    # entry points ------------------------------------------------------------------------------
    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, logits_rows: torch.Tensor,
                      lora=None) -> torch.Tensor:
        """The engine's step: packed ids [N] through the pool -> fp32 logits of `logits_rows`."""
        h = self.hidden(input_ids, PagedContext(batch), lora)
        return self.logits(h[logits_rows], lora, logits_rows)

    def sequences(self, sequences: list[list[int]], kv_cache_dtype: str = "bf16", latent_scales=None,
                  index_key_rotation: bool | None = None, lora=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Whole sequences (autograd) -> fp32 logits of the packed rows `rows` (default: every row, the
        sequences' tokens one after the other) [rows, vocab]."""
        device = self.model.lm_head_weight.device
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
        self.model.check_ids(ids)
        ctx = SequenceContext([len(s) for s in sequences], device, kv_cache_dtype, latent_scales, index_key_rotation)
        h = self.hidden(ids, ctx, lora)
        return self.logits(h if rows is None else h[rows], lora, rows)

    # the stack ---------------------------------------------------------------------------------
    def hidden(self, ids: torch.Tensor, ctx, lora=None) -> torch.Tensor:
        m = self.model.model
        self.lora = lora
        h = F.embedding(ids, m.embed_tokens.weight)
        if self.config.attn_res_block_size is None:
            for layer in m.layers:
                x = h + self.attention(layer.self_attn, self.norm(layer.input_layernorm, h), ctx)
                h = x + self.ffn(layer, self.norm(layer.post_attention_layernorm, x))
        else:
            blocks: list[torch.Tensor] = []
            for layer in m.layers:
                h, blocks = self.attn_res_layer(layer, h, blocks, ctx)
            h = bi.attn_res_read(h, blocks, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight,
                                 self.config.rms_norm_eps)
        return self.norm(m.norm, h)

    def logits(self, h: torch.Tensor, lora=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        return bi.linear(h, self.model.lm_head_weight).float()

    def attn_res_layer(self, layer, running, blocks, ctx):
        eps = self.config.rms_norm_eps
        x = (bi.attn_res_read(running, blocks, layer.self_attention_res_norm.weight,
                              layer.self_attention_res_proj.weight, eps) if blocks else running)
        live = running
        if layer.layer % layer.block_size == 0:
            blocks, live = [*blocks, running], None
        a = self.attention(layer.self_attn, self.norm(layer.input_layernorm, x), ctx)
        live = a if live is None else live + a
        x = bi.attn_res_read(live, blocks, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
        return live + self.ffn(layer, self.norm(layer.post_attention_layernorm, x)), blocks

    # pieces ------------------------------------------------------------------------------------
    @staticmethod
    def norm(module, x: torch.Tensor) -> torch.Tensor:
        return bi.rms_norm(x, module.weight, module.eps)

    def proj(self, module, x: torch.Tensor) -> torch.Tensor:
        y = bi.linear(x, module.weight)
        if self.lora is not None:
            y = self.lora.apply(self.names[id(module)], x, y)
        return y

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.hidden_act == "situ":
            return bi.situ_and_mul(gate, up, c.activation_situ_beta, c.activation_situ_linear_beta)
        return bi.silu_and_mul(gate, up)

    def attention(self, attn, x: torch.Tensor, ctx) -> torch.Tensor:
        return self.mla(attn, x, ctx) if isinstance(attn, MLAAttention) else self.kda(attn, x, ctx)

    def mla(self, a: MLAAttention, x: torch.Tensor, ctx) -> torch.Tensor:
        N, H, L = x.shape[0], a.num_heads, a.kv_lora_rank
        if hasattr(a, "q_a_proj"):
            q_latent = self.norm(a.q_a_layernorm, self.proj(a.q_a_proj, x))
            q = self.proj(a.q_b_proj, q_latent)
        else:
            q_latent, q = x, self.proj(a.q_proj, x)
        q = q.view(N, H, a.nope + a.rope)
        q_nope, q_pe = q[..., : a.nope], q[..., a.nope :]
        kv = self.proj(a.kv_a_proj_with_mqa, x)
        latent_rows = torch.cat([self.norm(a.kv_a_layernorm, kv[:, :L]), kv[:, L:]], dim=-1)
        indexer = getattr(a, "indexer", None)
        keys = iq = iw = None
        if indexer is not None:
            keys = bi.layer_norm(self.proj(indexer.wk, x), indexer.k_norm.weight, indexer.k_norm.bias,
                                 INDEX_KEY_NORM_EPS)
            iq = self.proj(indexer.wq_b, q_latent).view(N, indexer.num_heads, indexer.head_dim)
            iw = self.proj(indexer.weights_proj, x).float() * (indexer.num_heads ** -0.5 * indexer.head_dim ** -0.5)
        ctx.store_mla(a.cache_index, latent_rows, keys)
        w_kc, w_vc = split_kv_b(a.kv_b_proj.weight, H, a.nope)  # [H, dn, L], [H, dv, L]
        q_abs = bi.head_linear(q_nope, w_kc.transpose(1, 2))  # [N, H, L] fp32
        longest = int(ctx.positions.max()) + 1
        width = max(latent_rows.shape[-1] * H, indexer.num_heads * indexer.head_dim if indexer is not None else 0)
        budget = ATTENTION_CHUNK_ELEMENTS.get(x.device.type, ATTENTION_CHUNK_ELEMENTS["cpu"])
        group = max(1, budget // (longest * width))
        parts = []
        for lo in range(0, N, group):
            rows = torch.arange(lo, min(N, lo + group), device=x.device)
            latents, ctx_keys, lens = ctx.read_mla(a.cache_index, rows)
            S = latents.shape[1]
            if indexer is not None:
                listed = bi.indexer_topk(iq[rows], iw[rows], ctx_keys, lens, indexer.topk)
            else:
                listed = torch.arange(S, device=x.device).expand(len(rows), S)
                listed = torch.where(listed < lens.unsqueeze(1), listed, S)
            parts.append(bi.sparse_latent_attention(q_abs[rows], q_pe[rows], latents, listed, a.scale))
        out_latent = torch.cat(parts)  # [N, H, L]
        o = bi.head_linear(out_latent, w_vc).to(x.dtype).reshape(N, -1)  # [N, H * dv]
        if hasattr(a, "g_proj"):
            o = o * bi.sigmoid(self.proj(a.g_proj, x))
        return self.proj(a.o_proj, o)

    def kda(self, a, x: torch.Tensor, ctx) -> torch.Tensor:
        N, H, K = x.shape[0], a.num_heads, a.head_dim
        q, k, v = self.proj(a.q_proj, x), self.proj(a.k_proj, x), self.proj(a.v_proj, x)
        f = self.proj(a.f_b_proj, self.proj(a.f_a_proj, x)).view(N, H, K).float()
        decay = torch.exp(a.A_log.float()).view(H, 1)
        z = f + a.dt_bias.float().view(H, K)
        if a.lower_bound is not None:
            g = a.lower_bound * bi.sigmoid(decay * z)
        else:
            g = -decay * bi.softplus(z)
        beta = bi.sigmoid(self.proj(a.b_proj, x).float())
        o = self.kda_recurrence(a, torch.stack([q, k, v], 1).float(), g, beta, ctx).to(x.dtype)
        gate = self.proj(a.g_proj, x) if hasattr(a, "g_proj") else self.proj(a.g_b_proj, self.proj(a.g_a_proj, x))
        o = bi.gated_rms_norm(o, gate.view(N, H, K), a.o_norm.weight, a.eps)
        return self.proj(a.o_proj, o.reshape(N, H * K))

    def kda_recurrence(self, a, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx) -> torch.Tensor:
        """Token by token over every segment at once: short conv from the conv state, L2 norm, one
        delta-rule step. qkv [N, 3, P] fp32 (before the conv), g [N, H, K], beta [N, H] -> o [N, H, V]."""
        H, K, layer = a.num_heads, a.head_dim, a.cache_index
        conv_weight = torch.stack([a.q_conv1d.weight, a.k_conv1d.weight, a.v_conv1d.weight]).float()  # [3, P, W]
        conv, state = ctx.kda_initial(layer, H, K, conv_weight.shape[-1], qkv.dtype)
        segs = ctx.segments
        snap_at = [ctx.kda_snapshot_row(j) for j in range(len(segs))]
        starts = torch.tensor([s.start for s in segs], device=qkv.device)
        lengths = torch.tensor([s.length for s in segs], device=qkv.device)
        row_order, outs = [], []
        for t in range(int(lengths.max())):
            active = torch.nonzero(lengths > t)[:, 0]
            every = len(active) == len(segs)
            for j in range(len(segs)):
                if snap_at[j] == t:
                    ctx.kda_snapshot(layer, j, conv[j], state[j])
            rows = starts[active] + t
            conv_a = conv if every else conv[active]
            window = torch.cat([conv_a, qkv[rows].unsqueeze(-1)], dim=-1)
            y = bi.causal_conv_step(window, conv_weight)  # [A, 3, P]
            A = len(active)
            qh, kh = bi.l2_normalize(y[:, 0].view(A, H, K)), bi.l2_normalize(y[:, 1].view(A, H, K))
            o_t, new_state = bi.kda_step(qh, kh, y[:, 2].view(A, H, K), g[rows], beta[rows],
                                         state if every else state[active], K ** -0.5)
            new_conv = window[..., 1:]
            if every:
                conv, state = new_conv, new_state
            else:  # out of place: autograd keeps every step's state
                conv, state = conv.index_copy(0, active, new_conv), state.index_copy(0, active, new_state)
            row_order.append(rows)
            outs.append(o_t)
        ctx.kda_final(layer, conv, state)
        order = torch.argsort(torch.cat(row_order))
        return torch.cat(outs)[order]

    def ffn(self, layer, x: torch.Tensor) -> torch.Tensor:
        if hasattr(layer, "block_sparse_moe"):
            return self.moe(layer.block_sparse_moe, x)
        return self.mlp(layer.mlp, x)

    def mlp(self, m, x: torch.Tensor) -> torch.Tensor:
        return self.proj(m.down_proj, self.act(self.proj(m.gate_proj, x), self.proj(m.up_proj, x)))

    def moe(self, m, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        ids, weights = bi.route(bi.linear(x.float(), m.gate.weight), m.gate.e_score_correction_bias,
                                c.num_experts_per_token, score_func=c.moe_router_activation_func,
                                renormalize=c.moe_renormalize, scaling_factor=c.routed_scaling_factor)
        latent = hasattr(m, "routed_expert_down_proj")
        h = self.proj(m.routed_expert_down_proj, x) if latent else x
        y = self.experts(m.experts, h, ids, weights)
        if latent:
            if hasattr(m, "routed_expert_norm"):
                y = self.norm(m.routed_expert_norm, y)
            y = self.proj(m.routed_expert_up_proj, y)
        if hasattr(m, "shared_experts"):
            y = y + self.mlp(m.shared_experts, x)
        return y.to(x.dtype)

    def experts(self, experts, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair through its expert (rows grouped by expert), combined over the slots
        in slot order."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        xs = h.repeat_interleave(k, dim=0)

        def weight(name):
            return lambda e: experts.expert_weight(name, e).to(h.dtype)

        inter = self.config.moe_intermediate_size
        gate, up = bi.grouped_linear(xs, flat, weight("w1"), inter), bi.grouped_linear(xs, flat, weight("w3"), inter)
        lora = self.lora
        if lora is not None:
            base, slots = self.names[id(experts)], lora.row_slot.repeat_interleave(k)
            gate = lora.apply_experts(f"{base}.w1", xs, flat, slots, gate)
            up = lora.apply_experts(f"{base}.w3", xs, flat, slots, up)
        act = self.act(gate, up)
        y = bi.grouped_linear(act, flat, weight("w2"), h.shape[-1])
        if lora is not None:
            y = lora.apply_experts(f"{base}.w2", act, flat, slots, y)
        return bi.tree_sum(y.float().view(N, k, -1) * weights.float().unsqueeze(-1), 1).to(h.dtype)
