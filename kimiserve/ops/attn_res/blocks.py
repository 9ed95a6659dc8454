"""How the fused attention-residual read addresses the sealed blocks (pure torch: no Triton needed)."""

from __future__ import annotations

import torch


def block_layout(blocks: list[torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(base tensor, stride between blocks, row stride) addressing block i's rows as base + i * stride:
    without a copy when the blocks are rows-views of one shape and dtype at equal spacing, else stacked."""
    d = like.shape[-1]
    if all(b.shape == like.shape and b.dtype == like.dtype and b.device == like.device for b in blocks):
        rows = [b.reshape(-1, d) for b in blocks]
        if all(r.stride() == rows[0].stride() and r.stride(-1) == 1 and r.data_ptr() == b.data_ptr()
               for r, b in zip(rows, blocks)):
            size = like.element_size()
            gaps = {(b.data_ptr() - a.data_ptr()) for a, b in zip(rows, rows[1:])}
            if len(gaps) <= 1 and all(g % size == 0 for g in gaps):
                return rows[0], (gaps.pop() // size if gaps else 0), rows[0].stride(0)
    stacked = torch.stack([b.to(like.dtype).reshape(-1, d) for b in blocks])
    return stacked[0], stacked.stride(0), stacked.stride(1)
