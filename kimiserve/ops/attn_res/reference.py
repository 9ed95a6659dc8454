"""Block attention-residuals: each sublayer reads a softmax mix of sealed snapshots and the live sum."""

import torch

from kimiserve.ops.dtypes import compute_dtype


def attn_res_read(
    running: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix candidates v_i = (blocks..., running) by p = softmax_i(<rmsnorm(v_i), norm_weight * proj_weight>).

    The score normalises each candidate (RMS over the hidden dim, in fp32) but the mix uses the raw
    candidates. running: [..., d]; blocks: sealed snapshots of the same shape; norm_weight [d];
    proj_weight [1, d] or [d]. Returns running's dtype.
    """
    dt = compute_dtype(running)
    v = torch.stack([*blocks, running], dim=-2).to(dt)  # [..., n, d]
    query = norm_weight.to(dt).reshape(-1) * proj_weight.to(dt).reshape(-1)
    scores = (v * query).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("...n,...nd->...d", probs, v).to(running.dtype)
