"""The fused MoE's prefill GEMMs as Gluon wgmma kernels whose A operand is the dequantised weight tile in registers.

Why. The Triton prefill tiles dequantise each weight tile into shared memory and read it back for their MMAs; at
8192 tokens that round trip and the decode bound them near a quarter of the bf16 matmul rate (benchmarks/moe_layer.py,
BENCHMARKS.md session 14). wgmma takes its A operand from registers: here the weights are A (128 weight rows a
tile, two warpgroups of 64) and the block's tokens are N (BM = 64 or 128), so each thread's shift-decoded words
are its A fragments, in the MMA-k order of `ops.moe.fragment_order` (the same order as `ops.moe.gluon_decode`'s B
fragments: wgmma's register A and mma.sync's B hold the same K positions per thread), and the tokens' tile is the
only operand in shared memory.

The loop. A K step is 128 columns: per weight row, thread t of a quad holds 16 bytes of codes (4 words) and one
ue8m0 scale. Word u of them is its A fragments of k16 steps 2u and 2u + 1 (a 32-column chunk of the MMA-k order),
so a step runs as four chunks, and chunk c (gate and up where gated) is decoded while the wgmmas of chunks c - 2 and
c - 1 run (asynchronous wgmma; three A operand sets in registers). Token rows, weight words and scales arrive by
cp.async in STAGES shared stages, STAGES - 1 steps ahead; each thread copies exactly the words and scales it reads
back, so one barrier a step (mid-step, for the token tiles) suffices, and a stage is rewritten only after every warp
waited for the wgmmas that read it.

Output. The gate/up kernel (GATED) rounds gate and up to bf16, applies the activation (`ops.moe.epilogue`) and
stores the activation's columns in the MMA-k order of 128-wide steps, as the down kernel reads them; the down
kernel stores the expert outputs (unweighted; `ops.moe.epilogue`'s combine weights and sums them). Both go
through a layout conversion so that each thread stores 16 contiguous bytes.

Two tiles a program. The gate/up program decodes two weight tiles (gate and up rows) for each token tile it loads;
the down program does the same with two 128-row tiles of W where N is a multiple of 256 (PAIRED), so both GEMMs
spend one token copy, one barrier and one set of address arithmetic on 256 weight rows a step. On 16 warps
(`GemmTiles.num_warps`; `default_config`'s form below 256 rows an expert) the two tiles are one 256-row tile on
four warpgroups: the same work a program on twice the warps, for a loop that two warps a scheduler leave
latency-bound.

Tails. On 128-row blocks a 128-token tile costs ~1.5x a 64-token one (the decode, per weight, is paid once for
either), but an expert's last block is often short (K3.1 at 8192 tokens: ~146 rows an expert). `wgmma_gemm_tails`
runs the blocks of more than 64 rows as 128-token tiles and the rest as 64-token tiles in a second launch (or in
launches of smaller tiles, register caps or warps of their own: `MoEConfig.wgmma_tails`; `default_config` runs
the tails of at most 32 rows as 32-token tiles capped at 128 registers, two programs an SM, below 256 rows an
expert: K3.1 at 8192 tokens 28.8 -> 25.4 ms with random routing, BENCHMARKS.md, session 21).

Scope: bf16 activations, MXFP4 weights in the shift layout, K and N multiples of 128, 8 warps (16 where a program
has two weight tiles). Of session 20's forms, 16 warps with 32-token tails became the default below 256 rows an
expert; the others (register caps, 64-token tails capped or on 16 warps) stay opt-in (BENCHMARKS.md, session 21).
`ops.moe.triton` runs these when `MoEConfig.fragments` is set with block_m 64 or 128
(`ops.moe.config.default_config` sets it for prefill batches where they fit: 128). On the H200: 1.2-1.6x the
Triton prefill tiles at 2048-32768 tokens (sessions 15-16); the K3.1 layer at 8192 tokens 43.8-45.0% of the
measured bf16 matmul rate with random routing, 46.4-47.7% zipf (session 21; 40.2% in session 16 on 8 warps, whose
loop is latency-bound: two warps a scheduler, the tensor pipe ~40% busy).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kimiserve.ops.moe.config import WgmmaTail
from kimiserve.ops.moe.epilogue import _activate
from kimiserve.ops.moe.fragment_order import grouped_gemm_args
from kimiserve.ops.moe.triton import _ACT, _LUT_CONSTRAINTS, _SHIFT_ASM_C

BLOCK_N = gl.constexpr(128)  # weight rows a program: two warpgroups of wgmma M = 64
BLOCK_K = gl.constexpr(128)  # K columns a step (4 words of codes a thread and row)


@gluon.jit
def _scale_pairs(sc, like):
    """ue8m0 scales -> 2^(s - 1) as two bf16 (the shift decode's multiplier; see ops.moe.triton's "shift"), in
    the layout of `like` (its words)."""
    s16 = (gl.convert_layout(sc, like.type.layout, assert_trivial=True).to(gl.int32) + 126) << 7
    return s16 | (s16 << 16)


@gluon.jit
def _scale_bytes(s_buf, BN: gl.constexpr, LS: gl.constexpr):
    """A stage's scales, one int32 (4 bytes, t = 0..3) a weight row -> [BN, 4] uint8."""
    L2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    return s_buf._reinterpret(gl.uint8, [BN, 4], L2).load(LS)


