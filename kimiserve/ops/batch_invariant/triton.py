"""Triton batch-invariant matmul (the GPU form of `reference.linear` for one weight matrix).

y[m, n] = sum_k x[m, k] w[n, k], tiled with a configuration fixed by the weight's shape [N, K] alone,
whatever M is (no autotuning, no M-dependent tile choice, M not specialised on: `tile_config`; BM is one
for every shape): every output element is accumulated over K in BLOCK_K steps in increasing k, each step
one `tl.dot` of fixed-shape [BM, BK] x [BK, BN] tiles into the fp32 accumulator, so a row's result does
not depend on how many rows there are or where it sits in its tile (rows past M load as zeros). With
split-K (`split_k`, `SPLIT_K_PROGRAMS`; 0 turns it off) the steps are cut into chunks fixed by the weight's shape
too, each summed from zero and the chunk sums added in chunk order; whether the chunks of a tile run in
one program or in programs of their own (a small M) changes where they run, not the bits. bf16 / fp16 operands of one dtype go through the
tensor cores (fp32 accumulate); anything else is computed in fp32 with IEEE products (no TF32). The
recipe of thinking-machines' batch_invariant_ops and vLLM's batch-invariant mode (one tile config per
dtype, a sequential K loop), as a plain grid rather than a persistent kernel.

It gives other bits than the CPU's tree sum, so an engine and a trainer must both run it (both call
`reference.linear`, which dispatches here on CUDA). Changing a tile config changes the bits (never the
invariance); benchmarks/batch_invariant_matmul.py measures the candidates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CONFIG = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4}
"""The tile configuration of a weight wider than every `NARROW_CONFIGS` entry (every M; BM for every
shape: the device-side expert plan tiles rows by BM). Eight warps: on the H200 (session 5,
benchmarks/batch_invariant_matmul.py) no slower than four at 4 or 2,048 rows for any of K3.1's projection
shapes, and 1.7x faster for KDA's fused q/k/v projection at 4 rows (0.089 vs 0.152 ms)."""


NARROW_CONFIGS: tuple[tuple[int, dict], ...] = (
    (16, {"BM": 64, "BN": 16, "BK": 64, "num_warps": 4, "num_stages": 4}),  # the fp32 router: 1/8 of the products
    (1024, {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4}),  # KDA's beta, MLA's kv_a: 1.2-1.3x
)
"""(largest N, config) in increasing N: a weight of at most that many output rows takes that config
(narrower tiles where `CONFIG` would compute padding columns or leave SMs idle at a few rows); same
BM as `CONFIG`."""


def tile_config(N: int, K: int) -> dict:
    """The tiles of a product with a weight [N, K]: a function of the weight's shape only, never of M
    (so never of the batch): the first of `NARROW_CONFIGS` that covers N, else `CONFIG`."""
    for largest, config in NARROW_CONFIGS:
        if N <= largest:
            return config
    return CONFIG


SPLIT_K_PROGRAMS = 264
"""Split-K (off at 0): a weight with fewer than this many output tiles (`tile_config`'s BN) is cut along K
into `split_k` chunks, so that one row tile has at most (about) this many (tile, chunk) programs. Each chunk is summed
from zero and the chunk sums are added in chunk order, whatever M is (the chunks are a function of the
weight's shape alone); how the work is spread is M's business only: a grid that leaves SMs idle runs one
program per (tile, chunk) and adds their fp32 partials in a second kernel, a larger one runs every chunk
of a tile in one program (no partials in memory), with the same bits. 264 is two programs per H200 SM, what
fits at once with the 8-warp tiles' shared memory (4 stages of 64 x 64 + 64 x 128 bf16: 96 KB). On since
session 7 (H200: a row alone == among 2,048 rows at every `small` projection shape; the matmuls of a 4-row
decode step 7.26 -> 3.80 ms, cuBLAS 3.60; `benchmarks/batch_invariant_matmul.py`, BENCHMARKS.md)."""

SPLIT_K_MAX = 16
"""At most this many K chunks."""

SPLIT_K_MIN_STEPS = 4
"""A K chunk spans at least this many BK steps (the loads pipeline within a chunk)."""


