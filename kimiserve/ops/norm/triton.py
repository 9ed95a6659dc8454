"""RMSNorm and LayerNorm as one Triton kernel each (issue 15: the decode step's glue): `rms_norm`, the
contract and cast points of `reference.rms_norm` (normalise in fp32, round to x's dtype, then scale by
the weight in x's dtype; an fp32 product rounded once when the weight's dtype differs), and
`layer_norm`, that of `reference.layer_norm` (all in fp32, biased variance, rounded once).

One program per row holds the whole row in registers (hidden sizes up to `MAX_HIDDEN`), so x is read
once; only summation orders differ from the references (torch's LayerNorm uses Welford's update, the
kernel the two-pass mean and variance). The references run instead for fp64 and for wider rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.norm import reference

MAX_HIDDEN = 32768
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 512))


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, d] with unit column stride (a view when it can be one, else a contiguous copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def rms_scale(x, w, cols_ok, D, eps, W_SAME: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of the fp32 row x (padding lanes zero) times w, in DTYPE, at the reference's cast points."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if W_SAME:
        y = w.to(tl.float32) * normed.to(DTYPE).to(tl.float32)
    else:
        y = w.to(tl.float32) * normed
    return tl.where(cols_ok, y, 0.0).to(DTYPE)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, x_stride, out_stride, eps,
                     W_SAME: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, rms_scale(x, w, ok, D, eps, W_SAME, DTYPE), mask=ok)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernels' cases (else the references run: fp64, wider rows, a weight that is not one [d] vector)."""
    return (x.dtype in TL_DTYPES and weight.dtype in TL_DTYPES and x.shape[-1] <= MAX_HIDDEN and x.numel() > 0
            and weight.shape == x.shape[-1:] and weight.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm` in one kernel: x [..., d], weight [d] -> [..., d] in x's dtype (contiguous)."""
    if not supported(x, weight):
        return reference.rms_norm(x, weight, eps)
    d = x.shape[-1]
    x2 = rows_of(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, d, x2.stride(0), d, eps, W_SAME=weight.dtype == x.dtype,
                                     DTYPE=TL_DTYPES[x.dtype], BLOCK=block, num_warps=num_warps_for(block))
    return out


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, D, x_stride, out_stride, eps,
                       DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(ok, x - mean, 0.0)
    y = xc * tl.rsqrt(tl.sum(xc * xc, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (y * w + b).to(DTYPE), mask=ok)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.layer_norm` in one kernel: x [..., d], weight and bias [d] -> [..., d] in x's dtype."""
    if not supported(x, weight) or bias.dtype not in TL_DTYPES or bias.shape != weight.shape or not bias.is_contiguous():
        return reference.layer_norm(x, weight, bias, eps)
    d = x.shape[-1]
    x2 = rows_of(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    _layer_norm_kernel[(x2.shape[0],)](x2, weight, bias, out, d, x2.stride(0), d, eps, DTYPE=TL_DTYPES[x.dtype],
                                       BLOCK=block, num_warps=num_warps_for(block))
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, N, D, s_x, s_g, s_o, eps,
                           DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK_R rows of RMSNorm(x) * weight * sigmoid(gate), all in fp32, rounded once."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = (rows < N)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * s_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * s_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    y = normed * w[None, :] * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + rows[:, None] * s_o + cols[None, :], y.to(DTYPE), mask=ok)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.gated_rms_norm` in one kernel: x and gate [..., d] (same shape), weight [d] -> [..., d] in x's
    dtype: RMSNorm of x times weight times sigmoid(gate), in fp32 (KDA's output norm). Rows of d <= 1024
    (KDA's head dim), several per program."""
    if (not supported(x, weight) or gate.shape != x.shape or gate.dtype not in TL_DTYPES or x.shape[-1] > 1024):
        return reference.gated_rms_norm(x, gate, weight, eps)
    d = x.shape[-1]
    x2, g2 = rows_of(x), rows_of(gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    block_r = max(1, 2048 // block)
    _gated_rms_norm_kernel[(triton.cdiv(x2.shape[0], block_r),)](
        x2, g2, weight, out, x2.shape[0], d, x2.stride(0), g2.stride(0), d, eps, DTYPE=TL_DTYPES[x.dtype],
        BLOCK_R=block_r, BLOCK=block, num_warps=4)
    return out