@gluon.jit
def _a_chunk(word, s2, BN: gl.constexpr, LA: gl.constexpr):
    """One word per (weight row, quad thread t) [BN, 4] -> the A operand of one 32-column chunk of the MMA-k order,
    [BN, 32] bf16 in wgmma order (trivial conversion: every value is already in its thread).

    Code 2r + b0 of the word sits at chunk position 16 (r >> 1) + 8 (r & 1) + 2t + b0. Rows (W warps, BN = 16 W):
    the loads put weight row n = 8 W rep + 8 w + g in lane 4 g + t of warp w; wgmma's row m = 16 w + 8 rep + g is
    there."""
    e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
        _SHIFT_ASM_C, _LUT_CONSTRAINTS, [word, s2], dtype=(gl.bfloat16, ) * 8, is_pure=True, pack=1)
    v = gl.join(gl.join(gl.join(e0, e1), gl.join(e2, e3)), gl.join(gl.join(e4, e5), gl.join(e6, e7)))
    v = gl.reshape(gl.permute(v, (0, 4, 3, 1, 2)), (BN, 32))  # [n, t, b0, r & 1, r >> 1] -> [n, position]
    v = gl.reshape(gl.permute(gl.reshape(v, (2, BN // 64, 4, 8, 32)), (1, 2, 0, 3, 4)), (BN, 32))  # n -> m
    return gl.convert_layout(v, LA, assert_trivial=True)


@gluon.jit
def _chunks(words):
    """[BN, 4, 4] words -> the four [BN, 4] words u = 0, 1, 2, 3 (register selects)."""
    BN: gl.constexpr = words.shape[0]
    lo, hi = gl.split(gl.reshape(words, (BN, 4, 2, 2)))  # last dim u & 1, then u >> 1
    w0, w2 = gl.split(lo)
    w1, w3 = gl.split(hi)
    return w0, w1, w2, w3


@gluon.jit
def _decode(wg, sg, wv, sv, BN: gl.constexpr, LA: gl.constexpr, TWO: gl.constexpr):
    """A chunk's A operands: the first weight tile's (and the second's where TWO; else the first's again, unused)."""
    a = _a_chunk(wg, sg, BN, LA)
    if TWO:
        b = _a_chunk(wv, sv, BN, LA)
    else:
        b = a
    return a, b


@gluon.jit
def _issue(a, b, x_buf, acc, acc2, TWO: gl.constexpr):
    """A chunk's wgmmas (asynchronous): acc += a x^T (and acc2 += b x^T where TWO)."""
    xt = x_buf.permute((1, 0))
    acc = warpgroup_mma(a, xt, acc, is_async=True)
    if TWO:
        acc2 = warpgroup_mma(b, xt, acc2, is_async=True)
    return acc, acc2


@gluon.jit
def _wait_previous(acc, acc2, a, b, TWO: gl.constexpr):
    """Wait until only the last chunk's wgmmas (on a, b) are in flight."""
    if TWO:
        acc, acc2, a, b = warpgroup_mma_wait(2, deps=[acc, acc2, a, b])
    else:
        acc, a = warpgroup_mma_wait(1, deps=[acc, a])
    return acc, acc2


@gluon.jit
def _load_words(w_smem, s_smem, v_smem, t_smem, slot, BN: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr,
                TWO: gl.constexpr):
    """A stage's weight words [BN, 4, 4] and the shift decode's scale pairs [BN, 4] of W (and V where TWO)."""
    w = w_smem.index(slot).load(LW)
    s = _scale_bytes(s_smem.index(slot), BN, LS)
    if TWO:
        v = v_smem.index(slot).load(LW)
        t = _scale_bytes(t_smem.index(slot), BN, LS)
    else:
        v = w
        t = s
    return w, s, v, t


@gluon.jit
def _copy_step(x_bufs, w_bufs, s_bufs, x_ptrs, w_e, ws_e, v_e, vs_e, w_off, s_off, w_rows, s_rows, step, slot,
               BK: gl.constexpr, TWO: gl.constexpr, STACKED: gl.constexpr):
    """Start one K step's copies into stage `slot`: the token chunks (4 x [BM, 32]), the weight words and scales of
    W (and V where TWO, into their own buffers; where STACKED, the rows where w_rows / s_rows are false from V into
    the one tile); one commit group."""
    x0, x1, x2, x3 = x_bufs
    async_copy.async_copy_global_to_shared(x0.index(slot), x_ptrs + step * BK)
    async_copy.async_copy_global_to_shared(x1.index(slot), x_ptrs + step * BK + 32)
    async_copy.async_copy_global_to_shared(x2.index(slot), x_ptrs + step * BK + 64)
    async_copy.async_copy_global_to_shared(x3.index(slot), x_ptrs + step * BK + 96)
    w_smem, v_smem = w_bufs
    s_smem, t_smem = s_bufs
    w_src = w_e + w_off + step * (BK // 8)
    s_src = ws_e + s_off + step
    if STACKED:
        w_src = gl.where(w_rows, w_src, v_e + w_off + step * (BK // 8))
        s_src = gl.where(s_rows, s_src, vs_e + s_off + step)
    async_copy.async_copy_global_to_shared(w_smem.index(slot), w_src)
    async_copy.async_copy_global_to_shared(s_smem.index(slot), s_src)
    if TWO:
        async_copy.async_copy_global_to_shared(v_smem.index(slot), v_e + w_off + step * (BK // 8))
        async_copy.async_copy_global_to_shared(t_smem.index(slot), vs_e + s_off + step)
    async_copy.commit_group()


@gluon.jit
def _wgmma_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, v_ptr, vs_ptr, out_ptr, sorted_ptr, bexp_ptr, brows_ptr, nblk_ptr,
    N_OUT, K, A_ROW_DIV, s_am, s_we, s_wn, s_se, s_sn, s_om, beta, linear_beta,
    GATED: gl.constexpr, PAIRED: gl.constexpr, ACT: gl.constexpr, LINEAR_TANH: gl.constexpr, BM: gl.constexpr,
    STAGES: gl.constexpr, ALIGN_M: gl.constexpr, MIN_ROWS: gl.constexpr, NW: gl.constexpr,
):
    """One (align block b of ALIGN_M pairs, 128 output columns, or 256 where PAIRED): out[pair, cols] =
    act(A W^T, A V^T) (GATED, stored at the columns' MMA-k positions of 128-wide steps), or A W^T rounded to bf16;
    where PAIRED, V is W 128 rows on (the host's view), so the program's two weight tiles are W's next 256 rows and
    the down GEMM runs the gate/up GEMM's two tiles on each token tile it loads. A is read in MMA-k order. The
    program runs only where block b holds MIN_ROWS .. BM real rows (`wgmma_gemm`'s row range).

    NW warps: 8, the two 128-row weight tiles (W and V) as two accumulators of two warpgroups; or 16 (STACKED,
    GATED or PAIRED only), W's and V's 128 rows as one 256-row tile on four warpgroups, twice the warps a scheduler
    for the same work a program. Row n = 128 rep + 8 w + g of that tile (W where rep is 0, V where 1) is the
    accumulator's row m = 16 w + 8 rep + g: a thread holds a gate row and its up row, so the activation needs no
    exchange between warps."""
    STACKED: gl.constexpr = NW == 16
    BN: gl.constexpr = 16 * NW  # weight rows a tile: 128 on two warpgroups, 256 on four
    BK: gl.constexpr = BLOCK_K
    TWO: gl.constexpr = (GATED or PAIRED) and not STACKED  # two weight tiles a program
    ROWS: gl.constexpr = BLOCK_N * (1 + PAIRED)  # output columns a program
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    # weight words [BN, 4 (t), 4 (u)]: row 8 NW rep + 8 w + g in lane 4 g + t of warp w; scales [BN, 4 (t)]; each
    # thread copies exactly what it reads back, so only the token tiles need a barrier
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [NW, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [NW, 1], [1, 0])
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(N_OUT, ROWS)
    b = pid // n_tiles
    nt = pid % n_tiles
    row0 = b * ALIGN_M  # the block's first row of sorted_ptr
    # the block's expert and rows loaded together with the block count (entries past it are undefined, in bounds,
    # and unused; a used block has e >= 0 and nrows >= 1, and testing them keeps the loads above the exit): two
    # global round trips before the first copies instead of three
    LX: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])  # a [BM, 32] token chunk
    rx = gl.arange(0, BM, layout=gl.SliceLayout(1, LX))
    pairs = gl.load(sorted_ptr + row0 + rx)
    e = gl.load(bexp_ptr + b).to(gl.int64)
    nrows = gl.load(brows_ptr + b)
    if (b >= gl.load(nblk_ptr)) | (e < 0) | (nrows < MIN_ROWS) | (nrows > BM):
        return
    # a step's 4 scale bytes of a row (t = 0..3) copied as one int32 (s_sn in int32 units), read back as bytes; where
    # STACKED a tile row n is row n % 128 of this program's columns in W (n < 128) or V
    LS1: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    n_s = gl.arange(0, BN, layout=LS1)
    s_off = (nt * ROWS + n_s % BLOCK_N) * s_sn
    s_rows = n_s < BLOCK_N
    n_w = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
    rows_w = nt * ROWS + n_w % BLOCK_N
    quads_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    words = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    w_off = gl.expand_dims(gl.expand_dims(rows_w * s_wn, 1) + gl.expand_dims(quads_w, 0) * 4, 2) + \
        gl.expand_dims(gl.expand_dims(words, 0), 1)
    w_rows = gl.broadcast(gl.expand_dims(gl.expand_dims(n_w < BLOCK_N, 1), 2), w_off)[0]
    w_e = w_ptr + e * s_we
    ws_e = ws_ptr + e * s_se
    v_e = v_ptr + e * s_we
    vs_e = vs_ptr + e * s_se
    px = gl.where(rx < nrows, pairs, 0).to(gl.int64)  # padding rows: pair 0's row
    x_ptrs = gl.expand_dims(a_ptr + (px // A_ROW_DIV) * s_am, 1) + \
        gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, LX)), 0)
    LXS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 32], gl.bfloat16)
    x_bufs = (gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 32], LXS),
              gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 32], LXS),
              gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 32], LXS),
              gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, 32], LXS))
    LWS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    LSS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 4, 4], LWS)
    s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN], LSS)
    if TWO:
        v_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 4, 4], LWS)
        t_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN], LSS)
    else:
        v_smem = w_smem
        t_smem = s_smem
    w_bufs = (w_smem, v_smem)
    s_bufs = (s_smem, t_smem)
    acc = gl.zeros((BN, BM), gl.float32, MMA)
    acc2 = gl.zeros((BN, BM), gl.float32, MMA)
    steps = K // BK
    for p in gl.static_range(STAGES - 1):  # past the end: the last step again, never used
        _copy_step(x_bufs, w_bufs, s_bufs, x_ptrs, w_e, ws_e, v_e, vs_e, w_off, s_off, w_rows, s_rows,
                   gl.minimum(p, steps - 1), p, BK, TWO, STACKED)
    async_copy.wait_group(STAGES - 2)
    fence_async_shared()
    gl.thread_barrier()
    w_c, s_c, v_c, t_c = _load_words(w_smem, s_smem, v_smem, t_smem, 0, BN, LW, LS, TWO)
    wg0, wg1, wg2, wg3 = _chunks(w_c)
    wv0, wv1, wv2, wv3 = _chunks(v_c)
    sg = _scale_pairs(s_c, wg0)
    sv = _scale_pairs(t_c, wv0)
    a0, b0 = _decode(wg0, sg, wv0, sv, BN, LA, TWO)
    x0, x1, x2, x3 = x_bufs
    # Chunk c's A operands are decoded while chunks c - 2 and c - 1 run; then the wait for c - 2. Mid-step (chunks
    # 0 and 1 waited for, so step i - 1 finished in every warp after the barrier) the next step's words are read
    # and the copies of step i + STAGES - 1 start into the stage step i - 1 used; chunk 0 of step i + 1 is decoded
    # at the end of step i.
    for i in range(steps):
        slot = i % STAGES
        acc, acc2 = _issue(a0, b0, x0.index(slot), acc, acc2, TWO)
        a1, b1 = _decode(wg1, sg, wv1, sv, BN, LA, TWO)
        acc, acc2 = _wait_previous(acc, acc2, a0, b0, TWO)
        acc, acc2 = _issue(a1, b1, x1.index(slot), acc, acc2, TWO)
        a2, b2 = _decode(wg2, sg, wv2, sv, BN, LA, TWO)
        acc, acc2 = _wait_previous(acc, acc2, a1, b1, TWO)
        acc, acc2 = _issue(a2, b2, x2.index(slot), acc, acc2, TWO)
        async_copy.wait_group(STAGES - 3)  # step i + 1's copies (this thread's) are in
        fence_async_shared()
        gl.thread_barrier()
        w_c, s_c, v_c, t_c = _load_words(w_smem, s_smem, v_smem, t_smem, (i + 1) % STAGES, BN, LW, LS, TWO)
        _copy_step(x_bufs, w_bufs, s_bufs, x_ptrs, w_e, ws_e, v_e, vs_e, w_off, s_off, w_rows, s_rows,
                   gl.minimum(i + STAGES - 1, steps - 1), (i + STAGES - 1) % STAGES, BK, TWO, STACKED)
        a3, b3 = _decode(wg3, sg, wv3, sv, BN, LA, TWO)
        acc, acc2 = _wait_previous(acc, acc2, a2, b2, TWO)
        acc, acc2 = _issue(a3, b3, x3.index(slot), acc, acc2, TWO)
        wg0, wg1, wg2, wg3 = _chunks(w_c)
        wv0, wv1, wv2, wv3 = _chunks(v_c)
        sg = _scale_pairs(s_c, wg0)
        sv = _scale_pairs(t_c, wv0)
        a0, b0 = _decode(wg0, sg, wv0, sv, BN, LA, TWO)  # past the last step: unused
        acc, acc2 = _wait_previous(acc, acc2, a3, b3, TWO)
    async_copy.wait_group(0)
    if GATED:
        if STACKED:
            acc = warpgroup_mma_wait(0, deps=[acc])
            # row m = 16 w + 8 rep + g: the gate (rep 0) and up (rep 1) rows of column q = 8 w + g in one thread
            gate, up = gl.split(gl.permute(gl.reshape(acc, (NW, 2, 8, BM)), (0, 2, 3, 1)))
            y = _activate(gl.reshape(gate, (BLOCK_N, BM)), gl.reshape(up, (BLOCK_N, BM)), beta, linear_beta, ACT,
                          LINEAR_TANH, gl.bfloat16)
            # column q = 32 t' + 4 s + 2 b1 + b0 of a 128-wide step, which the down kernel reads at MMA position
            # 16 s + 8 b1 + 2 t' + b0
            y = gl.reshape(gl.permute(gl.reshape(y, (4, 8, 2, 2, BM)), (1, 2, 0, 3, 4)), (BLOCK_N, BM))
        else:
            acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
            y = _activate(acc, acc2, beta, linear_beta, ACT, LINEAR_TANH, gl.bfloat16)
            # row m = 16 w + 8 rep + g holds weight row n = 64 rep + 8 w + g, that is physical column q = 32 t' + 4 s
            # + 2 b1 + b0 of a 128-wide step (t' = 2 rep + w >> 2, s = 2 (w & 3) + g >> 2, b1 b0 = g & 3), which the
            # down kernel reads at MMA position 16 s + 8 b1 + 2 t' + b0
            y = gl.reshape(gl.permute(gl.reshape(y, (2, 4, 2, 2, 2, 2, BM)), (1, 3, 4, 2, 0, 5, 6)), (BN, BM))
        _store_tile(y, out_ptr, sorted_ptr, row0, nrows, nt * ROWS, s_om, BM, BLOCK_N, NW)
    elif PAIRED and not STACKED:
        acc, acc2 = warpgroup_mma_wait(0, deps=[acc, acc2])
        _store_tile(_m_to_n(acc, BM, BN), out_ptr, sorted_ptr, row0, nrows, nt * ROWS, s_om, BM, BN, NW)
        _store_tile(_m_to_n(acc2, BM, BN), out_ptr, sorted_ptr, row0, nrows, nt * ROWS + BN, s_om, BM, BN, NW)
    else:  # one tile (W's, or where STACKED W's next 256 rows: V is W 128 rows on)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _store_tile(_m_to_n(acc, BM, BN), out_ptr, sorted_ptr, row0, nrows, nt * ROWS, s_om, BM, BN, NW)


