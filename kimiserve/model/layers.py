"""Building blocks shared by the layer modules: parameters that know how to load themselves."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kimiserve.ops.norm.reference import rms_norm

WeightLoader = Callable[[nn.Parameter, torch.Tensor, str], None]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape (dtype converted)."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def make_param(*shape: int, dtype: torch.dtype, loader: WeightLoader | None = None) -> nn.Parameter:
    """An uninitialised inference parameter carrying its checkpoint loader."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader or default_weight_loader
    return param


class Weights(nn.Module):
    """Holds a `weight` (and optionally a `bias`) so checkpoint names read `<module>.weight`."""

    def __init__(self, *shape: int, dtype: torch.dtype, loader: WeightLoader | None = None, bias: bool = False):
        super().__init__()
        self.weight = make_param(*shape, dtype=dtype, loader=loader)
        if bias:
            self.bias = make_param(*shape, dtype=dtype)


class Linear(nn.Module):
    """y = x W^T, no bias; W is [out, in] as in the checkpoint."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = make_param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = make_param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
