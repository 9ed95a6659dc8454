"""Projections that read the same input: each its own GEMM (the reference of `DecodeOps.linears`)."""

from __future__ import annotations

import torch


def separate_linears(x: torch.Tensor, modules: tuple) -> tuple[torch.Tensor, ...]:
    """x [..., in] -> each module's output (`Linear`, `ColumnParallelLinear`, LoRA included), in order."""
    return tuple(m(x) for m in modules)