@gluon.jit
def _m_to_n(acc, BM: gl.constexpr, BN: gl.constexpr):
    """An accumulator's rows m = 16 w + 8 rep + g -> weight rows n = (BN / 2) rep + 8 w + g."""
    return gl.reshape(gl.permute(gl.reshape(acc, (BN // 64, 4, 2, 8, BM)), (2, 0, 1, 3, 4)), (BN, BM))


@gluon.jit
def _store_tile(y, out_ptr, sorted_ptr, row0, nrows, col0, s_om, BM: gl.constexpr, BN: gl.constexpr,
                NW: gl.constexpr):
    """out[pair of row row0 + r, col0 + n] = y[n, r] (bf16) for r < nrows; 16 contiguous bytes a thread."""
    LO: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, NW], [0, 1])  # 8 columns of a pair a thread
    y = gl.convert_layout(y.to(gl.bfloat16), LO)
    co = gl.arange(0, BM, layout=gl.SliceLayout(0, LO))
    pc = gl.load(sorted_ptr + row0 + co, mask=co < nrows, other=0).to(gl.int64)
    cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LO))
    ptrs = out_ptr + gl.expand_dims(pc * s_om, 0) + gl.expand_dims(cols, 1)
    gl.store(ptrs, y, mask=gl.expand_dims(co < nrows, 0))


