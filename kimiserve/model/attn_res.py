"""Block attention-residual read sites: one (norm, proj) weight pair per site."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.model.layers import Weights
from kimiserve.ops.attn_res.reference import attn_res_read


def read_site_modules(hidden: int, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(`*_res_norm` with weight [d], `*_res_proj` with weight [1, d]) as the checkpoint names them."""
    return Weights(hidden, dtype=dtype), Weights(1, hidden, dtype=dtype)


def read(running: torch.Tensor, blocks: list[torch.Tensor], norm: nn.Module, proj: nn.Module, eps: float) -> torch.Tensor:
    return attn_res_read(running, blocks, norm.weight, proj.weight, eps)
