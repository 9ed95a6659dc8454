"""The fused MoE's kernels after the grouped GEMMs (`ops.moe.triton`): the activation, the combine of a
token's k expert outputs, and the reduces of split-K partials.

Split-K (`GemmTiles.split_k` = S > 1): the S programs of one (block, column tile) each run a slice of
the K steps and store their fp32 accumulators to a partials buffer; nothing is added atomically. Then
- gate/up: `_reduce_act_kernel` sums gate and up over s = 0..S-1 in order, rounds each to the model
  dtype and applies the activation (as the unsplit kernel's epilogue does) -> act rows (for the decode fragment
  GEMMs in their MMA-k order);
- down: `_combine_kernel` with SPLIT = S sums each slot's S partials in order, rounds the sum to the
  model dtype (the expert's output, as the unsplit kernel stores it) and weights and adds the slots.
  The down GEMM's reduce costs no launch and y is never written.
Fixed summation orders: for a given batch and config the result is bitwise reproducible."""

from __future__ import annotations

import triton
import triton.language as tl

from kimiserve.ops.moe.dependent_launch import gdc_launch_dependents, gdc_wait, wait_prior_grid
from kimiserve.ops.moe.mma_order import mma_k_position


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice in the interpreter): sign(x) (1 - 2 / (exp(2|x|) + 1))."""
    t = 1.0 - 2.0 / (tl.exp(2.0 * tl.abs(x)) + 1.0)
    return tl.where(x < 0, -t, t)


@triton.jit
def _activate(g, u, beta, linear_beta, ACT: tl.constexpr, LINEAR_TANH: tl.constexpr, DTYPE: tl.constexpr):
    """act(gate, up) in fp32 from gate and up rounded to DTYPE, as the references compute it."""
    g = g.to(DTYPE).to(tl.float32)
    u = u.to(DTYPE).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    if ACT == 1:  # situ_and_mul: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), in fp32
        if LINEAR_TANH:
            u = linear_beta * _tanh(u / linear_beta)
        return beta * _tanh(g / beta) * sig * u
    else:  # silu_and_mul: silu(gate) rounded to the dtype, times up
        return (g * sig).to(DTYPE).to(tl.float32) * u


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, s_y, s_wt, s_wj, s_o, s_ys, TOP_K: tl.constexpr, BH: tl.constexpr,
                    SPLIT: tl.constexpr = 1, DTYPE: tl.constexpr = tl.bfloat16, PDL: tl.constexpr = False):
    """out[t, cols] = sum_j w[t, j] * y[t k + j, cols] in fp32, j in order. SPLIT > 1: y is fp32 partials
    [SPLIT, N k, H] (split s at y_ptr + s s_ys) and y[p] = round_DTYPE(sum_s partial[s, p]), s in order. PDL: launched
    as the end of the decode chain (`ops.moe.dependent_launch`)."""
    wait_prior_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = cols < H
    acc = tl.zeros((BH,), tl.float32)
    for j in tl.static_range(TOP_K):
        wj = tl.load(w_ptr + t * s_wt + j * s_wj).to(tl.float32)
        row = y_ptr + (t * TOP_K + j) * s_y + cols
        if SPLIT == 1:
            y = tl.load(row, mask=ok, other=0.0).to(tl.float32)
        else:
            y = tl.zeros((BH,), tl.float32)
            for s in tl.static_range(SPLIT):
                y += tl.load(row + s * s_ys, mask=ok, other=0.0)
            y = y.to(DTYPE).to(tl.float32)
        acc += wj * y
    tl.store(out_ptr + t * s_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _reduce_act_kernel(part_ptr, out_ptr, N_OUT, s_pm, s_ps, s_pg, s_om, beta, linear_beta, SPLIT: tl.constexpr,
                       ACT: tl.constexpr, LINEAR_TANH: tl.constexpr, DTYPE: tl.constexpr, BR: tl.constexpr,
                       OUT_BK: tl.constexpr = 0, PDL: tl.constexpr = False):
    """out[p, cols] = act(sum_s gate[s, p, cols], sum_s up[s, p, cols]) in DTYPE; gate partial s of pair p at
    part_ptr + s s_ps + p s_pm, its up partial s_pg further. OUT_BK > 0: each column stored at its MMA-k position
    in OUT_BK-wide steps (`ops.moe.fragment_order`; the decode fragment GEMMs' down GEMM reads act so). PDL: launched
    in the decode chain between the fragment GEMMs (`ops.moe.dependent_launch`): it lets the down GEMM launch before
    its own wait, so that the down programs load their first weights while the gate/up GEMM finishes."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BR + tl.arange(0, BR)
    ok = cols < N_OUT
    g = tl.zeros((BR,), tl.float32)
    u = tl.zeros((BR,), tl.float32)
    row = part_ptr + p * s_pm + cols
    for s in tl.static_range(SPLIT):
        g += tl.load(row + s * s_ps, mask=ok, other=0.0)
        u += tl.load(row + s * s_ps + s_pg, mask=ok, other=0.0)
    y = _activate(g, u, beta, linear_beta, ACT, LINEAR_TANH, DTYPE)
    dst = cols
    if OUT_BK > 0:
        dst = mma_k_position(cols, OUT_BK)
    tl.store(out_ptr + p * s_om + dst, y.to(DTYPE), mask=ok)


__all__ = ["_activate", "_combine_kernel", "_reduce_act_kernel"]
