"""Kimi Delta Attention layer (full-sequence form)."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.config import ModelConfig
from kimiserve.model.layers import Linear, Weights, default_weight_loader, make_param
from kimiserve.ops.conv.reference import causal_conv1d
from kimiserve.ops.kda.reference import chunk_kda, kda_gate
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
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d], from a zero state."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        heads = lambda t: t.view(B, T, H, K)
        q, _ = causal_conv1d(self.q_proj(x), self.q_conv1d.weight)
        k, _ = causal_conv1d(self.k_proj(x), self.k_conv1d.weight)
        v, _ = causal_conv1d(self.v_proj(x), self.v_conv1d.weight)
        q, k, v = l2_normalize(heads(q)), l2_normalize(heads(k)), heads(v)
        g = kda_gate(heads(self.f_b_proj(self.f_a_proj(x))), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        o, _ = chunk_kda(q, k, v, g, beta)
        o = gated_rms_norm(o, heads(self.output_gate(x)), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(B, T, H * K))

