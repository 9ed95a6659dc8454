"""Triton batch-invariant matmul (the GPU form of `reference.linear` for one weight matrix).

y[m, n] = sum_k x[m, k] w[n, k] in fp32, tiled with ONE fixed configuration whatever M is (no split-K,
no autotuning, no M-dependent tile choice): every output element is accumulated over K in BLOCK_K
chunks in increasing k, each chunk as a fixed-shape [BM, BK, BN] product summed over its k axis
(`tl.sum`: one reduction tree per output element, the same for every row of the tile) in fp32, so a
row's result does not depend on how many rows there are or where it sits in its tile (rows past M
are loaded as zeros). The thinking-machines recipe for batch-invariant matmuls, with the k-chunk sum
written out rather than a `tl.dot`, whose per-row order the Triton interpreter (numpy's BLAS) does not
keep: measured, a row's bits there depended on its place in the tile. FMA units, not tensor cores:
a correctness-first kernel (its speed against cuBLAS is the H200 run's to measure). It gives other bits than the CPU's tree sum, so an engine and a trainer must both run it (both
call `reference.linear`, which dispatches here on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 16


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * swn + rk[:, None] * swk, mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> fp32 [M, N], batch-invariant (see the module doc)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](x, w, y, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return y
