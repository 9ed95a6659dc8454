"""Block attention-residual read sites (one (norm, proj) weight pair per site) and the sealed snapshots."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.model.layers import Weights


def read_site_modules(hidden: int, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(`*_res_norm` with weight [d], `*_res_proj` with weight [1, d]) as the checkpoint names them."""
    return Weights(hidden, dtype=dtype), Weights(1, hidden, dtype=dtype)




def block_store(running: torch.Tensor, config) -> torch.Tensor:
    """A buffer for every snapshot a forward seals ([ceil(layers / block_size), *running.shape]): blocks
    sealed into it are equally spaced views, which the fused read kernel addresses without stacking them."""
    seals = -(-config.num_hidden_layers // config.attn_res_block_size)
    return running.new_empty(seals, *running.shape)


def seal(blocks: list[torch.Tensor], running: torch.Tensor, store: torch.Tensor | None = None) -> list[torch.Tensor]:
    """blocks + [running]: the snapshot itself, or (with a `block_store`) its copy in the next slot."""
    if store is None:
        return [*blocks, running]
    slot = store[len(blocks)]
    slot.copy_(running)
    return [*blocks, slot]
