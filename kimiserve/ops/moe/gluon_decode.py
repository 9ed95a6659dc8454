"""The fused MoE's decode GEMMs as Gluon kernels whose mma.sync operands are loaded as register fragments.

Why. Triton lays a dequantised weight tile out for its MMAs with 8 consecutive K values per thread (kWidth 8),
and then assembles every activation fragment from shared-memory loads with register moves: 0.9 of the 3.6
instructions per weight of the decode gate/up loop (benchmarks/moe_layer.py --sass), on the integer pipe that
already carries the MXFP4 decode. Here the layouts are explicit (`triton.experimental.gluon`): mma.sync
m16n8k16 with kWidth 2 on both operands, each thread holding exactly the values its fragments need (2.5 / 2.6
instructions a weight for gate/up / down). And a K step is 256 columns where it divides K: each weight row then
gives 128 contiguous bytes a step; the 64 bytes of a 128-wide step cap any kernel's weight reads near 60% of the
copy bandwidth on the H200 (benchmarks/moe_access_pattern.py).

The K order ("MMA-k order", `ops.moe.fragment_order`). The sum over K is the same in any order, so the MMA's K
positions are a permutation of the physical ones, the same for both operands, chosen so that thread t of a quad
(lane % 4) holds whole words of the shift layout: within each K step of BK columns, physical
k = (BK / 4) t + 4 s + 2 b1 + b0 sits at MMA position 16 s + 8 b1 + 2 t + b0 (s the k16 step, b1 the fragment's
half, b0 the element of a pair).
- Weights (`mxfp4_layout`'s shift layout, unchanged): thread t loads, per weight row, the BK / 8 bytes of codes of
  physical k (BK / 4) t onwards (one or two 128-bit loads, BK / 128 ue8m0 scales); the shift decode of its word u
  gives the four bf16 pairs that are exactly its B fragments of k16 steps 2u and 2u + 1. No shared memory.
- Activations: read in MMA-k order (`fragment_order` of x for the gate/up GEMM; the gate/up GEMM stores the
  activation's columns in the down GEMM's order), a step's [16, BK] tile staged through shared memory (two
  buffers, one barrier a step) and read with ldmatrix into the A fragments.

Scope: bf16 activations, MXFP4 weights in the shift layout, 16-row blocks (the decode regime), K steps of 128 or
256 columns dividing K, block_n a power of two >= 8 x num_warps (num_stages is not used). Each step's weights and
activation tile are loaded a step ahead (the loop unrolled by two, so that no prefetched register is copied). The
tail tile's extra weight rows read the last row (clamped) and are not stored; a block's padding rows are zeros
(their loads masked off) and not stored. Split along K (`GemmTiles.split_k`, up to one split a K step), each
program stores its fp32 sums and a reduce finishes the GEMM (`ops.moe.epilogue`): `default_config` splits the gate/up
GEMM in two where its grid makes over one wave and under two, so that its last wave is about as full as its first.

Measured and removed (session 17, H200, K3.1 shape; BENCHMARKS.md "Session 17"): the weight words through a
cp.async ring of 3-4 slots (12-35% slower at 1-256 tokens), the weights two steps ahead in registers (11-34%
slower), and both GEMMs in one launch with the down programs waiting on per-block counts of finished gate/up
programs (at 1 token the same 106 us as the two launches back to back, 5-15% slower at 16-64 tokens): neither the
bytes in flight nor the launches' partial last waves hold a decode GEMM near 60% of the copy rate; ncu puts the
ALU pipe (the e2m1 decode's rotates and masks) highest, at 56% of its peak.

Power (session 18, BENCHMARKS.md "Session 18"). At 16-64 tokens, layers of these GEMMs back to back hold the H200
at its 700 W cap and its SM clock drops to 1300-1800 MHz, so a weight's energy counts as well as its bytes: the
shift decode's non-wrapping rotates as shifts (part of them on the FMA pipe) and the unloaded padding rows took 8%
off a layer there. At 1 token (1980 MHz throughout) the GEMMs' one or two waves are what hold them (2.4-2.9 TB/s
against 3.2-3.3 at 16 tokens): the down GEMM is capped at 72 registers where that makes its grid one wave
(`ops.moe.config.default_config`).

Measured and removed (session 21, H200): with PDL on (`MoEConfig.dependent_launch`, default on sm_90+; a program
loads its block's expert, rows and pair ids and its first K step's weights before it waits for the kernel that
wrote its activations), prefetching into L2 lost at 1 token: each gate/up program prefetching the first 4 K steps of
its share of its expert's down weights (0.1183 ms a layer against 0.1103), and each program prefetching its own
weight lines 2 K steps ahead of its loads (0.1133).

Measured and removed (session 24, H100, K3.1 at 1 token in graphs of 8 layers; BENCHMARKS.md "Session 24 on an
H100"): the split gate/up GEMM's last split of each tile reducing the tile's sums itself, and the down GEMM's program
that stores a token's last pair combining the token (counts zeroed by x's MMA-k copy, a GPU-scope fence, an
acquire-release add), which took the reduce and the combine launches out of the chain: the GEMMs were 4 us slower
and the layer made 79.2-79.4% of the bytes roofline against the default's 80.3-81.6%.

Swapped operands (`GemmTiles.swap`; `default_config`'s form up to 5 rows an expert since session 21): the decoded
weights as mma.sync's A operand (16 weight rows a warp: block_n = 16 num_warps; the loads put row (BN / 2) rep +
8 w + g where the A operand's row 16 w + 8 rep + g is) and the block's pairs as N, so blocks of 8 pairs fill an n8
MMA. At block_m 8 the gate/up loop takes half the HMMAs and activation fragment loads (1182 instructions for two K
steps against 1285) and 126 registers, four programs an SM against three (sm_90 builds). At 1 token a K step of a
program takes ~2.4 us against ~1 us of DRAM latency, so the issue rate, not the bytes in flight, holds the kernel:
on the H200 the swapped form is 1.09-1.19x the unswapped one at 1-256 tokens (BENCHMARKS.md, session 21).

`ops.moe.triton` runs these when `MoEConfig.fragments` is set (`ops.moe.config.default_config` sets it for decode
batches where they fit); its module doc has the rest of the contract.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kimiserve.ops.moe.dependent_launch import gdc_launch_dependents, gdc_wait, launch_options
from kimiserve.ops.moe.epilogue import _activate
from kimiserve.ops.moe.fragment_order import fragment_order, grouped_gemm_args
from kimiserve.ops.moe.mma_order import mma_k_position
from kimiserve.ops.moe.triton import _ACT, _LUT_CONSTRAINTS, _SHIFT_ASM_C


@gluon.jit
def _b_fragments(words, sc, BN: gl.constexpr, BK: gl.constexpr, LB: gl.constexpr):
    """Shift-layout words [BN, 4 (t), 4 G (g, u)] and ue8m0 scales [BN, 4 (t), G (g)], G = BK / 128 -> B [BK, BN]
    bf16 in MMA-k order, in the mma's operand layout (trivial conversions: every value already sits in its
    thread)."""
    return gl.convert_layout(gl.permute(_decoded(words, sc, BN, BK), (1, 0)), LB, assert_trivial=True)


@gluon.jit
def _a_fragments(words, sc, BN: gl.constexpr, BK: gl.constexpr, LA: gl.constexpr):
    """The same words as the A operand [BN, BK] (the swapped form, M = weight rows): the loads put weight row
    n = (BN / 2) rep + 8 w + g in lane 4 g + t of warp w, where the mma's row m = 16 w + 8 rep + g is (trivial)."""
    v = gl.reshape(gl.permute(gl.reshape(_decoded(words, sc, BN, BK), (2, BN // 16, 8, BK)), (1, 0, 2, 3)), (BN, BK))
    return gl.convert_layout(v, LA, assert_trivial=True)


@gluon.jit
def _decoded(words, sc, BN: gl.constexpr, BK: gl.constexpr):
    """Shift-layout words [BN, 4 (t), 4 G] and scales [BN, 4 (t), G] -> [BN, BK] bf16 in MMA-k order."""
    words = gl.reshape(words, (BN, 4, BK // 128, 4))
    sc = gl.convert_layout(sc, gl.SliceLayout(3, words.type.layout), assert_trivial=True)
    s16 = (sc.to(gl.int32) + 126) << 7  # 2^(s - 1) as bf16 bits (see ops.moe.triton's "shift" dequant)
    s2 = s16 | (s16 << 16)
    s2 = gl.broadcast(gl.expand_dims(s2, 3), words)[0]
    e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
        _SHIFT_ASM_C, _LUT_CONSTRAINTS, [words, s2], dtype=(gl.bfloat16, ) * 8, is_pure=True, pack=1)
    # code 2r + b0 of word (t, g, u) is physical k (BK / 4) t + 32 g + 8 u + 2r + b0; join appends its new dim last
    v = gl.join(gl.join(gl.join(e0, e1), gl.join(e2, e3)), gl.join(gl.join(e4, e5), gl.join(e6, e7)))
    # [BN, t, g, u, b0, r & 1, r >> 1] -> MMA position 128 g + 32 u + 16 (r >> 1) + 8 (r & 1) + 2t + b0
    return gl.reshape(gl.permute(v, (0, 2, 3, 6, 5, 1, 4)), (BN, BK))


@gluon.jit
def _load_weights(w_e, ws_e, v_e, vs_e, w_off, s_off, step, BK: gl.constexpr, GATED: gl.constexpr):
    """One K step's weight words and scales of W (and V where GATED; else W's again, unused)."""
    w = gl.load(w_e + w_off + step * (BK // 8))
    s = gl.load(ws_e + s_off + step * (BK // 32))
    if GATED:
        v = gl.load(v_e + w_off + step * (BK // 8))
        t = gl.load(vs_e + s_off + step * (BK // 32))
    else:
        v = w
        t = s
    return w, s, v, t


@gluon.jit
def _mma_step(a_buf, w, s, v, t, acc, acc2, BN: gl.constexpr, BK: gl.constexpr, LA: gl.constexpr,
              LB: gl.constexpr, GATED: gl.constexpr, SWAP: gl.constexpr):
    """acc (+ acc2) += the activation tile in shared memory times one K step of W (and V); SWAP: the weights as the
    mma's A operand and the activations as B (acc [BN, BM])."""
    if SWAP:
        x = a_buf.permute((1, 0)).load(LB)
        acc = mma_v2(_a_fragments(w, s, BN, BK, LA), x, acc)
        if GATED:
            acc2 = mma_v2(_a_fragments(v, t, BN, BK, LA), x, acc2)
    else:
        a = a_buf.load(LA)
        acc = mma_v2(a, _b_fragments(w, s, BN, BK, LB), acc)
        if GATED:
            acc2 = mma_v2(a, _b_fragments(v, t, BN, BK, LB), acc2)
    return acc, acc2


@gluon.jit
def _register_loop(a_smem, g_ptrs, g_mask, w_e, ws_e, v_e, vs_e, w_off, s_off, steps, acc, acc2, w_c, s_c, v_c, t_c,
                   BN: gl.constexpr, BK: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, GATED: gl.constexpr,
                   SWAP: gl.constexpr):
    """The K loop with each step's weights loaded a step ahead into registers (the first step's, w_c .. t_c, by the
    caller), unrolled by two so that each loaded value is used where it was loaded into."""
    a_smem.index(0).store(gl.load(g_ptrs, mask=g_mask, other=0.0))
    gl.thread_barrier()
    for i in range(steps // 2):
        j = gl.minimum(2 * i + 1, steps - 1)
        a_next = gl.load(g_ptrs + j * BK, mask=g_mask, other=0.0)
        w_n, s_n, v_n, t_n = _load_weights(w_e, ws_e, v_e, vs_e, w_off, s_off, j, BK, GATED)
        acc, acc2 = _mma_step(a_smem.index(0), w_c, s_c, v_c, t_c, acc, acc2, BN, BK, LA, LB, GATED, SWAP)
        a_smem.index(1).store(a_next)  # buffer 1 was last read before the previous barrier
        gl.thread_barrier()
        j = gl.minimum(2 * i + 2, steps - 1)  # past the end: the last step again, never used
        a_next = gl.load(g_ptrs + j * BK, mask=g_mask, other=0.0)
        w_c, s_c, v_c, t_c = _load_weights(w_e, ws_e, v_e, vs_e, w_off, s_off, j, BK, GATED)
        acc, acc2 = _mma_step(a_smem.index(1), w_n, s_n, v_n, t_n, acc, acc2, BN, BK, LA, LB, GATED, SWAP)
        a_smem.index(0).store(a_next)
        gl.thread_barrier()
    if steps % 2:
        acc, acc2 = _mma_step(a_smem.index(0), w_c, s_c, v_c, t_c, acc, acc2, BN, BK, LA, LB, GATED, SWAP)
    return acc, acc2


@gluon.jit
def _fragment_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, v_ptr, vs_ptr, out_ptr, sorted_ptr, bexp_ptr, brows_ptr, nblk_ptr,
    N_OUT, K, A_ROW_DIV, s_am, s_we, s_wn, s_se, s_sn, s_om, beta, linear_beta, s_ps,
    GATED: gl.constexpr, ACT: gl.constexpr, LINEAR_TANH: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
    OUT_BK: gl.constexpr, NUM_WARPS: gl.constexpr, PDL: gl.constexpr, SWAP: gl.constexpr = False,
    BM: gl.constexpr = 16, SPLIT: gl.constexpr = 1,
):
    """One (block of BM pairs, BN output columns): out[pair, cols] = act(A W^T, A V^T) (GATED, stored at the
    columns' MMA-k positions for a down GEMM of OUT_BK-wide steps) or A W^T (stored in place), rounded to bf16.
    PDL: launched with programmatic dependent launch, A read only after the wait (`ops.moe.dependent_launch`). SWAP
    (`GemmTiles.swap`): the weights as the mma's A operand (M = weight rows, BN = 16 NUM_WARPS) and the block's BM
    (8 or 16) pairs as N, the accumulators [BN, BM]: half the registers of the activation fragments at BM 8.
    SPLIT > 1 (`GemmTiles.split_k`): SPLIT programs a (block, column tile), split s running K steps
    [s steps / SPLIT, (s + 1) steps / SPLIT), each storing its fp32 sums unrounded at the physical columns: W's at
    out_ptr + s s_ps (an fp32 buffer), V's at out_ptr + (s + SPLIT) s_ps."""
    G: gl.constexpr = BK // 128
    WPC: gl.constexpr = [NUM_WARPS, 1] if SWAP else [1, NUM_WARPS]
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=WPC, instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # weight words [BN, 4 (t), 4 G]: row 8 w + g (+ 8 NUM_WARPS j) in lane 4 g + t of warp w, as in the mma; scales
    # [BN, 4 (t), G]
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 4 * G], [8, 4, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.BlockedLayout([1, 1, G], [8, 4, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    pid = gl.program_id(0)
    if SPLIT > 1:  # the splits of a tile next to each other in the launch order
        split = pid % SPLIT
        pid = pid // SPLIT
    n_tiles = gl.cdiv(N_OUT, BN)
    b = pid // n_tiles
    # the block's expert and rows loaded together with the block count, as gluon_prefill's programs do (entries past
    # it are undefined, in bounds, and unused; a used block has e >= 0 and nrows >= 1, and testing them keeps the
    # loads above the exit): one global round trip less before the first weights
    e = gl.load(bexp_ptr + b).to(gl.int64)
    nrows = gl.load(brows_ptr + b)
    if (b >= gl.load(nblk_ptr)) | (e < 0) | (nrows < 1):
        return
    nt = pid % n_tiles
    rows_s = gl.minimum(nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS))), N_OUT - 1)
    quads_s = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS)))
    groups = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))
    s_off = gl.expand_dims(gl.expand_dims(rows_s, 1) * s_sn + gl.expand_dims(quads_s, 0) * G, 2) + \
        gl.expand_dims(gl.expand_dims(groups, 0), 1)
    rows_w = gl.minimum(nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW))), N_OUT - 1)
    quads_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    words = gl.arange(0, 4 * G, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    w_off = gl.expand_dims(gl.expand_dims(rows_w, 1) * s_wn + gl.expand_dims(quads_w, 0) * (4 * G), 2) + \
        gl.expand_dims(gl.expand_dims(words, 0), 1)
    steps = K // BK
    first = 0
    if SPLIT > 1:
        first = split * steps // SPLIT
        steps = (split + 1) * steps // SPLIT - first
    w_e = w_ptr + e * s_we + first * (BK // 8)
    ws_e = ws_ptr + e * s_se + first * (BK // 32)
    v_e = v_ptr + e * s_we + first * (BK // 8)
    vs_e = vs_ptr + e * s_se + first * (BK // 32)
    ACC: gl.constexpr = [BN, BM] if SWAP else [BM, BN]
    acc = gl.zeros(ACC, gl.float32, MMA)
    acc2 = gl.zeros(ACC, gl.float32, MMA)
    # the activation tile a step ahead through shared memory (16-byte loads, ldmatrix into the A fragments), two
    # buffers, one barrier a step; the weights a step ahead in registers (`_register_loop`)
    TK: gl.constexpr = BK // 8 if BK // 8 < 32 else 32
    LG: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [NUM_WARPS, 1], [1, 0])
    rg = gl.arange(0, BM, layout=gl.SliceLayout(1, LG))
    pg = gl.load(sorted_ptr + b * BM + rg, mask=rg < nrows, other=0).to(gl.int64)
    kg = gl.arange(0, BK, layout=gl.SliceLayout(0, LG))
    g_ptrs = gl.expand_dims(a_ptr + (pg // A_ROW_DIV) * s_am + first * BK, 1) + gl.expand_dims(kg, 0)
    # a block's padding rows are not read (zeros): at 1-2 routed rows a block most of its activation loads
    g_mask = gl.broadcast(gl.expand_dims(rg < nrows, 1), g_ptrs)[0]
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BK],
                                       gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    w_c, s_c, v_c, t_c = _load_weights(w_e, ws_e, v_e, vs_e, w_off, s_off, 0, BK, GATED)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc, acc2 = _register_loop(a_smem, g_ptrs, g_mask, w_e, ws_e, v_e, vs_e, w_off, s_off, steps, acc, acc2, w_c, s_c,
                               v_c, t_c, BN, BK, LA, LB, GATED, SWAP)
    if SWAP:  # [BN, BM]: row m = 16 w + 8 rep + g holds weight row n = (BN / 2) rep + 8 w + g
        acc = gl.permute(acc, (1, 0))
        acc2 = gl.permute(acc2, (1, 0))
        m = gl.arange(0, BN, layout=gl.SliceLayout(0, acc.type.layout))
        cols = nt * BN + (m // 16) * 8 + m % 8 + (m // 8 % 2) * (BN // 2)
        ro = gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
    else:
        cols = nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
        ro = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    row_ok = ro < nrows
    po = gl.load(sorted_ptr + b * BM + ro, mask=row_ok, other=0).to(gl.int64)
    if SPLIT > 1:  # the sums unrounded, the activation in the reduce (`ops.moe.epilogue._reduce_act_kernel`)
        ptrs = out_ptr + split * s_ps + gl.expand_dims(po * s_om, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N_OUT, 0)
        gl.store(ptrs, acc, mask=mask)
        if GATED:
            gl.store(ptrs + SPLIT * s_ps, acc2, mask=mask)
    else:
        if GATED:  # gate and up rounded to bf16, the activation in fp32 (the Triton kernels' epilogue)
            y = _activate(acc, acc2, beta, linear_beta, ACT, LINEAR_TANH, gl.bfloat16)
            dst = mma_k_position(cols, OUT_BK)
        else:
            y = acc
            dst = cols
        ptrs = out_ptr + gl.expand_dims(po * s_om, 1) + gl.expand_dims(dst, 0)
        gl.store(ptrs, y.to(gl.bfloat16), mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N_OUT, 0))


def fragment_gemm(a, w, w_scale, v, v_scale, out, align, a_row_div: int, tiles, act: str, beta: float,
                  linear_beta: float | None, out_block_k: int = 128, dependent_launch: bool = False):
    """One grouped GEMM (see the module doc): a [rows, K] bf16 in the MMA-k order of tiles.block_k; w, v uint8
    [E, N, K/2] in the shift layout with ue8m0 scales [E, N, K/32] (v None: the down GEMM); out [N k, N] bf16 (the
    gate/up GEMM: its columns in the MMA-k order of out_block_k, the down GEMM's step), or with tiles.split_k = S > 1
    fp32 partials at the physical columns, [2 S, N k, N] gated (gate's, then up's) and [S, N k, N] not.
    dependent_launch: launched with PDL, a is read only after the wait (`ops.moe.dependent_launch`)."""
    split = tiles.split_k
    gated = v is not None
    if split > 1:
        parts = split * (2 if gated else 1)
        if out.dtype != torch.float32 or out.dim() != 3 or out.shape[0] != parts:
            raise ValueError(f"split-K {split} stores fp32 partials [{parts}, N k, N]; got {out.dtype} "
                             f"{tuple(out.shape)}")
        if split > a.shape[1] // tiles.block_k:
            raise ValueError(f"split-K {split} needs at least one K step of {tiles.block_k} a split; K = {a.shape[1]}")
    args, gated = grouped_gemm_args(a, w, w_scale, v, v_scale, out if split == 1 else out[0], align, a_row_div, beta,
                                    linear_beta, False)
    n_tiles = triton.cdiv(w.shape[1], tiles.block_n)
    _fragment_gemm_kernel[(align[1].numel() * n_tiles * split,)](
        *args, out.stride(0) if split > 1 else 0, GATED=gated, ACT=_ACT[act], LINEAR_TANH=linear_beta is not None,
        BN=tiles.block_n, BK=tiles.block_k, OUT_BK=out_block_k, NUM_WARPS=tiles.num_warps, PDL=dependent_launch,
        SWAP=tiles.swap, BM=align[0].numel() // align[1].numel(), SPLIT=split, **compile_options(tiles),
        **launch_options(dependent_launch))


def compile_options(tiles) -> dict:
    """GemmTiles.compile_options without num_stages: no software pipeliner here, the kernel loads its weights
    and activations a step ahead itself."""
    options = tiles.compile_options()
    del options["num_stages"]
    return options


__all__ = ["compile_options", "fragment_gemm", "fragment_order"]
