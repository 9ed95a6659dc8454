"""The SiTU gated activation as one Triton kernel (issue 15: the decode step's glue, the shared experts'
and dense MLPs' activation): `situ_and_mul`, the contract of `reference.situ_and_mul` (all in fp32,
rounded once to gate's dtype). tanh is computed from exp (no libdevice in the interpreter), with a
series near 0 where 1 - 2 / (exp(2|x|) + 1) would cancel: a few fp32 ulps from torch's tanh. The
reference runs for fp64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.activation import reference
from kimiserve.ops.norm.triton import TL_DTYPES

BLOCK = 1024


@triton.jit
def _tanh(x):
    """tanh within a few fp32 ulps: e / (e + 2) with e = expm1(2|x|) from its Taylor series (to degree 9,
    no cancellation) for |x| < 1/4, else 1 - 2 / (exp(2|x|) + 1)."""
    y = 2.0 * tl.abs(x)
    e = y * (1 + y / 2 * (1 + y / 3 * (1 + y / 4 * (1 + y / 5 * (1 + y / 6 * (1 + y / 7 * (1 + y / 8 * (1 + y / 9))))))))
    t = tl.where(y < 0.5, e / (e + 2.0), 1.0 - 2.0 / (tl.exp(y) + 1.0))
    return tl.where(x < 0, -t, t)


@triton.jit
def _situ_kernel(g_ptr, u_ptr, out_ptr, n_cols, g_stride, u_stride, beta, linear_beta,
                 LINEAR_TANH: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * g_stride + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if LINEAR_TANH:
        u = linear_beta * _tanh(u / linear_beta)
    act = beta * _tanh(g / beta) * tl.sigmoid(g)
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(DTYPE), mask=ok)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """`reference.situ_and_mul` in one kernel: gate, up [..., I] (one shape) -> [..., I] in gate's dtype."""
    if gate.dtype not in TL_DTYPES or up.dtype not in TL_DTYPES or gate.shape != up.shape or gate.numel() == 0:
        return reference.situ_and_mul(gate, up, beta, linear_beta)
    n = gate.shape[-1]
    g2, u2 = (t.reshape(-1, n) if t.reshape(-1, n).stride(-1) == 1 else t.reshape(-1, n).contiguous()
              for t in (gate, up))
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grid = (g2.shape[0], triton.cdiv(n, BLOCK))
    _situ_kernel[grid](g2, u2, out, n, g2.stride(0), u2.stride(0), float(beta),
                       float(linear_beta) if linear_beta is not None else 1.0, LINEAR_TANH=linear_beta is not None,
                       DTYPE=TL_DTYPES[gate.dtype], BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _gate_output_kernel(o_ptr, g_ptr, out_ptr, n_cols, o_stride, g_stride,
                        HAS_GATE: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    o = tl.load(o_ptr + row * o_stride + cols, mask=ok, other=0.0).to(DTYPE)
    if HAS_GATE:
        g = tl.load(g_ptr + row * g_stride + cols, mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(g).to(DTYPE)
        o = (o.to(tl.float32) * s.to(tl.float32)).to(DTYPE)
    tl.store(out_ptr + row * n_cols + cols, o, mask=ok)


def gate_output(o: torch.Tensor, gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`reference.gate_output` in one kernel (the cast, sigmoid and product of MLA's output, each rounded to
    `dtype` as torch rounds it): o [..., n] (fp32 or `dtype`), gate [..., n] in `dtype` or None -> [..., n]."""
    if (o.dtype not in TL_DTYPES or dtype not in TL_DTYPES or o.numel() == 0
            or (gate is not None and (gate.shape != o.shape or gate.dtype != dtype))):
        return reference.gate_output(o, gate, dtype)
    n = o.shape[-1]
    o2, g2 = (None if t is None else t.reshape(-1, n) if t.reshape(-1, n).stride(-1) == 1 else t.reshape(-1, n).contiguous()
              for t in (o, gate))
    out = torch.empty(o.shape, dtype=dtype, device=o.device)
    grid = (o2.shape[0], triton.cdiv(n, BLOCK))
    _gate_output_kernel[grid](o2, o2 if g2 is None else g2, out, n, o2.stride(0), 0 if g2 is None else g2.stride(0),
                              HAS_GATE=g2 is not None, DTYPE=TL_DTYPES[dtype], BLOCK=BLOCK, num_warps=4)
    return out
