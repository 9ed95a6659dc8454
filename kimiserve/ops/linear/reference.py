"""Projections that read the same input: each its own GEMM (the reference of `DecodeOps.linears`)."""

from __future__ import annotations

import torch


def separate_linears(x: torch.Tensor, modules: tuple) -> tuple[torch.Tensor, ...]:
    """x [..., in] -> each module's output (`Linear`, `ColumnParallelLinear`, LoRA included), in order."""
    return tuple(m(x) for m in modules)


def linear_add(x: torch.Tensor, module, addend: torch.Tensor) -> torch.Tensor:
    """addend + module(x): a projection whose output is added to another (the shared experts' down projection
    onto the routed experts' output)."""
    return addend + module(x)
