"""Triton batch-invariant matmul (the GPU form of `reference.linear` for one weight matrix).

y[m, n] = sum_k x[m, k] w[n, k], tiled with ONE fixed configuration whatever M is (no split-K, no
autotuning, no M-dependent tile choice, M not specialised on): every output element is accumulated
over K in BLOCK_K chunks in increasing k, each chunk one `tl.dot` of fixed-shape [BM, BK] x [BK, BN]
tiles into the fp32 accumulator, so a row's result does not depend on how many rows there are or where
it sits in its tile (rows past M load as zeros). bf16 / fp16 operands of one dtype go through the
tensor cores (fp32 accumulate); anything else is computed in fp32 with IEEE products (no TF32). The
recipe of thinking-machines' batch_invariant_ops and vLLM's batch-invariant mode (one tile config per
dtype, a sequential K loop), as a plain grid rather than a persistent kernel.

It gives other bits than the CPU's tree sum, so an engine and a trainer must both run it (both call
`reference.linear`, which dispatches here on CUDA). `CONFIG` is the one tile shape; changing it changes
the bits (never the invariance) and is measured by benchmarks/batch_invariant_matmul.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIG = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4}
"""The one tile configuration (every M, every N, every K)."""

_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxb, sxm, sxk, swb, swn, swk, syb, sym, syn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    x_ptr += pid_b * sxb
    w_ptr += pid_b * swb
    y_ptr += pid_b * syb
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)  # offsets past 2^31 elements (a vocab-sized weight)
    x_ptrs = x_ptr + rm64[:, None] * sxm + rk[None, :] * sxk
    w_ptrs = w_ptr + rn64[None, :] * swn + rk[:, None] * swk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < N) & (k0 + rk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BK * sxk
        w_ptrs += BK * swk
    tl.store(y_ptr + rm64[:, None] * sym + rn64[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in `out_dtype` (the fp32 sum rounded once), batch-invariant
    (see the module doc). Also batched: x [B, M, K] and w [B, N, K] -> [B, M, N], each b on its own
    (the same tiles as B separate calls)."""
    batched = x.dim() == 3
    if x.dim() not in (2, 3) or w.dim() != x.dim() or x.shape[-1] != w.shape[-1] or (batched and x.shape[0] != w.shape[0]):
        raise ValueError(f"matmul needs x [M, K] and w [N, K] (or [B, M, K] and [B, N, K]), got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    x3, w3 = (x, w) if batched else (x.unsqueeze(0), w.unsqueeze(0))
    B, M, K = x3.shape
    N = w3.shape[1]
    y = torch.empty(B, M, N, dtype=out_dtype, device=x.device)
    if B and M and N:
        ieee = not (x.dtype == w.dtype and x.dtype in _TENSOR_CORE_DTYPES)
        c = CONFIG
        grid = (triton.cdiv(M, c["BM"]), triton.cdiv(N, c["BN"]), B)
        _matmul_kernel[grid](x3, w3, y, M, N, K, *x3.stride(), *w3.stride(), *y.stride(),
                             BM=c["BM"], BN=c["BN"], BK=c["BK"], IEEE=ieee, num_warps=c["num_warps"],
                             num_stages=c["num_stages"])
    return y if batched else y[0]
