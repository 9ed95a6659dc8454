"""The K order of `ops.moe.gluon_decode`'s fragment GEMMs, in plain torch (no Triton needed).

Within each 128-wide K step, physical k = 32 t + 4 s + 2 b1 + b0 sits at MMA position 16 s + 8 b1 + 2 t + b0
(t: the thread of a quad, lane % 4; s: the k16 step; b1: the half of its mma.sync fragment; b0: the element of
a bf16 pair). Thread t then holds physical k 32 t .. 32 t + 31 of each weight row, 16 bytes of MXFP4 codes with
one scale; word u of them (physical 32 t + 8 u + 2 r + b0, pair r of the shift decode) is the B fragments of
k16 steps 2 u and 2 u + 1. The activations are read in the same order, so the sums are the same sums.
"""

from __future__ import annotations

import torch

FRAGMENT_BLOCK_K = 128  # K per step of the fragment GEMMs: 4 quads x 32 physical k
FRAGMENT_BLOCK_M = 16


def mma_position(k: torch.Tensor) -> torch.Tensor:
    """Physical column(s) k -> their MMA-k positions (the same 128-wide step)."""
    q = k % FRAGMENT_BLOCK_K
    return k - q + (q % 32 // 4) * 16 + (q % 4 // 2) * 8 + (q // 32) * 2 + q % 2


def fragment_order(x: torch.Tensor) -> torch.Tensor:
    """x [N, K] -> the same values with each 128-column step in MMA-k order (a new contiguous tensor)."""
    N, K = x.shape
    if K % FRAGMENT_BLOCK_K:
        raise ValueError(f"the fragment GEMMs need K divisible by {FRAGMENT_BLOCK_K}, got {K}")
    return x.reshape(N, K // 128, 4, 8, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(N, K)


def from_fragment_order(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `fragment_order` (tests, and reading a gate/up output back)."""
    N, K = x.shape
    if K % FRAGMENT_BLOCK_K:
        raise ValueError(f"the fragment GEMMs need K divisible by {FRAGMENT_BLOCK_K}, got {K}")
    return x.reshape(N, K // 128, 8, 2, 4, 2).permute(0, 1, 4, 2, 3, 5).reshape(N, K)


def check_fragment_shapes(h: int, inter: int, block_m: int, tiles: tuple) -> str | None:
    """Why the fragment GEMMs cannot run these expert dims and tiles (GemmTiles; None: they can)."""
    if h % FRAGMENT_BLOCK_K or inter % FRAGMENT_BLOCK_K:
        return f"hidden and intermediate dims must be multiples of {FRAGMENT_BLOCK_K}, got {h} and {inter}"
    if block_m != FRAGMENT_BLOCK_M:
        return f"block_m must be {FRAGMENT_BLOCK_M}, got {block_m}"
    for t in tiles:
        if t.block_k != FRAGMENT_BLOCK_K or t.split_k != 1 or t.swap:
            return f"tiles need block_k {FRAGMENT_BLOCK_K}, no split-K and no swap, got {t}"
        if t.num_warps not in (1, 2, 4, 8) or t.block_n & (t.block_n - 1) or t.block_n < 8 * t.num_warps:
            return f"block_n must be a power of two >= 8 x num_warps (1, 2, 4 or 8), got {t.block_n} and {t.num_warps}"
    return None


__all__ = ["FRAGMENT_BLOCK_K", "FRAGMENT_BLOCK_M", "check_fragment_shapes", "fragment_order", "from_fragment_order",
           "mma_position"]
