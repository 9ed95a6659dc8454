"""Kimi Delta Attention layer: full-sequence form and paged (serving) form with state pages."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.config import ModelConfig
from kimiserve.model.batch import ForwardBatch
from kimiserve.model.layers import Linear, Weights, default_weight_loader, make_param
from kimiserve.ops.conv.reference import causal_conv1d
from kimiserve.ops.kda.reference import chunk_kda, kda_gate, recurrent_kda
from kimiserve.ops.norm.reference import gated_rms_norm, l2_normalize


def load_a_log(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    """A_log ships as [H] (HF module), [1, 1, H, 1] (Kimi-Linear) or zero-padded 1-D (K3: [128] for H = 96)."""
    heads = param.shape[0]
    flat = loaded.reshape(-1)
    if loaded.dim() not in (1, 4) or flat.numel() < heads or (loaded.dim() == 4 and flat.numel() != heads):
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, the model expects ({heads},) or (1, 1, {heads}, 1)")
    if torch.any(flat[heads:] != 0):
        raise ValueError(f"tensor {name} has {flat.numel()} entries; past the first {heads} (heads) they must be zero padding")
    param.data.copy_(flat[:heads])


def load_conv(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    """Depthwise conv weights ship as nn.Conv1d's [C, 1, W]; kept as [C, W]."""
    default_weight_loader(param, loaded.squeeze(1) if loaded.dim() == 3 and loaded.shape[1] == 1 else loaded, name)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, cache_index: int = 0):
        super().__init__()
        self.cache_index = cache_index  # which KDA layer's state page of a sequence this is
        d, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        P = H * K
        self.num_heads, self.head_dim, self.eps = H, K, config.rms_norm_eps
        self.lower_bound = config.gate_lower_bound
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, P, dtype) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            Weights(P, config.kda_conv_size, dtype=torch.float32, loader=load_conv) for _ in range(3)
        )
        self.f_a_proj = Linear(d, K, dtype)
        self.f_b_proj = Linear(K, P, dtype)
        self.b_proj = Linear(d, H, dtype)
        self.A_log = make_param(H, dtype=torch.float32, loader=load_a_log)
        self.dt_bias = make_param(P, dtype=torch.float32)
        if config.kda_full_rank_output_gate:
            self.g_proj = Linear(d, P, dtype)
        else:
            self.g_a_proj = Linear(d, K, dtype)
            self.g_b_proj = Linear(K, P, dtype)
        self.o_norm = Weights(K, dtype=torch.float32)
        self.o_proj = Linear(P, d, dtype)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]: full sequences from a zero state, or (ctx a ForwardBatch) packed
        serving tokens continuing from each sequence's state page. Other contexts do not concern KDA."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        heads = lambda t: t.view(B, T, H, K)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        g = kda_gate(heads(self.f_b_proj(self.f_a_proj(x))), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if isinstance(ctx, ForwardBatch):
            o = self.paged_mix(q, k, v, g, beta, ctx)
        else:
            o, _, _ = self.mix(q, k, v, g, beta)
        o = gated_rms_norm(o, heads(self.output_gate(x)), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(B, T, H * K))

    def short_conv(self, q, k, v, conv_state=None):
        """Short conv over [B, T] tokens from conv_state [B, 3, P, W-1] (zeros when None). Returns
        (q, k [B, T, H, K] L2-normalised, v [B, T, H, V], new conv state)."""
        B, T, _ = q.shape
        heads = lambda t: t.view(B, T, self.num_heads, self.head_dim)
        cs = (None, None, None) if conv_state is None else conv_state.unbind(1)
        q, cq = causal_conv1d(q, self.q_conv1d.weight, cs[0])
        k, ck = causal_conv1d(k, self.k_conv1d.weight, cs[1])
        v, cv = causal_conv1d(v, self.v_conv1d.weight, cs[2])
        return l2_normalize(heads(q)), l2_normalize(heads(k)), heads(v), torch.stack([cq, ck, cv], dim=1)

    def mix(self, q, k, v, g, beta, conv_state=None, state=None, recurrent=False):
        """Short conv + delta rule over [B, T] tokens from (conv_state [B, 3, P, W-1], state [B, H, K, V])
        (zeros when None). Returns (o [B, T, H, V], new conv state, new recurrent state)."""
        q, k, v, conv = self.short_conv(q, k, v, conv_state)
        rule = recurrent_kda if recurrent else chunk_kda
        o, state = rule(q, k, v, g, beta, initial_state=state)
        return o, conv, state

    def paged_mix(self, q, k, v, g, beta, batch: ForwardBatch) -> torch.Tensor:
        """`mix` for packed tokens [1, N]: one-token sequences batched in recurrent form
        (`batch.ops.kda_decode`, updating their state pages in place), longer chunks together in
        varlen chunked form (`batch.ops.kda_prefill`); each reads and writes its state page of this
        layer. A chunk with snapshot pages also leaves the state before its last token there: its
        last token runs in a second varlen pass, from the snapshot."""
        pool, i, ops = batch.pool, self.cache_index, batch.ops
        o = v.new_empty(*v.shape[:2], self.num_heads, self.head_dim)
        rows = batch.decode_rows
        if rows.numel():
            pages = batch.decode_state_pages[:, i]
            one = lambda t: t[0, rows].unsqueeze(1)  # one-token rows become a batch of length-1 sequences
            qh, kh, vh, conv = self.short_conv(one(q), one(k), one(v), pool.conv[pages])
            pool.conv[pages] = conv
            o[0, rows] = ops.kda_decode(qh, kh, vh, one(g), one(beta), pool.recurrent, pages)[:, 0]
        chunks = batch.prefill_chunks
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

    def prefill_segments(self, q, k, v, g, beta, segments, o, pool, ops) -> None:
        """Packed rows [start, end) of each segment continue from the state pages `src` and leave
        their final state in `dst`: short conv per segment, then one varlen chunked-form call."""
        src = torch.stack([s for _, _, s, _ in segments])
        dst = torch.stack([d for _, _, _, d in segments])
        conv_in = pool.conv[src]
        parts = []
        for j, (start, end, _, _) in enumerate(segments):
            qh, kh, vh, conv = self.short_conv(q[:, start:end], k[:, start:end], v[:, start:end], conv_in[j : j + 1])
            pool.conv[dst[j : j + 1]] = conv
            parts.append((qh, kh, vh, g[:, start:end], beta[:, start:end]))
        lengths = [end - start for start, end, _, _ in segments]
        cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        packed = [torch.cat(t, dim=1) for t in zip(*parts)]
        out, states = ops.kda_prefill(*packed, pool.recurrent[src], cu_seqlens)
        pool.recurrent[dst] = states
        for (start, end, _, _), offset in zip(segments, cu_seqlens.tolist()):
            o[:, start:end] = out[:, offset : offset + end - start]
