"""The MXFP4 layout a model's routed experts hold their codes in, for the whole model.

The engine picks it (`ModelRunner.ops`: `DecodeOps.moe_layout` where the device runs the fused MoE
kernel, else the checkpoint layout) and `apply_moe_layout` re-lays every `RoutedExperts` once, in
place; `weights_written` keeps it after something copied checkpoint-layout values into the
parameters (`rl.weight_sync.sync_weights`, the loaders at build time). A layer whose scale bytes
forbid the shift layout keeps the checkpoint layout, with one warning per call naming why.
Readers of the codes take `RoutedExperts.checkpoint_codes` or `named_checkpoint_tensors`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch

from kimiserve.model.moe import RoutedExperts

logger = logging.getLogger("kimiserve.model")


def _experts(model: torch.nn.Module) -> dict[str, RoutedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, RoutedExperts) and m.mxfp4}


def _report(kept: dict[str, str], wanted: int) -> None:
    if kept:
        first, why = next(iter(kept.items()))
        logger.warning("MXFP4 shift layout: %d of %d routed-expert layers keep the checkpoint layout (%s: %s)",
                       len(kept), wanted, first, why)


def apply_moe_layout(model: torch.nn.Module, layout: str) -> bool:
    """Every MXFP4 `RoutedExperts` of `model` asked to hold `layout` ("checkpoint" or "shift").
    Returns whether any layer's codes changed layout (captured CUDA graphs then decode the old one)."""
    experts = _experts(model)
    before = {n: m.mxfp4_layout for n, m in experts.items()}
    kept = {n: why for n, m in experts.items() if (why := m.use_layout(layout)) is not None}
    _report(kept, len(experts))
    return any(m.mxfp4_layout != before[n] for n, m in experts.items())


def weights_written(model: torch.nn.Module, names: Iterable[str]) -> bool:
    """After checkpoint-layout values were copied into `model`'s parameters `names` (full names): the
    written experts' codes re-laid as their layer wants. Returns whether any layer changed layout."""
    leaves: dict[str, set[str]] = {}
    for name in names:
        base, _, leaf = name.rpartition(".")
        leaves.setdefault(base, set()).add(leaf)
    experts = {n: m for n, m in _experts(model).items() if n in leaves}
    before = {n: m.mxfp4_layout for n, m in experts.items()}
    kept = {n: why for n, m in experts.items() if (why := m.weights_written(leaves[n])) is not None}
    _report(kept, len(experts))
    return any(m.mxfp4_layout != before[n] for n, m in experts.items())


def moe_layouts(model: torch.nn.Module) -> dict[str, int]:
    """How many MXFP4 routed-expert layers hold each layout (for benchmark records)."""
    return dict(Counter(m.mxfp4_layout for m in _experts(model).values()))


def named_checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s parameters by name (detached), routed-expert codes in the checkpoint layout (a new
    tensor for a layer holding the shift layout; the parameters themselves otherwise)."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    for base, m in _experts(model).items():
        if m.mxfp4_layout != "checkpoint":
            for w in m.NAMES:
                out[f"{base}.{w}_packed"] = m.checkpoint_codes(w).detach()
    return out


__all__ = ["apply_moe_layout", "moe_layouts", "named_checkpoint_tensors", "weights_written"]