def wgmma_gemm(a, w, w_scale, v, v_scale, out, align, a_row_div: int, block_m: int, act: str, beta: float,
               linear_beta: float | None, stages: int = 4, align_m: int | None = None, min_rows: int = 1,
               max_registers: int | None = None, num_warps: int = 8):
    """One grouped GEMM (see the module doc): a [rows, K] bf16 in the MMA-k order of 128-wide steps; w, v uint8
    [E, N, K/2] in the shift layout with ue8m0 scales [E, N, K/32] (v None: the down GEMM, two 128-row weight tiles
    a program where N is a multiple of 256); out [N k, N] bf16 (the gate/up GEMM: its columns in the MMA-k order of
    128-wide steps).

    align: `ops.moe.triton.align_blocks` at align_m rows a block (None: block_m); this launch takes only the blocks
    of min_rows..block_m real rows, so that a launch of 128-row tiles can leave the blocks of at most 64 rows to a
    launch of 64-row tiles (`wgmma_gemm_tails`). max_registers: Triton's maxnreg for this launch (None: the
    compiler's choice). num_warps: 8, or 16 for the gate/up GEMM and the paired down GEMM (their two 128-row tiles
    as one 256-row tile on four warpgroups: `_wgmma_gemm_kernel`)."""
    align_m = align_m or block_m
    if align_m < block_m or not 1 <= min_rows <= block_m:
        raise ValueError(f"a launch of {block_m}-row tiles takes align blocks of at least {block_m} rows (got "
                         f"{align_m}) holding at least min_rows, 1 <= min_rows <= {block_m} (got {min_rows})")
    paired = v is None and paired_down(w.shape[1])
    if paired:  # the second tile of a program: W 128 rows on
        v, v_scale = w[:, BLOCK_N.value:], w_scale[:, BLOCK_N.value:]
    gated = v is not None and not paired
    if num_warps not in (8, 16) or (num_warps == 16 and not (gated or paired)):
        raise ValueError(f"the wgmma GEMMs run on 8 warps, or 16 where a program has two weight tiles (gate/up, or "
                         f"a down GEMM of N a multiple of 256); got {num_warps} warps for N = {w.shape[1]}")
    args, _ = grouped_gemm_args(a, w, w_scale, v, v_scale, out, align, a_row_div, beta, linear_beta, True)
    grid = (align[1].numel() * triton.cdiv(w.shape[1], BLOCK_N.value * (1 + paired)),)
    _wgmma_gemm_kernel[grid](
        *args, GATED=gated, PAIRED=paired, ACT=_ACT[act], LINEAR_TANH=linear_beta is not None, BM=block_m,
        STAGES=stages, ALIGN_M=align_m, MIN_ROWS=min_rows, NW=num_warps, num_warps=num_warps,
        **({"maxnreg": max_registers} if max_registers else {}))


