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


def add_read_norm(
    running: torch.Tensor, addend: torch.Tensor | None, blocks: list[torch.Tensor], read_norm_weight: torch.Tensor | None,
    read_proj_weight: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's input: the live sum `running` (+ `addend`, the previous sublayer's output, when given,
    in running's dtype), its attention-residual read of `blocks` (`attn_res_read`; none: the live sum
    itself), then RMSNorm (`norm.reference.rms_norm`, the same eps). Returns (the normed input, the live
    sum). The composition the serving path's fused kernel (`attn_res.triton.add_read_norm`) computes; the
    read weights may be None when there are no blocks."""
    from kimiserve.ops.norm.reference import rms_norm

    if addend is not None:
        running = running + addend
    x = attn_res_read(running, blocks, read_norm_weight, read_proj_weight, eps) if blocks else running
    return rms_norm(x, norm_weight, eps), running
