"""Triton kernel for the decode-time indexer scan `paged_indexer_scores` (the long-context hot loop).

At a 1M-token context this reads 132 B per token (128 e4m3 key bytes + a 4-byte fp32 scale) and
writes 4 B per token: at large batches it is bound by memory bandwidth (MXFP4 keys: 68 B, see below). Design:

- grid (token chunks, batch): program (c, b) owns positions [c * CHUNK, (c + 1) * CHUNK) of sequence
  b, CHUNK = TILES * BLOCK_S. It loads the query q[b] [Hi, D] once (transposed, in the dot dtype) and
  the head weights once, then walks its tiles of BLOCK_S tokens. BLOCK_S divides block_size, so a
  tile lies in one page: one block-table read per tile, then a [BLOCK_S, D] key tile read in place
  from the page-strided view (rows contiguous inside the page) plus BLOCK_S scales.
- e4m3 keys enter the dot as their exact code values (converted to fp16, one conversion per pair),
  q as fp16 (bf16 values in fp16's normal range, 6.1e-5 to 65504 in magnitude, convert exactly), fp32 accumulation; ReLU, times the fp32 weights, summed over
  heads -> BLOCK_S scores, each times its token's fp32 key scale (ReLU commutes with a positive
  scale), as the reference defines it. bf16 keys are cast to `dtype` and dotted in `dtype`. The H200
  measurement behind the fp16 dot (benchmarks/scan_variants.py, results/scan_variants.json): the
  per-element dequantisation to bf16 cost ~16% at batch 1 (59.9 -> 50.5 us at 1M tokens).
- MXFP4 keys (uint8 codes [P, block_size, 16 * groups], ue8m0 scales [P, block_size, groups]; K3.1:
  68 B per token against fp8's 132) have their own kernel, same grid, with tiles that may span pages
  (one block-table entry per token; K3.1's fp4 pages hold 704 tokens, 64 x 11). Per tile and 32-dim
  group: the tokens' 16 code bytes of the group as one contiguous run, decoded in registers to fp16
  e2m1 * 2^-14 exactly (the code bits placed in fp16's exponent and mantissa, `_e2m1_fp16`: no table;
  PTX on packed registers on the GPU), one K=32 fp16 dot with the group's query dims, its fp32
  result times 2^(e_g - emax + 15) (emax: the token's largest scale exponent) into the tile's
  accumulator; the token's 4 scale bytes come as one int32 where the layout allows, and its score is
  multiplied by 2^(emax - 128). Every product and scale is exact in fp32, so scores differ from the
  reference only in the fp32 summation order (with `dtype=torch.float16` the reference also rounds
  keys outside fp16's range, the kernel does not). A 0xFF scale byte is NaN (as in OCP MX).
  H200, 1M tokens x batch 1, 32 heads x 128 (benchmarks/scan_variants.py): 64.8 us against fp8's
  52-54 and a read-only floor of 24.5 us (the same bytes and grid, no math): NOT memory-bound, the
  e2m1 decode and the per-tile work cost more than the bytes saved. Per-group dots replaced an fp16
  multiply of every key value by its group's power of two (66.4 -> 64.8 us; batch 64: 3.64 -> 3.26 ms).
- Keys stored rotated (fp4: `rotation`, a Hadamard matrix): `rotate_query` rotates the query first,
  one small launch (IEEE fp32 dot, rounded to q's dtype as the reference rounds it).
- slots at or past context_len are masked off (never read; their scores are -inf): only slots
  s < context_len of the first ceil(context_len / block_size) block-table entries are read. The
  tile loop has a fixed trip count (TILES) so Triton can pipeline it.

Differences from the reference: only the summation order inside the dot (the products are exact in
fp32). A q wider than the dot dtype (e.g. fp32 q) enters the dot as the sum of two parts, so it
keeps ~21 (fp16) or ~16 (bf16) significant bits instead of fp32's 24. `dtype=torch.float32` runs
an IEEE fp32 dot (correct but far slower).

Under TRITON_INTERPRET=1 (CPU tensors) the interpreter's bf16 dot and fp32 -> bf16 cast are wrong
(it multiplies the raw bit patterns; the cast truncates), so on CPU the kernel rounds to bf16 by
bit arithmetic and runs the dot in fp32 on the rounded values: same result, different path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_bf16_f32(x):
    """fp32 values rounded to bf16 (nearest even), kept in fp32 (the interpreter's stand-in for a cast)."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _operand(x, DT: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 x rounded to the dot dtype DT: a DT tensor, or (EMULATE) an fp32 tensor of DT values."""
    if EMULATE:
        if DT == tl.bfloat16:
            return _round_bf16_f32(x)
        else:
            return x.to(DT).to(tl.float32)
    else:
        return x.to(DT)


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, cl_ptr, out_ptr,
    q_sb, q_sh, q_sd, w_sb, w_sh, k_sp, k_st, k_sd, ks_sp, ks_st, bt_sb, bt_sm, out_sb,
    H, max_context,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    TILES: tl.constexpr, HAS_SCALE: tl.constexpr, DT: tl.constexpr, SPLIT_Q: tl.constexpr,
    EMULATE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Scores of positions [chunk * TILES * BLOCK_S, +TILES * BLOCK_S) of sequence b (see module doc)."""
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(cl_ptr + b).to(tl.int32)
    start = chunk * (TILES * BLOCK_S)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    qt = tl.load(q_ptr + b * q_sb + d[:, None] * q_sd + h[None, :] * q_sh, mask=h[None, :] < H, other=0.0)
    qt = qt.to(tl.float32)  # [D, BLOCK_H]
    q_hi = _operand(qt, DT, EMULATE)
    if SPLIT_Q:  # q wider than DT: q = q_hi + q_lo to ~16 bits
        q_lo = _operand(qt - q_hi.to(tl.float32), DT, EMULATE)
    w = tl.load(w_ptr + b * w_sb + h * w_sh, mask=h < H, other=0.0).to(tl.float32)

    rows = tl.arange(0, BLOCK_S)
    out_row = out_ptr + b * out_sb
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        s0 = start + t * BLOCK_S
        live = s0 < ctx  # tiles at or past context_len read nothing and score -inf
        page = tl.load(bt_ptr + b * bt_sb + (s0 // PAGE) * bt_sm, mask=live, other=0).to(tl.int64)
        slot = s0 % PAGE + rows
        valid = s0 + rows < ctx
        k = tl.load(k_ptr + page * k_sp + slot[:, None] * k_st + d[None, :] * k_sd, mask=valid[:, None], other=0.0)
        kd = _operand(k.to(tl.float32), DT, EMULATE) if EMULATE else k.to(DT)  # e4m3 codes are exact in DT
        acc = tl.dot(kd, q_hi, input_precision=PRECISION)  # [BLOCK_S, BLOCK_H] fp32
        if SPLIT_Q:
            acc = tl.dot(kd, q_lo, acc, input_precision=PRECISION)
        score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        if HAS_SCALE:  # ReLU commutes with the positive per-token key scale
            score = score * tl.load(ks_ptr + page * ks_sp + slot * ks_st, mask=valid, other=0.0)
        pos = s0 + rows
        tl.store(out_row + pos, tl.where(valid, score, float("-inf")), mask=pos < max_context)


@triton.jit
def _e2m1_fp16(c):
    """e2m1 codes (int32, low 4 bits) as fp16 e2m1 * 2^-14, exactly and without a lookup: the
    magnitude bits land on fp16's two lowest exponent bits and top mantissa bit, so codes of
    exponent 0 (0 and 0.5) come out as fp16 subnormals and the rest as normals."""
    return (((c << 12) & 0x8000) | ((c << 9) & 0x0E00)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_pairs(c, ASM: tl.constexpr):
    """(even, odd) dims of MXFP4 code bytes c (uint8): `_e2m1_fp16` of their low / high nibbles. ASM:
    the same in PTX on packed registers, 4 code bytes -> 8 fp16 values in 22 instructions."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t, a, s;
            prmt.b32 t, $4, 0, 0x4140;
            shl.b32 a, t, 9;
            and.b32 a, a, 0x0E000E00;
            shl.b32 s, t, 12;
            and.b32 s, s, 0x80008000;
            or.b32 $0, a, s;
            shl.b32 a, t, 5;
            and.b32 a, a, 0x0E000E00;
            shl.b32 s, t, 8;
            and.b32 s, s, 0x80008000;
            or.b32 $2, a, s;
            prmt.b32 t, $4, 0, 0x4342;
            shl.b32 a, t, 9;
            and.b32 a, a, 0x0E000E00;
            shl.b32 s, t, 12;
            and.b32 s, s, 0x80008000;
            or.b32 $1, a, s;
            shl.b32 a, t, 5;
            and.b32 a, a, 0x0E000E00;
            shl.b32 s, t, 8;
            and.b32 s, s, 0x80008000;
            or.b32 $3, a, s;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[c],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        c = c.to(tl.int32)
        return _e2m1_fp16(c), _e2m1_fp16(c >> 4)


@triton.jit
def _indexer_scores_mxfp4_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, cl_ptr, out_ptr,
    q_sb, q_sh, q_sd, w_sb, w_sh, k_sp, k_st, ks_sp, ks_st, ks_sg, bt_sb, bt_sm, out_sb,
    H, max_context,
    D: tl.constexpr, GROUPS: tl.constexpr, SCALE_WORDS: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, TILES: tl.constexpr, DT: tl.constexpr,
    SPLIT_Q: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    ASM: tl.constexpr,
):
    """`_indexer_scores_kernel` for MXFP4 keys (see module doc)."""
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(cl_ptr + b).to(tl.int32)
    start = chunk * (TILES * BLOCK_S)

    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, 32)
    q_hi = ()  # per group: the query's 32 dims [32, BLOCK_H] in the dot dtype (q_lo: the rest, SPLIT_Q)
    q_lo = ()
    for g in tl.static_range(GROUPS):
        d = 32 * g + j
        qt = tl.load(q_ptr + b * q_sb + h[:, None] * q_sh + d[None, :] * q_sd,
                     mask=(h[:, None] < H) & (d[None, :] < D), other=0.0).to(tl.float32)
        q_hi = q_hi + (tl.trans(_operand(qt, DT, EMULATE)),)
        if SPLIT_Q:
            q_lo = q_lo + (tl.trans(_operand(qt - _operand(qt, DT, EMULATE).to(tl.float32), DT, EMULATE)),)
    w = tl.load(w_ptr + b * w_sb + h * w_sh, mask=h < H, other=0.0).to(tl.float32)

    rows = tl.arange(0, BLOCK_S)
    out_row = out_ptr + b * out_sb
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        s0 = start + t * BLOCK_S
        valid = s0 + rows < ctx
        if PAGE % BLOCK_S:  # a tile may span pages: one block-table entry per token (cache hits)
            page = tl.load(bt_ptr + b * bt_sb + ((s0 + rows) // PAGE) * bt_sm, mask=valid, other=0).to(tl.int64)
            slot = (s0 + rows) % PAGE
        else:
            page = tl.load(bt_ptr + b * bt_sb + (s0 // PAGE) * bt_sm, mask=s0 < ctx, other=0).to(tl.int64)
            slot = s0 % PAGE + rows
        scales = ks_ptr + page * ks_sp + slot * ks_st
        codes = k_ptr + page * k_sp + slot * k_st
        e = ()  # per group: its scale exponent byte [BLOCK_S] (int32)
        if SCALE_WORDS:  # 4 ue8m0 bytes per int32 word: one load per token and 4 groups
            for i in tl.static_range(GROUPS // 4):
                word = tl.load(scales + i * ks_sg, mask=valid, other=0)
                e = e + (word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF, (word >> 24) & 0xFF)
        else:
            for g in tl.static_range(GROUPS):
                e = e + (tl.load(scales + g * ks_sg, mask=valid, other=0).to(tl.int32),)
        emax = e[0]
        for g in tl.static_range(1, GROUPS):
            emax = tl.maximum(emax, e[g])
        # group g's keys enter their own dot as e2m1 * 2^-14 (fp16, exact); its fp32 result is scaled by
        # 2^(e_g - emax + 15), the token's score by 2^(emax - 128): together 2^(e_g - 127) (exact in fp32)
        acc = tl.zeros([BLOCK_S, BLOCK_H], dtype=tl.float32)
        for g in tl.static_range(GROUPS):
            # a token's 16 code bytes of the group as one contiguous run (16-byte loads)
            c = tl.load(codes[:, None] + (16 * g + tl.arange(0, 16))[None, :], mask=valid[:, None], other=0)
            k_even, k_odd = _e2m1_pairs(c, ASM)
            k = tl.reshape(tl.join(k_even, k_odd), [BLOCK_S, 32])  # dims in order: 2j even, 2j + 1 odd
            kd = k.to(tl.float32) if EMULATE else k.to(DT)
            part = tl.dot(kd, q_hi[g], input_precision=PRECISION)  # [BLOCK_S, BLOCK_H] fp32
            if SPLIT_Q:
                part = tl.dot(kd, q_lo[g], part, input_precision=PRECISION)
            f = (tl.maximum(e[g] - emax + 142, 0) << 23).to(tl.float32, bitcast=True)
            acc += part * f[:, None]
        score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        # 2^(emax - 128) exactly (emax 0: 2^-127 halved, a subnormal); a 0xFF scale byte is NaN (OCP)
        tok = ((emax << 23) | ((emax == 0).to(tl.int32) << 22)).to(tl.float32, bitcast=True) * 0.5
        score = score * tl.where(emax == 255, float("nan"), tok)
        pos = s0 + rows
        tl.store(out_row + pos, tl.where(valid, score, float("-inf")), mask=pos < max_context)


def _default_block_s(block_size: int) -> int:
    """128 tokens per tile where that divides block_size (the H200 sweep's best,
    benchmarks/results/sweep_decode.json), else the largest power of two dividing it."""
    return min(128, block_size & -block_size)


def _default_tiles(batch: int) -> tuple[int, int]:
    """(tiles per program, pipeline stages): one tile per program spreads a batch of 1 over every SM;
    large batches fill the GPU anyway and prefer long pipelined runs (H200: sweep_decode.json,
    scan_variants.json)."""
    return (1, 2) if batch <= 8 else (16, 3)


@triton.jit
def _rotate_query_kernel(q_ptr, r_ptr, out_ptr, H, q_sb, q_sh, q_sd, o_sb, o_sh,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[b, h, n] = q[b, h] @ r[:, n] (r fp32 [D, D], contiguous) for BLOCK_H heads of sequence b and
    BLOCK_N output dims: an IEEE fp32 dot, stored in out's dtype (rounded to nearest)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        qk = tl.load(q_ptr + b * q_sb + h[:, None] * q_sh + k[None, :] * q_sd, mask=h[:, None] < H, other=0.0)
        acc = tl.dot(qk.to(tl.float32), tl.load(r_ptr + k[:, None] * D + n[None, :]), acc, input_precision="ieee")
    tl.store(out_ptr + b * o_sb + h[:, None] * o_sh + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=h[:, None] < H)


def rotate_query(q: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """`reference.rotate_query` in one launch: q [B, H, D] @ rotation [D, D] in fp32, rounded to q's
    dtype (the reference's casts and GEMM are four kernels, ~10 us at batch 1 on the H200,
    benchmarks/step_profile.py). Programs of 16 heads x 32 output dims, so that a batch of 1 still
    spreads over several SMs."""
    B, H, D = q.shape
    if rotation.shape != (D, D):
        raise ValueError(f"rotation must be [{D}, {D}] for queries of head dim {D}, got {tuple(rotation.shape)}")
    r = rotation.to(torch.float32).contiguous()
    emulate = q.device.type != "cuda"  # the interpreter's fp32 -> bf16 cast truncates: round in torch
    out = torch.empty(B, H, D, dtype=torch.float32 if emulate else q.dtype, device=q.device)
    block_n = min(32, D)
    if B and H:
        _rotate_query_kernel[(B, triton.cdiv(H, 16), D // block_n)](
            q, r, out, H, q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
            D=D, BLOCK_H=16, BLOCK_N=block_n, BLOCK_K=min(32, D), num_warps=4)
    return out.to(q.dtype) if emulate else out


# (block_s, tiles, stages) for MXFP4 keys, from H200 runs of benchmarks/scan_variants.py at 1M tokens
# (32 heads x 128, 704-token pages): 128-token tiles spanning pages, 8 per program, at batch 1 (64.8 us
# against 68.1 with 2 and 76.3 with 1) as at batch 64 (3.26 ms against 3.34 with 4 and 4.08 with 1)
_MXFP4_LAUNCH = (128, 8, 2)


def _scores_out(out: torch.Tensor | None, rows_name: str, rows: int, max_context: int,
                device: torch.device) -> torch.Tensor:
    """The scan's fp32 [rows, max_context] output: `out` checked, or a new one."""
    if out is None:
        return torch.empty(rows, max_context, dtype=torch.float32, device=device)
    if out.shape != (rows, max_context) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be fp32 [{rows_name}, max_context] = [{rows}, {max_context}] with unit stride "
                         "along tokens")
    return out


def _dot_operands(q: torch.Tensor, key_scales: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.dtype, bool]:
    """(the dtype of the scan's dots, whether q is split into a hi/lo pair of it): fp8 keys with bf16 run fp16
    dots; a q wider than the dot dtype (and not bf16) is split."""
    dot_dtype = torch.float16 if key_scales is not None and dtype == torch.bfloat16 else dtype
    return dot_dtype, dot_dtype != torch.float32 and q.dtype not in (dot_dtype, torch.bfloat16)


def paged_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    dtype: torch.dtype,
    max_context: int | None = None,
    out: torch.Tensor | None = None,
    *,
    rotation: torch.Tensor | None = None,
    block_s: int | None = None,
    tiles: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Decode-time indexer scan: one query per sequence scores every cached index key.

    q [B, Hi, D]; weights [B, Hi]; key_cache [P, block_size, D] (bf16 or e4m3, any strides: pages
    are read in place) with key_scales [P, block_size] fp32 for e4m3 (None for bf16), or MXFP4 keys:
    uint8 codes [P, block_size, 16 * ceil(D / 32)] (unit stride along bytes) with uint8 ue8m0 scales
    [P, block_size, ceil(D / 32)]; block_tables [B, M] page ids; context_lens [B]. Keys are
    dequantised to `dtype` before scoring. Returns fp32
    [B, max_context]: score[b, s] = sum_h weights[b, h] ReLU(q[b, h] . k_s), -inf for s >= context_lens[b].

    rotation: the orthonormal [D, D] matrix the keys were stored rotated by, or None: the query is
    rotated first (`rotate_query`, one launch), as the reference does.

    max_context: the output width, >= max(context_lens) (not checked); None takes
    int(context_lens.max()), a host sync (pass it under CUDA graphs). out: optional fp32 [B,
    max_context] buffer to fill (every element is written). block_s (tokens per tile, a power of two
    >= 16 dividing block_size; default 128 where it divides), tiles (tiles per program), num_warps, num_stages: launch
    tuning, no effect on the result.
    """
    if rotation is not None:
        q = rotate_query(q, rotation)
    B, H, D = q.shape
    _, page, Dk = key_cache.shape
    mxfp4 = key_cache.dtype == torch.uint8
    if mxfp4:
        groups = -(-D // 32)
        if groups & (groups - 1) or Dk != 16 * groups or key_scales is None or key_scales.dtype != torch.uint8 \
                or key_scales.shape != (*key_cache.shape[:2], groups) or key_cache.stride(2) != 1:
            raise ValueError(f"MXFP4 keys for head dim {D} (ceil(D / 32) a power of two) need uint8 codes [P, block_size, {16 * groups}] (unit "
                             f"stride along bytes) and uint8 scales [P, block_size, {groups}]")
    elif Dk != D or D < 16 or D & (D - 1):
        raise ValueError(f"q has head dim {D} and keys {Dk}: they must agree and be a power of two >= 16")
    elif (key_scales is not None) != (key_cache.dtype == torch.float8_e4m3fn):
        raise ValueError("key_scales must be given exactly when the key cache is e4m3")
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_DOT_DTYPES)}, got {dtype}")
    if mxfp4:
        default_block_s, default_tiles, default_stages = _MXFP4_LAUNCH
    else:
        default_block_s, (default_tiles, default_stages) = _default_block_s(page), _default_tiles(B)
    block_s = default_block_s if block_s is None else block_s
    tiles = default_tiles if tiles is None else tiles
    num_stages = default_stages if num_stages is None else num_stages
    if (page % block_s and not mxfp4) or block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s {block_s} must be a power of two >= 16 dividing block_size {page} "
                         "(MXFP4 keys: any power of two >= 16)")
    if max_context is None:
        max_context = int(context_lens.max())
    out = _scores_out(out, "B", B, max_context, q.device)
    if B == 0 or max_context == 0:
        return out
    emulate = q.device.type != "cuda"
    dot_dtype, split_q = _dot_operands(q, key_scales, dtype)
    grid = (triton.cdiv(max_context, block_s * tiles), B)
    common = dict(BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_S=block_s, TILES=tiles,
                  DT=_DOT_DTYPES[dot_dtype], SPLIT_Q=split_q, EMULATE=emulate,
                  PRECISION="ieee" if emulate or dot_dtype == torch.float32 else None,
                  NUM_STAGES=num_stages, num_warps=num_warps)
    if mxfp4:
        ks, words = _scale_words(key_scales)
        _indexer_scores_mxfp4_kernel[grid](
            q, weights, key_cache, ks, block_tables, context_lens, out,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
            key_cache.stride(0), key_cache.stride(1), ks.stride(0), ks.stride(1), ks.stride(2),
            block_tables.stride(0), block_tables.stride(1), out.stride(0),
            H, max_context,
            D=D, GROUPS=groups, SCALE_WORDS=words, PAGE=page, ASM=not emulate, **common,
        )
        return out
    ks = key_scales if key_scales is not None else key_cache  # unused placeholder without scales
    _indexer_scores_kernel[grid](
        q, weights, key_cache, ks, block_tables, context_lens, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), ks.stride(0), ks.stride(1),
        block_tables.stride(0), block_tables.stride(1), out.stride(0),
        H, max_context,
        D=D, PAGE=page, HAS_SCALE=key_scales is not None, **common,
    )
    return out


def _scale_words(scales: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor, words): the ue8m0 scales as int32 words of 4 groups where the layout allows (K3.1:
    a token's 4 scale bytes in one aligned load), else the bytes themselves."""
    if scales.shape[-1] % 4 == 0 and scales.stride(-1) == 1:
        try:
            return scales.view(torch.int32), True
        except RuntimeError:  # a stride or offset not a multiple of 4 bytes
            pass
    return scales, False
