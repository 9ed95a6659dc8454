"""MLA's per-head matmuls with the kv_b weights (the query's absorption into latent space, the output's
projection back to v_head_dim) as one Triton kernel (issue 15: the decode step's glue): `head_matmul`,
the contract of `reference.head_matmul`: out[b, h] = x[b, h] @ w[h] in fp32 for bf16/fp32 operands.

The reference upcasts the bf16 weight to fp32 on every call (a copy of twice its bytes, then an fp32
batched GEMM reading it again); the kernel reads the weight once in its own dtype and multiplies in
fp32 (`tl.dot` at ieee precision: the bf16 values are exact in fp32), so only the summation order
differs. Grid (heads, output tiles, row tiles); any strides (the weights are views of kv_b_proj).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.mla import reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _head_matmul_kernel(x_ptr, w_ptr, out_ptr, B, I, O, s_xb, s_xh, s_xi, s_wh, s_wi, s_wo, s_ob, s_oh,
                        BB: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BO + tl.arange(0, BO)
    b = tl.program_id(2) * BB + tl.arange(0, BB)
    acc = tl.zeros([BB, BO], dtype=tl.float32)
    for i0 in range(0, I, BI):
        i = i0 + tl.arange(0, BI)
        x = tl.load(x_ptr + b[:, None] * s_xb + h * s_xh + i[None, :] * s_xi,
                    mask=(b[:, None] < B) & (i[None, :] < I), other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h * s_wh + i[:, None] * s_wi + o[None, :] * s_wo,
                    mask=(i[:, None] < I) & (o[None, :] < O), other=0.0).to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(out_ptr + b[:, None] * s_ob + h * s_oh + o[None, :], acc, mask=(b[:, None] < B) & (o[None, :] < O))


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`reference.head_matmul` in one kernel: x [B, H, I], w [H, I, O] -> fp32 [B, H, O]."""
    if (x.dtype not in DTYPES or w.dtype not in DTYPES or x.numel() == 0 or x.dim() != 3 or w.dim() != 3
            or w.shape[:2] != x.shape[1:]):
        return reference.head_matmul(x, w)
    B, H, I = x.shape
    O = w.shape[2]
    out = torch.empty(B, H, O, dtype=torch.float32, device=x.device)
    BB = min(64, max(16, triton.next_power_of_2(B)))
    BO = min(64, max(16, triton.next_power_of_2(O)))
    BI = min(64, max(16, triton.next_power_of_2(I)))
    grid = (H, triton.cdiv(O, BO), triton.cdiv(B, BB))
    _head_matmul_kernel[grid](x, w, out, B, I, O, *x.stride(), *w.stride(), out.stride(0), out.stride(1),
                              BB=BB, BI=BI, BO=BO, num_warps=4)
    return out
