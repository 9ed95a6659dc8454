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


def gate_output(o: torch.Tensor, gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """o in `dtype` (the attention output as the MLA ops return it, fp32 or the model dtype), times sigmoid(gate)
    when a gate is given (MLA's output gate, gate in `dtype`): each op rounded to `dtype` as torch rounds it."""
    o = o.to(dtype)
    return o if gate is None else o * torch.sigmoid(gate)
