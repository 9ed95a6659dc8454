"""Projections that read the same input as one GEMM over their weights stacked by rows (`DecodeOps.linears`
of `backend.fewer_kernel_ops`): q, k, v, the gate and beta projections of a KDA layer; q_a, kv_a, the index
key and the output gate of an MLA layer; the shared experts' gate and up with the latent MoE's down
projection; a dense MLP's gate and up.

The stacked weight is built once, at the first call with a group, and the modules' weights become row
views of it (no second copy of the weights; a checkpoint load or weight sync that copies into the
parameters writes the stacked weight; a group first met under CUDA graph capture is an error, which the
graph sets' warm-up before each capture rules out). Each call checks the views are still in place (host pointers
only) and restacks when a parameter was replaced; groups with LoRA slots, other projection types or
mixed dtypes run each module on its own (`reference.separate_linears`).

`linear_add`: a projection added onto another output as one GEMM that accumulates onto it (addmm)."""

from __future__ import annotations

import torch

from kimiserve.model.layers import Linear
from kimiserve.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
from kimiserve.ops.linear import reference

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
        return reference.separate_linears(x, modules)
    weight = stacked_weight(modules)
    y = torch.nn.functional.linear(x, weight.to(x.dtype))
    return tuple(y.split([m.weight.shape[0] for m in modules], dim=-1))


def stacked_weight(modules: tuple) -> torch.Tensor:
    """The modules' weights (one dtype and device, the same trailing dims) stacked along dim 0, their
    parameters row views of it: stacked at the first call with the group, again when a parameter was
    replaced (an error under CUDA graph capture: the graph would replay the stacking copy)."""
    owner = modules[0]
    stacked = owner.__dict__.get("_stacked_with")
    if stacked is None or stacked[0] != tuple(map(id, modules)) or not _in_place(stacked[1], modules):
        if owner.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("merged_linears: a projection group is stacked by its first eager call (a graph set's "
                               "warm-up); under capture the graph would replay the stacking copy")
        stacked = (tuple(map(id, modules)), _stack(modules))
        owner.__dict__["_stacked_with"] = stacked
    return stacked[1][0]


def linear_add(x: torch.Tensor, module, addend: torch.Tensor) -> torch.Tensor:
    """`reference.linear_add` as one GEMM (addmm: the product added to `addend` before the one rounding to its
    dtype) for a plain projection (`Linear`, or a `RowParallelLinear` that leaves its sum to the caller) of
    addend's dtype and shape; else the reference."""
    row_partial = type(module).forward is RowParallelLinear.forward and (not module.reduce or module.parallel.tp_size == 1)
    plain = type(module).forward is Linear.forward or row_partial
    w = module.weight
    if (not plain or module.lora is not None or w.dtype != x.dtype or addend.dtype != x.dtype
            or addend.shape != (*x.shape[:-1], w.shape[0])):
        return reference.linear_add(x, module, addend)
    out = torch.addmm(addend.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1]), w.t())
    return out.view(addend.shape)
