"""Gated MLP activations."""

import torch
import torch.nn.functional as F

from kimiserve.ops.dtypes import upcast


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU: beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta), in fp32."""
    g, u = upcast(gate), upcast(up)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
