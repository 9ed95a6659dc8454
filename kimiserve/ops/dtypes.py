"""The compute dtype rule every reference op follows: at least fp32, fp64 stays fp64."""

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def upcast(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.to(dtype or compute_dtype(x))
