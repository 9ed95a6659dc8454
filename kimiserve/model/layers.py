"""Building blocks shared by the layer modules: parameters that know how to load themselves.

A parameter's `weight_loader(param, source, name[, expert])` fills it from a checkpoint tensor.
`source` is lazily sliceable: a safetensors slice (`safe_open(...).get_slice(name)`, memory-mapped)
or a torch tensor (random init passes the drawn tensor); a loader reads its shape with
`source_shape` and only the part its parameter holds with `source[index]`, so a tensor-parallel
rank never materialises a sharded tensor whole. `param.full_shape` is the parameter's logical
(unsharded) shape: what it would be in one process.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from kimiserve.ops.norm.reference import rms_norm

WeightLoader = Callable[..., None]
Source = Any
"""A torch tensor or a safetensors slice: `source_shape(source)` and `source[index]`."""


def source_shape(source: Source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def read(source: Source, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The whole source (dim None), or rows [start, stop) along `dim` (nothing else is read)."""
    if dim is None:
        return source[:]
    return source[(slice(None),) * dim + (slice(start, stop),)]


def check_shape(source: Source, expected: tuple[int, ...], name: str) -> None:
    shape = source_shape(source)
    if shape != tuple(expected):
        raise ValueError(f"tensor {name} has shape {shape}, the model expects {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: Source, name: str) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape (dtype converted)."""
    check_shape(loaded, tuple(param.shape), name)
    param.data.copy_(read(loaded))


def sharded_loader(dim: int, rank: int, parts: int) -> WeightLoader:
    """Loads block `rank` of `parts` equal blocks along `dim` of the checkpoint tensor (the parameter's
    own shape along `dim` times `parts`); `parts` 1 reads the whole tensor."""
    def load(param: nn.Parameter, loaded: Source, name: str) -> None:
        n = param.shape[dim]
        full = list(param.shape)
        full[dim] = n * parts
        check_shape(loaded, tuple(full), name)
        param.data.copy_(read(loaded) if parts == 1 else read(loaded, dim, rank * n, (rank + 1) * n))

    load.shard = (dim, rank, parts)
    return load


def make_param(*shape: int, dtype: torch.dtype, loader: WeightLoader | None = None,
               full_shape: tuple[int, ...] | None = None) -> nn.Parameter:
    """An uninitialised inference parameter carrying its checkpoint loader and its logical shape."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader or default_weight_loader
    param.full_shape = tuple(shape) if full_shape is None else tuple(full_shape)
    return param


class Weights(nn.Module):
    """Holds a `weight` (and optionally a `bias`) so checkpoint names read `<module>.weight`."""

    def __init__(self, *shape: int, dtype: torch.dtype, loader: WeightLoader | None = None, bias: bool = False,
                 full_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.weight = make_param(*shape, dtype=dtype, loader=loader, full_shape=full_shape)
        if bias:
            self.bias = make_param(*shape, dtype=dtype, loader=loader, full_shape=full_shape)


class Linear(nn.Module):
    """y = x W^T, no bias; W is [out, in] as in the checkpoint. Replicated on every rank."""

    lora = None
    """The default forward's LoRA slots of this projection (`kimiserve.lora.serving.LoRALinear`), or None."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = make_param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight.to(x.dtype))
        return y if self.lora is None else self.lora(x, y)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = make_param(size, dtype=dtype)

    def forward(self, x: torch.Tensor, norm: Callable = rms_norm) -> torch.Tensor:
        """norm: `ops.norm.reference.rms_norm` or an op of its contract (`DecodeOps.rms_norm`)."""
        return norm(x, self.weight, self.eps)