def paired_down(n_out: int) -> bool:
    """Whether the down GEMM of N = n_out output columns runs two weight tiles a program."""
    return n_out % (2 * BLOCK_N.value) == 0


def wgmma_gemm_tails(a, w, w_scale, v, v_scale, out, align, a_row_div: int, act: str, beta: float,
                     linear_beta: float | None, stages: int = 3, tails: tuple[WgmmaTail, ...] = (WgmmaTail(),),
                     max_registers: int | None = None, num_warps: int = 8):
    """A grouped GEMM on 128-row align blocks: each expert's blocks of more rows than the first tail tile holds as
    128-token tiles (stages, max_registers, num_warps), the rest (its last block where it holds few rows) in the
    tail launches, largest tile first, each taking the blocks of more rows than the next one's tile
    (`MoEConfig.wgmma_tails`; by default those of at most 64 rows as 64-token tiles). A 128-token tile costs ~1.5x
    a 64-token one for twice the tokens, and a tail of at most 64 rows would pad the 128-token tile by half."""
    common = (a, w, w_scale, v, v_scale, out, align, a_row_div)
    wgmma_gemm(*common, 128, act, beta, linear_beta, stages, align_m=128, min_rows=tails[0].block_m + 1,
               max_registers=max_registers, num_warps=num_warps)
    for tail, smaller in zip(tails, tails[1:] + (None,)):
        wgmma_gemm(*common, tail.block_m, act, beta, linear_beta, tail.num_stages, align_m=128,
                   min_rows=smaller.block_m + 1 if smaller else 1, max_registers=tail.max_registers,
                   num_warps=tail.num_warps)


def wgmma_gemm_blocks(a, w, w_scale, v, v_scale, out, align, a_row_div: int, block_m: int, act: str, beta: float,
                      linear_beta: float | None, tiles, tails: tuple[WgmmaTail, ...] = (WgmmaTail(),)):
    """The grouped GEMM on align blocks of block_m rows, with the GEMM's `GemmTiles` (its stages, register cap and
    warps):
    at 128 with each expert's tail in launches of smaller tiles (`wgmma_gemm_tails`), at 64 in one launch."""
    common = (a, w, w_scale, v, v_scale, out, align, a_row_div)
    if block_m == 128:
        wgmma_gemm_tails(*common, act, beta, linear_beta, tiles.num_stages, tails, tiles.max_registers,
                         tiles.num_warps)
    else:
        wgmma_gemm(*common, block_m, act, beta, linear_beta, tiles.num_stages, max_registers=tiles.max_registers,
                   num_warps=tiles.num_warps)


__all__ = ["BLOCK_K", "BLOCK_N", "paired_down", "wgmma_gemm", "wgmma_gemm_blocks", "wgmma_gemm_tails"]
