"""Causal depthwise short convolution followed by SiLU (KDA's q/k/v conv)."""

import torch
import torch.nn.functional as F

from kimiserve.ops.dtypes import compute_dtype
from kimiserve.ops.pointwise import vector_silu


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """y[t, c] = SiLU(sum_j weight[c, j] * x[t - W + 1 + j, c]).

    x: [B, T, C]; weight: [C, W] (tap W-1 is the current token); state: [B, C, W-1], the W-1 inputs
    before x (zeros when None). Returns y [B, T, C] in x's dtype and the new state [B, C, W-1]
    (the last W-1 inputs, in the state's dtype, x's when None).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if state is None:
        state = x.new_zeros(B, C, W - 1)
    dt = compute_dtype(x, weight)
    seq = torch.cat([state.to(dt), x.transpose(1, 2).to(dt)], dim=-1)  # [B, C, W-1+T]
    y = F.conv1d(seq, weight.to(dt).unsqueeze(1), groups=C)  # [B, C, T]
    new_state = seq[..., seq.shape[-1] - (W - 1):].to(state.dtype)
    return vector_silu(y).transpose(1, 2).to(x.dtype), new_state
