"""Triton batch-invariant RMSNorms (the GPU forms of `reference.rms_norm` / `reference.gated_rms_norm`).

One program per row loads the whole row (padded with zeros to a power of two) and reduces its squares
with one fixed-shape `tl.sum`, so a row's bits depend only on the row: not on the batch, the row's
place or how many rows there are; the rest is the reference's elementwise math in fp32 (sigmoid as
1 / (1 + exp(-x))), rounded where the reference rounds. One launch instead of the tree's ~20.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, D, sx, sg, so, eps, sg_outer,
                     BD: tl.constexpr, SAME_DTYPE: tl.constexpr, GATED: tl.constexpr, GATE_GROUP: tl.constexpr,
                     ROUND_X: tl.constexpr = False):
    """GATE_GROUP > 1: the gate's row r at (r // GATE_GROUP) * sg_outer + (r % GATE_GROUP) * sg (the heads
    of a column slice [N, H, D] of a wider result), else at r * sg."""
    row = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, BD)
    m = dd < D
    x = tl.load(x_ptr + row * sx + dd, mask=m, other=0.0)
    if ROUND_X:  # x rounded to the output's dtype first (a separate cast's bits)
        x = x.to(out_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + dd, mask=m, other=0.0)
    if GATED:
        if GATE_GROUP == 1:
            g_row = row * sg
        else:
            g_row = (row // GATE_GROUP) * sg_outer + (row % GATE_GROUP) * sg
        gate = tl.load(g_ptr + g_row + dd, mask=m, other=0.0).to(tl.float32)
        y = normed * w.to(tl.float32) * (1.0 / (1.0 + tl.exp(-gate)))
    elif SAME_DTYPE:
        y = w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    else:
        y = w.to(tl.float32) * normed
    tl.store(out_ptr + row * so + dd, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D] normalised per row (weight [D]), times sigmoid(gate) when gated -> x's dtype; out_dtype: x is
    rounded to it first (the bits of `rms_norm(x.to(out_dtype), ...)`) and the result comes in it."""
    dtype = out_dtype or x.dtype
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    group, outer = 1, 0
    if gate is not None and gate.dim() == 3 and gate.stride(2) == 1 and gate.stride(1) == D \
            and gate.stride(0) != gate.shape[1] * D and gate.shape[0] > 1:
        g2, group, outer = gate, gate.shape[1], gate.stride(0)  # heads of a column slice: read in place
        sg = D
    else:
        g2 = x2 if gate is None else gate.reshape(-1, D)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
        sg = g2.stride(0)
    w = weight.reshape(-1).contiguous()
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, w, g2, out, D, x2.stride(0), sg, out.stride(0), eps, outer,
                                         BD=triton.next_power_of_2(D), SAME_DTYPE=weight.dtype == dtype,
                                         GATED=gate is not None, GATE_GROUP=group, ROUND_X=dtype != x.dtype,
                                         num_warps=4 if D <= 2048 else 8)
    return out.view(x.shape)


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, R, D, BR: tl.constexpr, BD: tl.constexpr):
    rr = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    dd = tl.arange(0, BD)
    acc = tl.zeros((BR,), tl.float32)
    for d0 in range(0, D, BD):
        m = (rr[:, None] < R) & (d0 + dd[None, :] < D)
        acc += tl.sum(tl.load(x_ptr + rr[:, None] * D + d0 + dd[None, :], mask=m, other=0.0).to(tl.float32), axis=1)
    tl.store(out_ptr + rr, (acc + 0.0).to(out_ptr.dtype.element_ty), mask=rr < R)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of x [..., D] -> [...] in x's dtype, accumulated in fp32: rows in tiles of
    `BR` rows, each row summed chunk by chunk of `BD` columns in increasing order by one fixed-shape
    `tl.sum`, the same for every row of every tile (so whatever the number of rows or a row's place).
    The tiles follow D, so unlike the CPU's tree a row padded to another length may get other bits: the
    GPU path reduces only over lengths that do not depend on the batch (widths, vocab, k, blocks)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    R = x2.shape[0]
    out = torch.empty(R, dtype=x.dtype, device=x.device)
    if R:
        BD = min(triton.next_power_of_2(D), 2048)
        BR = max(1, 4096 // BD)
        _row_sum_kernel[(triton.cdiv(R, BR),)](x2, out, R, D, BR=BR, BD=BD, num_warps=4)
    return out.view(x.shape[:-1])
