"""Multi-head latent attention with the K3.1 lightning indexer (full-sequence form)."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.config import ModelConfig
from kimiserve.model.layers import Linear, RMSNorm, Weights
from kimiserve.ops.indexer.reference import indexer_scores
from kimiserve.ops.mla.reference import mla_absorbed, split_kv_b
from kimiserve.ops.norm.reference import layer_norm
from kimiserve.ops.topk.reference import causal_topk, selection_mask

# HF builds q_a_layernorm / kv_a_layernorm with KimiRMSNorm's default eps, not rms_norm_eps
LORA_NORM_EPS = 1e-6
INDEX_KEY_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """Scores earlier tokens for each query: sum_h w_h ReLU(q_h . k_s) (DeepSeek-V3.2 DSA, no rope).

    The index query comes from the q-LoRA latent (from the hidden state when there is no q-LoRA),
    the index key from the hidden state through a LayerNorm, the head weights from the hidden state.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d, Hi, D = config.hidden_size, config.index_n_heads, config.index_head_dim
        self.num_heads, self.head_dim, self.topk = Hi, D, config.index_topk
        self.wq_b = Linear(config.q_lora_rank or d, Hi * D, dtype)
        self.wk = Linear(d, D, dtype)
        self.k_norm = Weights(D, dtype=dtype, bias=True)  # LayerNorm
        self.weights_proj = Linear(d, Hi, dtype)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """One index key per token: [B, T, D]."""
        return layer_norm(self.wk(x), self.k_norm.weight, self.k_norm.bias, INDEX_KEY_NORM_EPS)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [B, T, Hi, D], head weights [B, T, Hi] with both scales folded in)."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.num_heads, self.head_dim)
        w = self.weights_proj(x).float() * (self.num_heads ** -0.5 * self.head_dim ** -0.5)
        return q, w

    def select(self, x: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
        """Top-k token indices per query over the causal prefix: [B, T, topk], -1 padded."""
        q, w = self.queries(x, q_latent)
        scores = indexer_scores(q, self.keys(x), w)
        return causal_topk(scores, torch.arange(x.shape[1], device=x.device), self.topk)


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.qk_head_dim ** -0.5
        if config.q_lora_rank is not None:
            self.q_a_proj = Linear(d, config.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = Linear(config.q_lora_rank, H * config.qk_head_dim, dtype)
        else:
            self.q_proj = Linear(d, H * config.qk_head_dim, dtype)
        self.kv_a_proj_with_mqa = Linear(d, config.kv_latent_dim, dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), dtype)
        self.o_proj = Linear(H * self.v_dim, d, dtype)
        if config.mla_use_output_gate:
            self.g_proj = Linear(d, H * self.v_dim, dtype)
        if config.has_indexer:
            self.indexer = Indexer(config, dtype)

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [B, T, H, dn], q_pe [B, T, H, dr], q-LoRA latent or x for the indexer)."""
        B, T, _ = x.shape
        if hasattr(self, "q_a_proj"):
            latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(latent)
        else:
            latent, q = x, self.q_proj(x)
        q = q.view(B, T, self.num_heads, self.nope + self.rope)
        return q[..., : self.nope], q[..., self.nope :], latent

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds per token: (normed latent c [B, T, L], k_pe [B, T, dr])."""
        kv = self.kv_a_proj_with_mqa(x)
        c, k_pe = kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank :]
        return self.kv_a_layernorm(c), k_pe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_pe, q_latent = self.query(x)
        c, k_pe = self.latent(x)
        if hasattr(self, "indexer"):
            mask = selection_mask(self.indexer.select(x, q_latent), T)
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, T, T)
        w_kc, w_vc = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope)
        o = mla_absorbed(q_nope, q_pe, c, k_pe, w_kc, w_vc, self.scale, mask).reshape(B, T, -1)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)
