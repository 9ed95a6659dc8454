"""Dense MLP, shared experts and the (latent) mixture of experts."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.config import ModelConfig
from kimiserve.model.layers import Linear, RMSNorm, make_param
from kimiserve.ops.activation.reference import silu_and_mul, situ_and_mul
from kimiserve.ops.moe.dispatch import fused_moe_for
from kimiserve.ops.moe.reference import experts_forward, route
from kimiserve.ops.quant.reference import MXFP4_GROUP, dequantize_mxfp4

# batches of up to this many tokens take the routing-independent expert forms (the largest captured decode batch)
STATIC_MOE_TOKENS = 256


def gated_activation(config: ModelConfig):
    if config.hidden_act == "situ":
        beta, linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        return lambda gate, up: situ_and_mul(gate, up, beta, linear_beta)
    return silu_and_mul


class MLP(nn.Module):
    """down(act(gate(x), up(x))): the dense layers and the shared experts."""

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)
        self.act = gated_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """Sigmoid router in fp32 with a score-correction bias used for the choice only (noaux_tc)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = make_param(config.num_experts, config.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = make_param(config.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = torch.nn.functional.linear(x.float(), self.weight)
        return route(
            logits,
            self.e_score_correction_bias,
            c.num_experts_per_token,
            score_func=c.moe_router_activation_func,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
            renormalize=c.moe_renormalize,
            scaling_factor=c.routed_scaling_factor,
        )


class RoutedExperts(nn.Module):
    """All routed experts of a layer stacked: w1 (gate) and w3 (up) [E, I, h], w2 (down) [E, h, I].

    With MXFP4 checkpoints the weights stay packed in memory (`<w>_packed` uint8 [E, out, in/2],
    `<w>_scale` uint8 [E, out, in/32]) and an expert is dequantised when it runs. The checkpoint
    stores one tensor per expert; each stacked parameter's loader takes expert e's slice.

    On CUDA with Triton the forward is the fused kernel (`ops.moe.triton.fused_moe`: weights
    dequantised in registers, only the routed experts read); elsewhere the pure-torch forms below.
    `use_fused = False` forces the torch forms (the tests' oracle on CUDA).
    """

    NAMES = ("w1", "w2", "w3")

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        E, h, inter = config.num_experts, config.moe_hidden_size, config.moe_intermediate_size
        self.num_experts, self.dtype = E, dtype
        self.mxfp4 = config.routed_experts_mxfp4
        self.act = gated_activation(config)
        self.activation = config.hidden_act
        self.situ_betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        self.use_fused: bool | None = None
        """None: the fused kernel wherever `fused_moe_for` offers one; False: always the torch forms."""
        for name in self.NAMES:
            out, inp = (h, inter) if name == "w2" else (inter, h)
            if self.mxfp4:
                setattr(self, f"{name}_packed", make_param(E, out, inp // 2, dtype=torch.uint8, loader=load_expert_slice))
                setattr(self, f"{name}_scale", make_param(E, out, inp // MXFP4_GROUP, dtype=torch.uint8, loader=load_expert_slice))
            else:
                setattr(self, name, make_param(E, out, inp, dtype=dtype, loader=load_expert_slice))

    def expert_weight(self, name: str, e: int) -> torch.Tensor:
        if self.mxfp4:
            return dequantize_mxfp4(getattr(self, f"{name}_packed")[e], getattr(self, f"{name}_scale")[e], self.dtype)
        return getattr(self, name)[e]

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (self.expert_weight(n, e).to(x.dtype) for n in self.NAMES)
        return self.act(x @ w1.T, x @ w3.T) @ w2.T

    def stacked_weight(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        """Weights of the given experts [M] stacked: [M, out, in] in the model dtype."""
        if self.mxfp4:
            return dequantize_mxfp4(getattr(self, f"{name}_packed")[experts], getattr(self, f"{name}_scale")[experts],
                                    self.dtype)
        return getattr(self, name)[experts]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, h], ids/weights [N, k] -> [N, h]. Up to STATIC_MOE_TOKENS tokens run in a form whose
        shapes do not depend on the routing (no host sync; CUDA graphs capture it): each token through
        its own k experts when that reads fewer than all experts, else every expert on every token
        with unrouted pairs weighted 0. More tokens loop over the experts that were picked."""
        fused = fused_moe_for(x.device.type) if self.use_fused is not False else None
        if fused is not None:
            return self.fused_forward(fused, x, ids, weights)
        N, k = ids.shape
        if N > STATIC_MOE_TOKENS:
            return experts_forward(x, ids, weights, self.run_expert, self.num_experts)
        if N * k <= self.num_experts:
            w1, w2, w3 = (self.stacked_weight(n, ids.reshape(-1)).to(x.dtype) for n in self.NAMES)
            xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [N * k, h, 1]
            act = self.act(torch.bmm(w1, xs), torch.bmm(w3, xs))
            y = torch.bmm(w2, act)[..., 0].float().view(N, k, -1)
            return (y * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
        every = torch.arange(self.num_experts, device=x.device)
        w1, w2, w3 = (self.stacked_weight(n, every).to(x.dtype) for n in self.NAMES)
        act = self.act(torch.einsum("nh,eih->eni", x, w1), torch.einsum("nh,eih->eni", x, w3))
        y = torch.einsum("eni,ehi->enh", act, w2).float()
        dense = torch.zeros(N, self.num_experts, dtype=torch.float32, device=x.device)
        dense.scatter_(1, ids, weights.float())
        return torch.einsum("enh,ne->nh", y, dense).to(x.dtype)

    def fused_forward(self, fused, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The fused kernel's forward (`ops.moe.triton.fused_moe`): same contract as `forward`."""
        beta, linear_beta = self.situ_betas
        if self.mxfp4:
            w1, w2, w3 = self.w1_packed, self.w2_packed, self.w3_packed
            scales = dict(w1_scale=self.w1_scale, w2_scale=self.w2_scale, w3_scale=self.w3_scale)
        else:
            w1, w2, w3, scales = self.w1, self.w2, self.w3, {}
        return fused(x, w1, w2, w3, ids, weights.float(), activation=self.activation, situ_beta=beta,
                     situ_linear_beta=linear_beta, **scales)


def load_expert_slice(param: nn.Parameter, loaded: torch.Tensor, name: str, expert: int) -> None:
    if tuple(loaded.shape) != tuple(param.shape[1:]):
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape[1:])}")
    param.data[expert].copy_(loaded)


class SparseMoE(nn.Module):
    """Routed experts (in latent width with LatentMoE) plus shared experts on the unprojected input."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d = config.hidden_size
        self.gate = Router(config)
        self.experts = RoutedExperts(config, dtype)
        if config.num_shared_experts:
            self.shared_experts = MLP(config, d, config.moe_intermediate_size * config.num_shared_experts, dtype)
        if config.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = Linear(d, config.routed_expert_hidden_size, dtype)
            self.routed_expert_up_proj = Linear(config.routed_expert_hidden_size, d, dtype)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(config.routed_expert_hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = self.gate(x)
        h = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        y = self.experts(h, ids, weights)
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)
        if hasattr(self, "routed_expert_up_proj"):
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y.view(shape)
