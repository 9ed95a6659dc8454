"""A sublayer's input as one Triton kernel (issue 15: the decode step's glue): `add_read_norm`, the
contract of `reference.add_read_norm`: the residual add (optional), the block attention-residual read
(optional) and the RMSNorm that follows it.

Cast points as the reference's: the sum running + addend is rounded to the model dtype (and stored:
the caller's new live sum); every candidate v_i (the sealed blocks, then the live sum) is read in fp32,
scored <v_i, norm_weight * proj_weight> * rsqrt(mean v_i^2 + eps), the softmax mix of the raw
candidates is accumulated in fp32 and rounded to the model dtype (the read's output), then normed as
`norm.reference.rms_norm`. The softmax runs online (a running max and sum, the accumulator rescaled
per candidate), so each candidate is read once; only summation orders differ from the reference.

One program per row holds the row's accumulator in registers (hidden sizes up to `MAX_HIDDEN`). The
blocks are addressed as base + i * block stride: when they are equally spaced views (the serving
forward keeps them in one buffer, `model.attn_res.seal`) no copy is made; other lists are stacked
first. The reference runs for fp64 and for wider rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.attn_res import reference
from kimiserve.ops.attn_res.blocks import block_layout
from kimiserve.ops.norm.triton import TL_DTYPES, num_warps_for, rms_scale, rows_of

MAX_HIDDEN = 16384


@triton.jit
def _score(v, q, D, eps):
    return tl.sum(v * q, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)


@triton.jit
def _add_read_norm_kernel(
    run_ptr, add_ptr, blk_ptr, rn_ptr, rp_ptr, nw_ptr, out_ptr, run_out_ptr,
    D, NB, run_stride, add_stride, blk_stride, blk_row_stride, out_stride, run_out_stride, eps,
    HAS_ADD: tl.constexpr, HAS_READ: tl.constexpr, W_SAME: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    r = tl.load(run_ptr + row * run_stride + cols, mask=ok, other=0.0)
    if HAS_ADD:
        a = tl.load(add_ptr + row * add_stride + cols, mask=ok, other=0.0)
        r = (r.to(tl.float32) + a.to(tl.float32)).to(DTYPE)
        tl.store(run_out_ptr + row * run_out_stride + cols, r, mask=ok)
    x = r.to(tl.float32)
    if HAS_READ:
        q = tl.load(rn_ptr + cols, mask=ok, other=0.0).to(tl.float32) * tl.load(rp_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        m = _score(x, q, D, eps)  # the live sum first: the running max starts finite
        s = m * 0.0 + 1.0
        acc = x
        for i in range(NB):
            v = tl.load(blk_ptr + i * blk_stride + row * blk_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
            score = _score(v, q, D, eps)
            m_new = tl.maximum(m, score)
            scale, p = tl.exp(m - m_new), tl.exp(score - m_new)
            acc = acc * scale + p * v
            s = s * scale + p
            m = m_new
        x = (acc / s).to(DTYPE).to(tl.float32)
    w = tl.load(nw_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, rms_scale(x, w, ok, D, eps, W_SAME, DTYPE), mask=ok)


def supported(running: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    return (running.dtype in TL_DTYPES and norm_weight.dtype in TL_DTYPES and running.shape[-1] <= MAX_HIDDEN
            and running.numel() > 0)


def add_read_norm(
    running: torch.Tensor, addend: torch.Tensor | None, blocks: list[torch.Tensor], read_norm_weight: torch.Tensor | None,
    read_proj_weight: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_read_norm` in one kernel: running (and addend, each block) [..., d] -> (normed
    input, live sum), both [..., d] in running's dtype."""
    d = running.shape[-1]
    read_ok = not blocks or (read_norm_weight.numel() == d and read_proj_weight.numel() == d
                             and read_norm_weight.is_contiguous() and read_proj_weight.is_contiguous())
    if (not supported(running, norm_weight) or not read_ok
            or (addend is not None and (addend.dtype != running.dtype or addend.shape != running.shape))):
        return reference.add_read_norm(running, addend, blocks, read_norm_weight, read_proj_weight, norm_weight, eps)
    run2 = rows_of(running)
    n_rows = run2.shape[0]
    out = torch.empty(running.shape, dtype=running.dtype, device=running.device)
    live, live2, add2 = running, run2, run2
    if addend is not None:
        add2 = rows_of(addend)
        live = torch.empty(running.shape, dtype=running.dtype, device=running.device)
        live2 = live.view(-1, d)
    base, blk_stride, blk_row_stride = (run2, 0, 0) if not blocks else block_layout(blocks, running)
    rn = read_norm_weight if blocks else norm_weight
    rp = read_proj_weight.reshape(-1) if blocks else norm_weight
    block = triton.next_power_of_2(d)
    _add_read_norm_kernel[(n_rows,)](
        run2, add2, base, rn, rp, norm_weight, out, live2, d, len(blocks), run2.stride(0), add2.stride(0),
        blk_stride, blk_row_stride, d, d, eps, HAS_ADD=addend is not None, HAS_READ=bool(blocks),
        W_SAME=norm_weight.dtype == running.dtype, DTYPE=TL_DTYPES[running.dtype], BLOCK=block,
        num_warps=num_warps_for(block))
    return out, live
