"""`fragment_order` (x's columns in the decode fragment GEMMs' MMA-k order) as one Triton kernel: the first launch
after the align in the decode chain, so that it can take part in the chain's dependent launch
(`ops.moe.dependent_launch`), which a torch copy cannot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.moe.dependent_launch import launch_options, wait_prior_grid
from kimiserve.ops.moe.fragment_order import _check_block_k

COLUMNS_A_PROGRAM = 2048


@triton.jit
def mma_k_position(k, BK: tl.constexpr):
    """Physical column(s) k -> their MMA-k positions within BK-wide steps (`fragment_order.mma_position`, the torch
    reference): physical (BK / 4) t + 4s + 2b1 + b0 -> 16s + 8b1 + 2t + b0. For the Triton and Gluon kernels."""
    q = k % BK
    return k - q + (q % (BK // 4) // 4) * 16 + (q % 4 // 2) * 8 + (q // (BK // 4)) * 2 + q % 2


@triton.jit
def _mma_order_kernel(x_ptr, out_ptr, K, s_x, s_o, BK: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0), columns program_id(1) CH onwards: physical k of each BK-wide step to its MMA position
    (`fragment_order.mma_position`). x is the MoE's input: loaded before the wait (see `ops.moe.dependent_launch`)."""
    n = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * CH + tl.arange(0, CH)
    ok = k < K
    v = tl.load(x_ptr + n * s_x + k, mask=ok)
    wait_prior_grid(PDL)
    tl.store(out_ptr + n * s_o + mma_k_position(k, BK), v, mask=ok)


def mma_order(x: torch.Tensor, block_k: int, dependent_launch: bool = False) -> torch.Tensor:
    """x [N, K] (last dim contiguous) -> a new contiguous [N, K]: `fragment_order(x, block_k)`."""
    N, K = x.shape
    _check_block_k(K, block_k)
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dim")
    out = torch.empty(N, K, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    CH = min(triton.next_power_of_2(K), COLUMNS_A_PROGRAM)
    _mma_order_kernel[(N, triton.cdiv(K, CH))](x, out, K, x.stride(0), out.stride(0), BK=block_k, CH=CH,
                                                 PDL=dependent_launch, num_warps=4,
                                                 **launch_options(dependent_launch))
    return out


__all__ = ["mma_k_position", "mma_order"]
