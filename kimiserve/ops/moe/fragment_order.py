"""The K order of `ops.moe.gluon_decode`'s fragment GEMMs, in plain torch (no Triton needed).

Within each K step of block_k = 128 or 256 columns, physical k = (block_k / 4) t + 4 s + 2 b1 + b0 sits at MMA
position 16 s + 8 b1 + 2 t + b0 (t: the thread of a quad, lane % 4; s: the k16 step; b1: the half of its mma.sync
fragment; b0: the element of a bf16 pair). Thread t then holds the block_k / 4 physical columns from
(block_k / 4) t of each weight row: block_k / 8 bytes of MXFP4 codes under block_k / 128 scales, and word u of
them (physical (block_k / 4) t + 8 u + 2 r + b0, pair r of the shift decode) is its B fragments of k16 steps
2 u and 2 u + 1. The activations are read in the same order, so the sums are the same sums.
"""

from __future__ import annotations

import torch

FRAGMENT_BLOCK_KS = (128, 256)  # K per step: 4 quad threads x 32 or 64 physical columns
FRAGMENT_BLOCK_M = 16  # the decode kernels (mma.sync, `ops.moe.gluon_decode`)
SWAPPED_BLOCK_M = 8  # theirs with swapped operands (the weights as the mma's A, the pairs as N = 8)
WGMMA_BLOCK_MS = (64, 128)  # the prefill kernels (wgmma, `ops.moe.gluon_prefill`): tokens per block = wgmma N
WGMMA_TAIL_BLOCK_MS = (64, 32)  # their tail launches' tiles at block_m 128 (`MoEConfig.wgmma_tails`)
WGMMA_SHARED_BYTES = 227 * 1024  # the most shared memory one program may take on sm_90


def _check_block_k(K: int, block_k: int):
    if block_k not in FRAGMENT_BLOCK_KS or K % block_k:
        raise ValueError(f"the fragment GEMMs take K steps of {FRAGMENT_BLOCK_KS} columns dividing K; got {block_k} "
                         f"for K = {K}")