SPLIT_K_NESTED = True
"""The kernel's form of a tile's chunks in one program (the prefill case): False one K loop closing a chunk
at its last step, True a loop over chunks around each chunk's K loop. Same bits (the split-K tests check
both); nested is the faster on the H200 (`benchmarks/batch_invariant_matmul.py`, session 7: a `small` step's
matmuls at 2,048 rows 60.98 against 69.28 ms, at 4 rows 3.80 against 3.85 ms)."""


def split_k(N: int, K: int, config: dict) -> tuple[int, int]:
    """(chunks, BK steps per chunk) of a product with a weight [N, K] under `config`: a function of the
    weight's shape only (`SPLIT_K_PROGRAMS`); (1, all steps) without split-K."""
    steps = triton.cdiv(K, config["BK"])
    tiles = triton.cdiv(N, config["BN"])
    if SPLIT_K_PROGRAMS <= 0 or tiles >= SPLIT_K_PROGRAMS:
        return 1, steps
    want = min(SPLIT_K_PROGRAMS // tiles, SPLIT_K_MAX, steps // SPLIT_K_MIN_STEPS)
    if want <= 1:
        return 1, steps
    chunk = triton.cdiv(steps, want)
    return triton.cdiv(steps, chunk), chunk


@dataclass(frozen=True)
class MatmulPlan:
    """How `matmul` runs a product: the tiles and K chunks (`tile_config`, `split_k`: the weight's shape
    alone, so the bits) and the programs per output tile along K (`parts`: 1, or `chunks` when spread)."""

    config: dict
    chunks: int
    chunk: int
    parts: int

    @property
    def spread(self) -> bool:
        return self.parts > 1


def matmul_plan(B: int, M: int, N: int, K: int, device: torch.device, spread: bool | None = None) -> MatmulPlan:
    """The plan of `matmul` for B products of [M, K] rows with [N, K] weights; `spread` None: spread the
    chunks over programs when the output tiles alone would leave SMs idle."""
    c = tile_config(N, K)
    chunks, chunk = split_k(N, K, c)
    if chunks == 1:
        return MatmulPlan(c, 1, chunk, 1)
    if spread is None:
        spread = triton.cdiv(M, c["BM"]) * triton.cdiv(N, c["BN"]) * B < _sm_count(device)
    return MatmulPlan(c, chunks, chunk, chunks if spread else 1)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The device's SM count (the interpreter's CPU: an H200's 132)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


_TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, B, sxb, sxm, sxk, swb, swn, swk, syb, sym, syn, chunk, span,
                   a_ptr, sam, san,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, CHUNKED: tl.constexpr,
                   NESTED: tl.constexpr, ADD: tl.constexpr):
    """One [BM, BN] output tile of batch b = z % B over the `span` K steps (of BK) from (z // B) * span.
    CHUNKED: K is cut into chunks of `chunk` steps from k = 0, each accumulated from zero and added to the
    tile's total in increasing chunk order. A program either runs every chunk (span = all steps, z = b)
    and stores the total, or one chunk (span = chunk) and stores that chunk's fp32 sum to block z of y,
    which `_sum_parts_kernel` adds up in the same order: the same bits either way. NESTED (CHUNKED): the chunks as
    a loop around each chunk's K loop instead of one K loop that closes a chunk at its last step (the
    same products and adds; which one pipelines better is for the GPU to say: `SPLIT_K_NESTED`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_z = tl.program_id(2)
    pid_b = (pid_z % B).to(tl.int64)
    steps = tl.cdiv(K, BK)
    i0 = (pid_z // B) * span
    i1 = tl.minimum(i0 + span, steps)
    x_ptr += pid_b * sxb
    w_ptr += pid_b * swb
    y_ptr += pid_z.to(tl.int64) * syb
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)  # offsets past 2^31 elements (a vocab-sized weight)
    x_ptrs = x_ptr + rm64[:, None] * sxm + (i0 * BK + rk[None, :]) * sxk
    w_ptrs = w_ptr + rn64[None, :] * swn + (i0 * BK + rk[:, None]) * swk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    if NESTED:
        for c in range(i0 // chunk, tl.cdiv(i1, chunk)):
            part = tl.zeros((BM, BN), dtype=tl.float32)
            for i in range(c * chunk, tl.minimum(c * chunk + chunk, i1)):
                k0 = i * BK
                a = tl.load(x_ptrs + (k0 - i0 * BK) * sxk, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
                b = tl.load(w_ptrs + (k0 - i0 * BK) * swk, mask=(rn[None, :] < N) & (k0 + rk[:, None] < K), other=0.0)
                if IEEE:
                    part = tl.dot(a.to(tl.float32), b.to(tl.float32), part, input_precision="ieee")
                else:
                    part = tl.dot(a, b, part)
            total += part
    else:
        for i in range(i0, i1):
            k0 = i * BK
            a = tl.load(x_ptrs, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
            b = tl.load(w_ptrs, mask=(rn[None, :] < N) & (k0 + rk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if CHUNKED:
                if ((i + 1) % chunk == 0) | (i + 1 == i1):  # a chunk's last step
                    total += acc
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
            x_ptrs += BK * sxk
            w_ptrs += BK * swk
    out = total if CHUNKED else acc
    if ADD:  # the addend (B = 1) onto the fp32 total, one rounding
        out += tl.load(a_ptr + rm64[:, None] * sam + rn64[None, :] * san, mask=(rm[:, None] < M) & (rn[None, :] < N),
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + rm64[:, None] * sym + rn64[None, :] * syn, out.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_parts_kernel(p_ptr, y_ptr, numel, parts, a_ptr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    """y = the fp32 sum of `parts` contiguous blocks of `numel` partials, added in block order from zero
    (ADD: then the contiguous addend a, as `_matmul_kernel` adds it)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, parts):
        total += tl.load(p_ptr + s * numel + offs, mask=mask, other=0.0)
    if ADD:
        total += tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e2m1_times_pow2(code, biased):
    """fp32 (e2m1 value of the low 4 bits of `code`) * 2^(biased - 127), built from the bits (exact)."""
    e = (code >> 1) & 3
    m = code & 1
    mag_bits = tl.where(e == 0, tl.where(m == 1, 0x3F000000, 0), ((e + 126) << 23) | (m << 22))
    value = (mag_bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    scale = tl.where(biased > 0, biased << 23, 0x400000).to(tl.float32, bitcast=True)
    return value * scale


@triton.jit(do_not_specialize=["M"])
def _matmul_mxfp4_kernel(x_ptr, p_ptr, s_ptr, y_ptr, M, N, K, sxm, sxk, spn, ssn, sym, syn,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm64[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        mw = (rn[None, :] < N) & (kk[:, None] < K)
        byte = tl.load(p_ptr + rn64[None, :] * spn + (kk[:, None] // 2), mask=mw, other=0).to(tl.int32)
        code = (byte >> ((kk[:, None] % 2) * 4)) & 0xF
        biased = tl.load(s_ptr + rn64[None, :] * ssn + (kk[:, None] // 32), mask=mw, other=0).to(tl.int32)
        b = tl.where(mw, _e2m1_times_pow2(code, biased), 0.0).to(a.dtype)
        acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rm64[:, None] * sym + rn64[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_mxfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ W^T for the MXFP4 weight W [N, K] given as packed codes [N, K/2] and
    ue8m0 scales [N, K/32], dequantised tile by tile in the kernel to x's dtype exactly as
    `ops.quant.reference.dequantize_mxfp4` does (e2m1 values times powers of two are exact), then the
    tiles, order and accumulation of `matmul`: batch-invariant, and the bits of
    `matmul(x, dequantize_mxfp4(packed, scales, x.dtype))` without the [N, K] weight in memory."""
    if x.dim() != 2 or packed.dim() != 2 or x.shape[1] != 2 * packed.shape[1] or scales.shape != (packed.shape[0], x.shape[1] // 32):
        raise ValueError(f"matmul_mxfp4 needs x [M, K], packed [N, K/2], scales [N, K/32], got {tuple(x.shape)}, "
                         f"{tuple(packed.shape)}, {tuple(scales.shape)}")
    if x.dtype not in _TENSOR_CORE_DTYPES:
        raise ValueError(f"matmul_mxfp4 runs bf16 / fp16 activations, got {x.dtype}")
    M, K = x.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M and N:
        c = tile_config(N, K)
        grid = (triton.cdiv(M, c["BM"]), triton.cdiv(N, c["BN"]))
        _matmul_mxfp4_kernel[grid](x, packed, scales, y, M, N, K, x.stride(0), x.stride(1), packed.stride(0),
                                   scales.stride(0), y.stride(0), y.stride(1), BM=c["BM"], BN=c["BN"], BK=c["BK"],
                                   num_warps=c["num_warps"], num_stages=c["num_stages"])
    return y


@triton.jit
def _grouped_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr, rows_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr,
                           N, K, sxm, sxk, swe, swn, swk, sse, ssn, sym, syn,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr,
                           IEEE: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if end <= start:  # an unused tile of a device-side plan (`TilePlan`)
        return
    e = tl.load(tile_group_ptr + tile).to(tl.int64)
    ri = start + tl.arange(0, BM)
    mrow = ri < end
    rows = tl.load(rows_ptr + ri, mask=mrow, other=0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rn64 = rn.to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :] * sxk, mask=mrow[:, None] & (kk[None, :] < K), other=0.0)
        mw = (rn[None, :] < N) & (kk[:, None] < K)
        if MXFP4:
            byte = tl.load(w_ptr + e * swe + rn64[None, :] * swn + (kk[:, None] // 2), mask=mw, other=0).to(tl.int32)
            code = (byte >> ((kk[:, None] % 2) * 4)) & 0xF
            biased = tl.load(s_ptr + e * sse + rn64[None, :] * ssn + (kk[:, None] // 32), mask=mw, other=0).to(tl.int32)
            b = tl.where(mw, _e2m1_times_pow2(code, biased), 0.0).to(a.dtype)
            acc = tl.dot(a, b, acc)
        else:
            b = tl.load(w_ptr + e * swe + rn64[None, :] * swn + kk[:, None] * swk, mask=mw, other=0.0)
            if IEEE:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rows[:, None] * sym + rn64[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=mrow[:, None] & (rn[None, :] < N))


@dataclass(frozen=True)
class TilePlan:
    """Rows grouped for `grouped_matmul`, planned on the device (no host sync, fixed shapes: a CUDA graph
    can capture it): `order` [M] the rows sorted by group (stable; negative groups last, left out), and
    `num_tiles` = cdiv(M, BM) + min(G, M) tiles of at most BM rows of one group each (`tile_group`,
    `tile_start`, `tile_end` into `order`; the tiles past the groups' own are empty and return at once).
    `groups` [M] is kept for the backward's per-group loop."""

    groups: torch.Tensor
    order: torch.Tensor
    tile_group: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor

    @classmethod
    def of(cls, groups: torch.Tensor, num_groups: int) -> "TilePlan":
        """groups int [M] in [0, num_groups) (negative: no group, zero rows)."""
        M, G, bm = groups.shape[0], num_groups, CONFIG["BM"]
        key = torch.where(groups < 0, G, groups).to(torch.int64)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(G + 1, dtype=torch.int64, device=groups.device).scatter_add_(0, key, torch.ones_like(key))[:G]
        row_end = torch.cumsum(counts, 0)
        tiles = (counts + bm - 1) // bm
        tile_end = torch.cumsum(tiles, 0)  # group g owns tiles [tile_end[g] - tiles[g], tile_end[g])
        t = torch.arange(triton.cdiv(M, bm) + min(G, M), device=groups.device)
        g = torch.searchsorted(tile_end, t, right=True).clamp(max=max(G - 1, 0))
        start = row_end[g] - counts[g] + (t - (tile_end[g] - tiles[g])) * bm
        end = torch.minimum(start + bm, row_end[g])
        used = t < tile_end[-1] if G else torch.zeros_like(t, dtype=torch.bool)
        return cls(groups, order, g, torch.where(used, start, 0), torch.where(used, end, 0))

    def host_groups(self) -> list[tuple[int, torch.Tensor]]:
        """(group, its rows) for each group present, in group order (one host sync: the backward's loop)."""
        present = torch.unique(self.groups[self.groups >= 0]).tolist()
        return [(g, torch.nonzero(self.groups == g)[:, 0]) for g in present]


def grouped_matmul(x: torch.Tensor, weights, plan: TilePlan, out_dtype: torch.dtype = torch.float32,
                   every_row: bool = False) -> torch.Tensor:
    """Row i of x [M, K] times its group's weight (`plan`, `TilePlan.of(groups)`; rows of negative groups
    are left zero): weights [G, N, K], or an MXFP4 (packed [G, N, K/2], scales [G, N, K/32]) pair ->
    [M, N] in out_dtype. One launch: each tile of BM rows belongs to one group, with the tiles, K order
    and accumulation of `matmul` (`matmul_mxfp4`), so a row gets the bits of `matmul(x[rows], weights[g])`
    (those tests check it), whatever the other rows and their groups. every_row: the caller's promise that no
    group is negative (every row is then written by its tile: the output is not zero-filled first)."""
    mxfp4 = isinstance(weights, tuple)
    packed, scales = weights if mxfp4 else (weights, weights)
    M, K = x.shape
    N = packed.shape[1]
    y = (torch.empty if every_row else torch.zeros)(M, N, dtype=out_dtype, device=x.device)
    c = tile_config(N, K)
    num_tiles = plan.tile_group.shape[0]
    if num_tiles == 0 or N == 0:
        return y
    if mxfp4:
        strides = (packed.stride(0), packed.stride(1), 1, scales.stride(0), scales.stride(1))
        ieee = False
    else:
        strides = (packed.stride(0), packed.stride(1), packed.stride(2), 0, 0)
        ieee = not (x.dtype == packed.dtype and x.dtype in _TENSOR_CORE_DTYPES)
    grid = (num_tiles, triton.cdiv(N, c["BN"]))
    _grouped_matmul_kernel[grid](x, packed, scales, y, plan.order, plan.tile_group, plan.tile_start, plan.tile_end,
                                 N, K, x.stride(0), x.stride(1), *strides, y.stride(0), y.stride(1),
                                 BM=c["BM"], BN=c["BN"], BK=c["BK"], MXFP4=mxfp4, IEEE=ieee,
                                 num_warps=c["num_warps"], num_stages=c["num_stages"])
    return y


def matmul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32,
           spread: bool | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in `out_dtype` (the fp32 sum rounded once), batch-invariant
    (see the module doc). Also batched: x [B, M, K] and w [B, N, K] -> [B, M, N], each b on its own
    (the same tiles as B separate calls). With split-K chunks (`split_k`), `spread` says whether each
    (tile, chunk) gets its own program and the partials a second kernel (None: when the tiles alone
    would leave SMs idle); the bits are the same either way. addend [M, N] (2-D products only): added to
    each fp32 total before its one rounding to out_dtype (an elementwise epilogue: a row's bits stay its own)."""
    batched = x.dim() == 3
    if addend is not None and (batched or addend.shape != (x.shape[0], w.shape[0])):
        raise ValueError(f"matmul's addend must be [M, N] = {(x.shape[0], w.shape[0])} of a 2-D product, got "
                         f"{tuple(addend.shape)}")
    if x.dim() not in (2, 3) or w.dim() != x.dim() or x.shape[-1] != w.shape[-1] or (batched and x.shape[0] != w.shape[0]):
        raise ValueError(f"matmul needs x [M, K] and w [N, K] (or [B, M, K] and [B, N, K]), got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    x3, w3 = (x, w) if batched else (x.unsqueeze(0), w.unsqueeze(0))
    B, M, K = x3.shape
    N = w3.shape[1]
    y = torch.empty(B, M, N, dtype=out_dtype, device=x.device)
    if B and M and N:
        ieee = not (x.dtype == w.dtype and x.dtype in _TENSOR_CORE_DTYPES)
        plan = matmul_plan(B, M, N, K, x.device, spread)
        c, parts = plan.config, plan.parts
        out = y if parts == 1 else torch.empty(parts * B, M, N, dtype=torch.float32, device=x.device)
        if addend is not None and parts > 1:
            addend = addend.contiguous()  # the partials' sum adds it flat
        a = addend if addend is not None else out
        _matmul_kernel[(triton.cdiv(M, c["BM"]), triton.cdiv(N, c["BN"]), parts * B)](
            x3, w3, out, M, N, K, B, *x3.stride(), *w3.stride(), *out.stride(), plan.chunk,
            plan.chunk if parts > 1 else triton.cdiv(K, c["BK"]), a, a.stride(-2), a.stride(-1), BM=c["BM"], BN=c["BN"],
            BK=c["BK"], IEEE=ieee, CHUNKED=plan.chunks > 1, NESTED=SPLIT_K_NESTED and plan.chunks > 1,
            ADD=addend is not None and parts == 1, num_warps=c["num_warps"], num_stages=c["num_stages"])
        if parts > 1:
            numel = B * M * N
            _sum_parts_kernel[(triton.cdiv(numel, SUM_BLOCK),)](out, y, numel, parts, a, BLOCK=SUM_BLOCK,
                                                                ADD=addend is not None, num_warps=4)
    return y if batched else y[0]


SUM_BLOCK = 1024
"""Elements per program of the partials' sum."""
