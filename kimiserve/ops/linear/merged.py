"""Projections that read the same input as one GEMM over their weights stacked by rows (`DecodeOps.linears`
of `backend.fewer_kernel_ops`): q, k, v, the gate and beta projections of a KDA layer, the shared experts'
gate and up with the latent MoE's down projection, a dense MLP's gate and up.

The stacked weight is built once, at the first call with a group, and the modules' weights become row
views of it (no second copy of the weights; a checkpoint load or weight sync that copies into the
parameters writes the stacked weight). Each call checks the views are still in place (host pointers
only) and restacks when a parameter was replaced; groups with LoRA slots, other projection types or
mixed dtypes run each module on its own (`reference.separate_linears`)."""

from __future__ import annotations

import torch

from kimiserve.model.layers import Linear
from kimiserve.model.parallel_layers import ColumnParallelLinear
from kimiserve.ops.linear.reference import separate_linears

PLAIN = (Linear.forward, ColumnParallelLinear.forward)
"""The projection forwards the stacked GEMM computes: y = x W^T."""


def mergeable(modules: tuple) -> bool:
    weights = [getattr(m, "weight", None) for m in modules]
    return (len(modules) > 1 and all(type(m).forward in PLAIN and m.lora is None for m in modules)
            and all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights)
            and len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1
            and all(set(dict(m.named_parameters(recurse=False))) == {"weight"} for m in modules))


def _in_place(stacked, modules) -> bool:
    weight, ptrs = stacked
    return all(m.weight.data_ptr() == p and m.weight.dtype == weight.dtype for m, p in zip(modules, ptrs))


@torch.no_grad()
def _stack(modules: tuple):
    """Stack the weights [sum out, in] and re-point each parameter at its rows (outside inference mode:
    the parameters stay ordinary tensors that later in-place copies may write)."""
    with torch.inference_mode(False):
        weight = torch.cat([m.weight.detach() for m in modules]).contiguous()
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[start : start + rows]
            start += rows
    return weight, tuple(m.weight.data_ptr() for m in modules)


def merged_linears(x: torch.Tensor, modules: tuple) -> tuple[torch.Tensor, ...]:
    """`reference.separate_linears` as one GEMM: x [..., in] -> each module's output, row views of the one
    [..., sum out] result (their last dim has unit stride, their rows the stacked width)."""
    if not mergeable(modules):
        return separate_linears(x, modules)
    owner = modules[0]
    stacked = owner.__dict__.get("_stacked_with")
    if stacked is None or stacked[0] != tuple(map(id, modules)) or not _in_place(stacked[1], modules):
        stacked = (tuple(map(id, modules)), _stack(modules))
        owner.__dict__["_stacked_with"] = stacked
    weight = stacked[1][0]
    y = torch.nn.functional.linear(x, weight.to(x.dtype))
    return tuple(y.split([m.weight.shape[0] for m in modules], dim=-1))