def mma_position(k: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    """Physical column(s) k -> their MMA-k positions (the same block_k-wide step)."""
    q = k % block_k
    quarter = block_k // 4
    return k - q + (q % quarter // 4) * 16 + (q % 4 // 2) * 8 + (q // quarter) * 2 + q % 2


def fragment_order(x: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    """x [N, K] -> the same values with each block_k-column step in MMA-k order (a new contiguous tensor)."""
    N, K = x.shape
    _check_block_k(K, block_k)
    return x.reshape(N, K // block_k, 4, block_k // 16, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(N, K)


def from_fragment_order(x: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    """The inverse of `fragment_order` (tests, and reading a gate/up output back)."""
    N, K = x.shape
    _check_block_k(K, block_k)
    return x.reshape(N, K // block_k, block_k // 16, 2, 4, 2).permute(0, 1, 4, 2, 3, 5).reshape(N, K)


def grouped_gemm_args(a, w, w_scale, v, v_scale, out, align, a_row_div: int, beta: float,
                      linear_beta: float | None, int32_scales: bool) -> tuple[tuple, bool]:
    """The arguments both fragment kernel families take first (`a_ptr` .. `linear_beta`), and whether the GEMM is
    gated (v given; else w stands in for v, unused): the codes as int32 words, the scales as int32 (4 bytes, one
    128-wide step of a row) where int32_scales."""
    sorted_pairs, bexp, brows, nblk = align
    gated = v is not None
    if not gated:
        v, v_scale = w, w_scale
    w, v = w.view(torch.int32), v.view(torch.int32)
    if int32_scales:
        w_scale, v_scale = w_scale.view(torch.int32), v_scale.view(torch.int32)
    args = (a, w, w_scale, v, v_scale, out, sorted_pairs, bexp, brows, nblk, w.shape[1], a.shape[1], a_row_div,
            a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0), float(beta),
            float(linear_beta or 1.0))
    return args, gated


def check_fragment_shapes(h: int, inter: int, block_m: int, up, down, tails=None) -> str | None:
    """Why the fragment GEMMs cannot run these expert dims and tiles (GemmTiles; None: they can). block_m 16: the
    decode kernels (swap: the weights as the mma's A operand, 16 rows a warp; then block_m 8 too); 64 or 128: the
    prefill (wgmma) kernels, 128 weight rows x 128-wide K steps on 8 warps (or 16, two weight tiles as one: the
    gate/up GEMM, and the down GEMM where h is a multiple of 256), 3 or more stages that fit the shared memory
    (gate/up: up to 6 at block_m 64, 4 at 128). tails: at block_m 128, the tail
    launches (`MoEConfig.wgmma_tails`: tiles of WGMMA_TAIL_BLOCK_MS tokens, largest first, their stages fitting)."""
    if block_m == 128 and tails is not None:
        why = _check_tails(h, tails)
        if why:
            return why
    if block_m in WGMMA_BLOCK_MS:
        if h % 128 or inter % 128:
            return f"the wgmma fragment GEMMs need expert dims that are multiples of 128, got {h} and {inter}"
        for t, weight_tiles in ((up, 2), (down, _down_weight_tiles(h))):
            if (t.block_n, t.block_k, t.split_k, t.swap) != (128, 128, 1, False) or t.num_stages < 3 \
                    or t.num_warps not in (8, 16):
                return (f"block_m {block_m} (the wgmma fragment GEMMs) takes tiles of block_n 128, block_k 128, "
                        f"8 or 16 warps, >= 3 stages, no split-K, no swap; got {t}")
            why = _check_sixteen_warps(t.num_warps, weight_tiles, h) or \
                _check_wgmma_stages(block_m, t.num_stages, weight_tiles)
            if why:
                return why
        return None
    swapped = up.swap and down.swap
    if block_m not in (FRAGMENT_BLOCK_M, SWAPPED_BLOCK_M) or (block_m == SWAPPED_BLOCK_M and not swapped):
        return (f"block_m must be {FRAGMENT_BLOCK_M} (decode; {SWAPPED_BLOCK_M} with swapped tiles) or one of "
                f"{WGMMA_BLOCK_MS} (prefill), got {block_m}")
    if up.swap != down.swap:
        return "the decode fragment GEMMs swap both GEMMs' operands or neither"
    for t, K in ((up, h), (down, inter)):
        if t.block_k not in FRAGMENT_BLOCK_KS or K % t.block_k:
            return f"tiles need block_k in {FRAGMENT_BLOCK_KS} dividing their K; got {t} for K = {K}"
        if t.split_k > K // t.block_k:
            return (f"split_k {t.split_k} leaves a split no K step: K = {K} is {K // t.block_k} steps of "
                    f"{t.block_k}; take at most that many")
        if t.num_warps not in (1, 2, 4, 8) or t.block_n & (t.block_n - 1) or t.block_n < 8 * t.num_warps:
            return f"block_n must be a power of two >= 8 x num_warps (1, 2, 4 or 8), got {t.block_n} and {t.num_warps}"
        if t.swap and t.block_n != 16 * t.num_warps:
            return (f"swapped tiles take 16 weight rows a warp (the mma's M): block_n = 16 x num_warps, got "
                    f"{t.block_n} and {t.num_warps}")
    return None


def _down_weight_tiles(h: int) -> int:
    """The down GEMM's weight tiles a program: two where its N (h) is a multiple of 256 (`paired_down`)."""
    return 2 if h % 256 == 0 else 1


def _check_sixteen_warps(num_warps: int, weight_tiles: int, h: int) -> str | None:
    if num_warps == 16 and weight_tiles == 1:
        return (f"16 warps run two 128-row weight tiles as one: the down GEMM has one where h ({h}) is not a multiple "
                f"of 256; take 8 warps")
    return None


def _check_wgmma_stages(block_m: int, stages: int, weight_tiles: int) -> str | None:
    # a stage: the token tile, each weight tile's codes and scales (the epilogue's [128, block_m] tile reuses the
    # stages' memory)
    smem = stages * (block_m * 256 + weight_tiles * (128 * 64 + 512))
    if smem > WGMMA_SHARED_BYTES:
        return (f"{stages} stages of block_m {block_m} need {smem // 1024} KB of shared memory "
                f"({WGMMA_SHARED_BYTES // 1024} KB a program on sm_90): take fewer stages")
    return None


def _check_tails(h: int, tails) -> str | None:
    sizes = [t.block_m for t in tails]
    if not sizes or any(m not in WGMMA_TAIL_BLOCK_MS for m in sizes) or sizes != sorted(set(sizes), reverse=True):
        return f"wgmma_tails takes tiles of {WGMMA_TAIL_BLOCK_MS} tokens, largest first, each size once; got {sizes}"
    for t in tails:
        if t.num_stages < 3 or not (t.max_registers is None or 24 <= t.max_registers <= 255) \
                or t.num_warps not in (8, 16):
            return f"a wgmma tail takes >= 3 stages, max_registers None or 24..255 and 8 or 16 warps; got {t}"
        why = _check_sixteen_warps(t.num_warps, _down_weight_tiles(h), h)
        if why:
            return why
        why = _check_wgmma_stages(t.block_m, t.num_stages, 2)
        if why:
            return f"wgmma tail {t}: {why}"
    return None


__all__ = ["FRAGMENT_BLOCK_KS", "FRAGMENT_BLOCK_M", "SWAPPED_BLOCK_M", "WGMMA_BLOCK_MS", "WGMMA_SHARED_BYTES",
           "WGMMA_TAIL_BLOCK_MS", "check_fragment_shapes", "fragment_order", "from_fragment_order", "grouped_gemm_args",
           "mma_position"]
