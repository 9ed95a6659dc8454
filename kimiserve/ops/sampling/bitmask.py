"""Token bitmask application: the guided-decoding mask on the logits, on the logits' device.

The bitmask comes from the grammar library on the host (int32 [R, W], bit t % 32 of word t // 32
set when token t is allowed); the sampler copies it to the device without blocking and this
unpacks and applies it there (`reference.apply_token_bitmask_reference` is the oracle).
"""

from __future__ import annotations

import torch

from kimiserve.ops.sampling.reference import NEG_INF


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, V]: True where the token is allowed (tokens past 32 x W are not)."""
    R, W = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(R, W * 32).to(torch.bool)
    if W * 32 >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_zeros(R, vocab_size - W * 32)], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf, in place, on the tokens each row's bitmask disallows; returns logits."""
    return logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), NEG_INF)
