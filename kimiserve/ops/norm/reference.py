"""Normalisations, in the compute dtype, returned in the input dtype."""

import torch

from kimiserve.ops.dtypes import upcast
from kimiserve.ops.pointwise import vector_sigmoid


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Kimi's RMSNorm: normalise in fp32, cast back to x's dtype, then scale (HF order)."""
    xf = upcast(x)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype) if weight.dtype == x.dtype else (upcast(weight) * normed).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim times sigmoid(gate), all in fp32 (fla's FusedRMSNormGated, sigmoid)."""
    xf = upcast(x)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * upcast(weight, xf.dtype) * vector_sigmoid(upcast(gate, xf.dtype))).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    xf = upcast(x)
    out = torch.nn.functional.layer_norm(xf, (x.shape[-1],), upcast(weight, xf.dtype), upcast(bias, xf.dtype), eps)
    return out.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's l2norm)."""
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
