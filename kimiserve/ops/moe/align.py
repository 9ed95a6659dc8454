"""The fused MoE's align (`align_blocks`, `ops.moe.triton`'s design step 1): the N k routed (token, slot) pairs grouped
by expert into blocks of block_m rows, on the device, in shapes that depend only on N, k, E and block_m."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.moe.config import max_blocks
from kimiserve.ops.moe.dependent_launch import launch_options, wait_prior_grid

ALIGN_FEW_PAIRS = 128  # up to this many pairs (K3.1: 8 tokens) the alignment compares the pairs' experts pairwise
# up to this many (token, slot) pairs (K3.1: 64 tokens) the alignment is one program, above it chunks of this many:
# a one-program sort of 4096 pairs cost 0.089 ms on the H200 against 0.026 ms for four 1024-pair chunks (session 17)
ALIGN_SMALL_PAIRS = 1024
MAX_ALIGN_EXPERTS = 8192  # more experts: the alignment in torch ops (the chunked kernels hold [*, E] rows)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, bexp_ptr, brows_ptr, nblk_ptr, scratch_ptr, P, E,
                  BM: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr):
    """One program: every pair's row in the expert-sorted, block-padded order (see `align_blocks`)."""
    wait_prior_grid(PDL)
    offs = tl.arange(0, PB)
    ok = offs < P
    e = tl.load(ids_ptr + offs, mask=ok, other=E).to(tl.int32)  # unused slots: bin E, dropped below
    bins = tl.arange(0, EB)
    counts = tl.where(bins < E, tl.histogram(e, EB), 0)
    nb = (counts + BM - 1) // BM
    block_end = tl.cumsum(nb, 0)
    pair_end = tl.cumsum(counts, 0)
    # expert e: its first row minus its first position in the sorted order; the row after its last pair
    tl.store(scratch_ptr + bins, (block_end - nb) * BM - (pair_end - counts))
    tl.store(scratch_ptr + EB + bins, (block_end - nb) * BM + counts)
    tl.store(nblk_ptr, tl.sum(nb, 0))
    keys = tl.sort(e * PB + offs)  # by expert, then pair: the stable order
    tl.debug_barrier()  # the scratch stores above are seen by every thread below
    _scatter_sorted(keys, 0, scratch_ptr, scratch_ptr + EB, sorted_ptr, bexp_ptr, brows_ptr, E, BM, PB)


@triton.jit
def _align_few_kernel(ids_ptr, sorted_ptr, bexp_ptr, brows_ptr, nblk_ptr, P, E, BM: tl.constexpr, PB: tl.constexpr,
                      PDL: tl.constexpr):
    """One program for a few pairs (decode batches): every pair's row from [PB, PB] comparisons of the pairs'
    experts, no expert-wide histogram, scan or sort. Pair i of expert e sits at row start(e) BM + rank(i), rank
    = the pairs of e before it, start(e) = the blocks of the experts below e (each counted at its first pair)."""
    wait_prior_grid(PDL)
    i = tl.arange(0, PB)
    e = tl.load(ids_ptr + i, mask=i < P, other=E).to(tl.int32)  # padding and ids >= E: expert E, dropped
    same = e[:, None] == e[None, :]
    before = i[:, None] < i[None, :]
    count = tl.sum(same.to(tl.int32), 0)  # of pair j's expert
    rank = tl.sum((same & before).to(tl.int32), 0)  # pairs of j's expert before j
    first_blocks = tl.where((rank == 0) & (e < E), (count + BM - 1) // BM, 0)  # each expert's blocks, once
    start = tl.sum(tl.where(e[None, :] < e[:, None], first_blocks[None, :], 0), 1)
    row = start * BM + rank
    real = e < E
    tl.store(sorted_ptr + row, i, mask=real)
    head = real & (rank % BM == 0)
    tl.store(bexp_ptr + row // BM, e, mask=head)
    tl.store(brows_ptr + row // BM, tl.minimum(count - rank, BM), mask=head)
    tl.store(nblk_ptr, tl.sum(first_blocks, 0))


@triton.jit
def _scatter_sorted(keys, first_pair, offsets_ptr, end_ptr, sorted_ptr, bexp_ptr, brows_ptr, E,
                    BM: tl.constexpr, PB: tl.constexpr):
    """Sorted keys (expert * PB + position among PB pairs from first_pair) -> each pair at its row: offsets[e] +
    its position in the sorted order; a block's first row carries the block's expert and its real rows (up to
    end[e], the row after expert e's last pair)."""
    offs = tl.arange(0, PB)
    se = keys // PB
    sok = se < E
    dest = offs + tl.load(offsets_ptr + se, mask=sok, other=0)
    tl.store(sorted_ptr + dest, first_pair + keys % PB, mask=sok)
    head = sok & (dest % BM == 0)
    tl.store(bexp_ptr + dest // BM, se, mask=head)
    tl.store(brows_ptr + dest // BM, tl.minimum(tl.load(end_ptr + se, mask=sok, other=0) - dest, BM), mask=head)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E, PB: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr):
    """Chunk c = program_id of PB pairs: its pairs per expert -> counts[c, :EB] (bins >= E: 0)."""
    wait_prior_grid(PDL)
    c = tl.program_id(0)
    offs = c * PB + tl.arange(0, PB)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=E).to(tl.int32)
    bins = tl.arange(0, EB)
    tl.store(counts_ptr + c * EB + bins, tl.where(bins < E, tl.histogram(e, EB), 0))


@triton.jit
def _align_offsets_kernel(counts_ptr, offsets_ptr, end_ptr, nblk_ptr, C,
                          BM: tl.constexpr, EB: tl.constexpr, CT: tl.constexpr, PDL: tl.constexpr):
    """One program over the chunks' counts [C, EB]: offsets[c, e] = the row of expert e's first pair of chunk c
    minus that pair's position in chunk c's sorted order (so a pair's row is offsets[c, e] + its position), end[e]
    = the row after expert e's last pair, the block count. Two passes over the chunks, CT at a time."""
    wait_prior_grid(PDL)
    bins = tl.arange(0, EB)
    rows = tl.arange(0, CT)
    total = tl.zeros([EB], dtype=tl.int32)
    for c0 in range(0, C, CT):
        ok = (c0 + rows < C)[:, None]
        total += tl.sum(tl.load(counts_ptr + (c0 + rows)[:, None] * EB + bins[None, :], mask=ok, other=0), axis=0)
    nb = (total + BM - 1) // BM
    start = (tl.cumsum(nb, 0) - nb) * BM
    tl.store(end_ptr + bins, start + total)
    tl.store(nblk_ptr, tl.sum(nb, 0))
    before = start  # expert e's rows taken by earlier chunks, from its first row
    for c0 in range(0, C, CT):
        ok = (c0 + rows < C)[:, None]
        cnt = tl.load(counts_ptr + (c0 + rows)[:, None] * EB + bins[None, :], mask=ok, other=0)
        in_chunks = tl.cumsum(cnt, 0) - cnt  # earlier chunks of this tile
        in_experts = tl.cumsum(cnt, 1) - cnt  # a chunk's pairs of lower experts: its sorted order's offset
        tl.store(offsets_ptr + (c0 + rows)[:, None] * EB + bins[None, :],
                 before[None, :] + in_chunks - in_experts, mask=ok)
        before += tl.sum(cnt, axis=0)


@triton.jit
def _align_scatter_kernel(ids_ptr, offsets_ptr, end_ptr, sorted_ptr, bexp_ptr, brows_ptr, P, E,
                          BM: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr):
    """Chunk c = program_id: each pair to its row (stable: by expert, then pair), each block's expert and rows
    from its first pair."""
    wait_prior_grid(PDL)
    c = tl.program_id(0)
    offs = tl.arange(0, PB)
    e = tl.load(ids_ptr + c * PB + offs, mask=c * PB + offs < P, other=E).to(tl.int32)
    keys = tl.sort(e * PB + offs)
    _scatter_sorted(keys, c * PB, offsets_ptr + c * EB, end_ptr, sorted_ptr, bexp_ptr, brows_ptr, E, BM, PB)


def _align_chunks(flat: torch.Tensor, num_experts: int, block_m: int, sorted_pairs, bexp, brows, nblk, pdl: bool):
    """The alignment of many pairs in three launches: chunks of ALIGN_SMALL_PAIRS counted, their offsets, then
    each chunk sorted and scattered (the one-program kernel's work, per chunk)."""
    P, dev = flat.numel(), flat.device
    PB, EB = ALIGN_SMALL_PAIRS, triton.next_power_of_2(num_experts + 1)
    C = triton.cdiv(P, PB)
    counts = torch.empty(C, EB, dtype=torch.int32, device=dev)
    offsets = torch.empty(C, EB, dtype=torch.int32, device=dev)
    end = torch.empty(EB, dtype=torch.int32, device=dev)
    launch = launch_options(pdl)
    _align_count_kernel[(C,)](flat, counts, P, num_experts, PB=PB, EB=EB, PDL=pdl, num_warps=_align_warps(PB),
                              **launch)
    _align_offsets_kernel[(1,)](counts, offsets, end, nblk, C, BM=block_m, EB=EB, CT=max(1, 8192 // EB), PDL=pdl,
                                num_warps=16, **launch)
    _align_scatter_kernel[(C,)](flat, offsets, end, sorted_pairs, bexp, brows, P, num_experts, BM=block_m, PB=PB,
                                EB=EB, PDL=pdl, num_warps=_align_warps(PB), **launch)


def _align_warps(pairs: int) -> int:
    """Warps of a program that sorts `pairs` keys."""
    return 4 if pairs <= 512 else 8 if pairs <= 2048 else 16


def _align_torch(flat: torch.Tensor, num_experts: int, block_m: int, nblocks: int, sorted_pairs, bexp, brows, nblk):
    """The same alignment in torch ops (large batches): no host sync, shapes fixed by the inputs."""
    P, dev = flat.numel(), flat.device
    sorted_e, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    nb = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(nb, 0)
    pair_end = torch.cumsum(counts, 0)
    base = (block_end - nb) * block_m - (pair_end - counts)
    sorted_pairs.scatter_(0, base[sorted_e] + torch.arange(P, device=dev), order.to(torch.int32))
    blocks = torch.arange(nblocks, device=dev)
    e = torch.searchsorted(block_end, blocks, right=True).clamp_(max=num_experts - 1)
    bexp.copy_(e)
    first = (blocks - (block_end - nb)[e]) * block_m  # the block's first row within its expert
    brows.copy_((counts[e] - first).clamp(0, block_m))
    nblk.copy_(block_end[-1:])


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int, use_triton: bool = True,
                 dependent_launch: bool = False):
    """ids [N, k] (expert of each routed slot) -> (sorted_pairs int32 [nblocks * block_m], block_expert
    int32 [nblocks], block_rows int32 [nblocks], num_blocks int32 [1]) with nblocks = max_blocks(N k, E,
    block_m). Rows r of block b = r // block_m hold pair sorted_pairs[r] (pair p = t k + j) for r % block_m <
    block_rows[b]; padding rows are undefined. Only blocks < num_blocks[0] are used (the rest undefined).
    Experts in ascending order, each expert's pairs in ascending pair order. dependent_launch: the Triton kernels
    launched with PDL (`ops.moe.dependent_launch`)."""
    flat = ids.reshape(-1)
    P, dev = flat.numel(), ids.device
    nblocks = max(1, max_blocks(P, num_experts, block_m))
    sorted_pairs = torch.empty(nblocks * block_m, dtype=torch.int32, device=dev)
    bexp = torch.empty(nblocks, dtype=torch.int32, device=dev)
    brows = torch.empty(nblocks, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    if P == 0:
        nblk.zero_()
    elif use_triton and P <= ALIGN_FEW_PAIRS:
        _align_few_kernel[(1,)](flat, sorted_pairs, bexp, brows, nblk, P, num_experts, BM=block_m,
                                PB=max(16, triton.next_power_of_2(P)), PDL=dependent_launch, num_warps=4,
                                **launch_options(dependent_launch))
    elif use_triton and P <= ALIGN_SMALL_PAIRS:
        EB = triton.next_power_of_2(num_experts + 1)
        scratch = torch.empty(2 * EB, dtype=torch.int32, device=dev)
        PB = max(16, triton.next_power_of_2(P))
        _align_kernel[(1,)](flat, sorted_pairs, bexp, brows, nblk, scratch, P, num_experts, BM=block_m, PB=PB, EB=EB,
                            PDL=dependent_launch, num_warps=_align_warps(PB), **launch_options(dependent_launch))
    elif use_triton and num_experts < MAX_ALIGN_EXPERTS:
        _align_chunks(flat, num_experts, block_m, sorted_pairs, bexp, brows, nblk, dependent_launch)
    else:
        _align_torch(flat.long(), num_experts, block_m, nblocks, sorted_pairs, bexp, brows, nblk)
    return sorted_pairs, bexp, brows, nblk


__all__ = ["ALIGN_FEW_PAIRS", "ALIGN_SMALL_PAIRS", "MAX_ALIGN_EXPERTS", "align_blocks"]
