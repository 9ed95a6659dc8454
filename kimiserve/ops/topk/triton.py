"""Triton top-k token selection for sparse-MLA decode: `topk_indices` (radix select, no sort).

Per row b of fp32 scores [B, S]: the positions of the k largest scores among positions < lengths[b]
whose score is > -inf, ties broken like `reference.causal_topk` (the earlier position wins), -1
padded. Output order: the selected positions in INCREASING POSITION ORDER (not best first), then
the -1 padding; deterministic (no atomic decides a slot). Compare with `topk_reference` as sets.

Scores become order-preserving int32 keys (-0.0 equal to +0.0, NaN above +inf as in torch.sort).
The k-th largest valid key T is found by a radix select on 3 digits (key bits 31..21, 20..10,
9..0); every valid key > T is selected, and of the keys == T the earliest k_sel - #(key > T),
k_sel = min(k, #valid). Grid (cdiv(S, block), B) for every kernel: program (c, b) owns the block
[c * block, (c + 1) * block) of row b. A pass ends in the row's LAST program (`_is_last`, a
split-K style ticket), which reduces the pass's global histogram to the next digit once per row
and stores it in the row's state. Launches (no host sync; CUDA-graph capturable):
  zeros   per-row int32 workspace: histograms histM hist1 hist2 [2048], hist3 [1024], state, tickets.
  pass 0  (when S >= 4k) digit-1 histogram of the maxima of runs of G positions (G = 32 when
          S >= 64k, k = 2048). Last: dm, the digit where the maxima's count from the top reaches k.
          k valid keys have digit >= dm, so digit1(T) >= dm: keys below dm can never matter.
  pass 1  candidates = valid keys with digit 1 >= dm (~1-3k per row on random scores): their count
          and, when <= cap, their positions (increasing) go to the block's candidate slot; digit 1
          into hist1. Last: d1 from hist1 and k_sel.
  pass 2  over the slot (or the block when it overflowed): digit 2 of the keys with digit 1 == d1.
          Last: d2.      pass 3: digit 3 of those matching d1 d2. Last: d3, hence T and `need`.
  count   per block #(key > T) and #(key == T).
  write   each block sums the counts of the blocks before it (O(P) loads) and stores its selected
          positions at their slots; program 0 writes the -1 padding.
Passes 2, 3, count and write read only the few candidates of each block (plus the scores they
point at), so after pass 1 the row is not scanned again unless its candidates overflow `cap`.

`_hist_add` (one program's part of a global histogram) never builds a full 2048-bin tl.histogram
(~bins / 32 popcounts per element): matches that share one digit add one count; at most `sparse`
matches add one atomic each; more are histogrammed in windows of `window` bins below the largest
remaining digit until at most `sparse` remain.

Difference from `causal_topk`: positions with score -inf are never selected (the reference selects
visible -inf scores when fewer than k scores are finite); and the output order (above).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.topk.reference import topk_reference  # noqa: F401  (re-exported for the tests)

WS_ROW = 7184  # int32 per workspace row: histM, hist1, hist2 [2048 each], hist3 [1024], state [16]
_HM, _H1, _H2, _H3, _ST, _WS_ROW = (tl.constexpr(v) for v in (0, 2048, 4096, 6144, 7168, WS_ROW))
# state slots: 0 #valid (atomic adds), 1 dm, 2 d1, 3 k_rem after d1, 4 k_sel, 5 d2, 6 k_rem after d2,
# 7 T (threshold key), 8 need (keys == T to take), 9..12 tickets of passes 0..3
_NEG_INF_KEY = tl.constexpr(-2139095040)  # key(-inf)


@triton.jit
def _to_key(x):
    """Order-preserving int32 key of fp32 x: -0.0 maps to the key of +0.0, every NaN above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits >> 31  # 0 or -1
    key = (bits ^ (sign & 0x7FFFFFFF)) - sign  # negatives: flip the magnitude, +1 so that -0.0 -> 0
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, key)


@triton.jit
def _load_scores(scores_ptr, lengths_ptr, b, offs, S, row_stride, HAS_LEN: tl.constexpr):
    """scores[b, offs] (any shape), -inf at offs >= min(lengths[b], S)."""
    # the load is masked by S only (vector loads when S % 16 == 0); lengths[b] masks afterwards
    x = tl.load(scores_ptr + b.to(tl.int64) * row_stride + offs, mask=offs < S, other=float("-inf"))
    if HAS_LEN:
        length = tl.maximum(tl.minimum(tl.load(lengths_ptr + b).to(tl.int64), S), 0).to(tl.int32)
        x = tl.where(offs < length, x, float("-inf"))
    return x


@triton.jit
def _keys(scores_ptr, lengths_ptr, b, offs, S, row_stride, HAS_LEN: tl.constexpr):
    """Keys of scores[b, offs] (any shape) and their valid mask (position < lengths[b], score > -inf)."""
    key = _to_key(_load_scores(scores_ptr, lengths_ptr, b, offs, S, row_stride, HAS_LEN))
    return key, key > _NEG_INF_KEY


@triton.jit
def _row_keys(scores_ptr, lengths_ptr, b, pid, S, row_stride, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """(positions, keys, valid) of this program's [BLOCK] slice of row b."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    key, valid = _keys(scores_ptr, lengths_ptr, b, offs, S, row_stride, HAS_LEN)
    return offs, key, valid


@triton.jit
def _find_digit(hist_ptr, k_rem, NB: tl.constexpr):
    """Largest digit d whose count of digits >= d reaches k_rem (clamped to the histogram total).

    Returns (d, k_rem - #(digit > d), clamped k_rem). Two levels: rows of 32 bins, then one row.
    Volatile loads: the histogram was just completed by other programs of this launch."""
    r = tl.arange(0, NB // 32)
    c = tl.arange(0, 32)
    h2 = tl.load(hist_ptr + r[:, None] * 32 + c[None, :], volatile=True)
    rows = tl.sum(h2, axis=1)
    total = tl.sum(rows, axis=0)
    k_rem = tl.minimum(k_rem, total)
    rd = tl.max(tl.where(total - tl.cumsum(rows, axis=0) + rows >= k_rem, r, 0), axis=0)
    above = tl.sum(tl.where(r > rd, rows, 0), axis=0)
    h = tl.sum(tl.where(r[:, None] == rd, h2, 0), axis=0)  # row rd
    cd = tl.max(tl.where(above + tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h >= k_rem, c, 0), axis=0)
    above += tl.sum(tl.where(c > cd, h, 0), axis=0)
    return rd * 32 + cd, k_rem - above, k_rem


@triton.jit
def _hist_add(hist_ptr, digit, mask, NB: tl.constexpr, W: tl.constexpr, SPARSE: tl.constexpr):
    """hist_ptr[d] += #{i : mask[i] and digit[i] == d}, digits in [0, NB) (see module doc)."""
    n = tl.sum(mask.to(tl.int32), axis=0)
    if n > SPARSE:
        rest = mask
        hi = tl.max(tl.where(rest, digit, -1), axis=0)
        lo = tl.min(tl.where(rest, digit, NB), axis=0)
        while (n > SPARSE) & (hi > lo):  # histogram the window [hi - W + 1, hi], then drop it
            base = hi - (W - 1)
            inw = rest & (digit >= base)
            h = tl.histogram(tl.where(inw, digit - base, 0), W, mask=inw)
            tl.atomic_add(hist_ptr + base + tl.arange(0, W), h, mask=h > 0, sem="relaxed")
            rest = rest & (digit < base)
            n = tl.sum(rest.to(tl.int32), axis=0)
            hi = tl.max(tl.where(rest, digit, -1), axis=0)
        if n > 0:
            if hi == lo:  # all equal (ties)
                tl.atomic_add(hist_ptr + hi, n, sem="relaxed")
            else:
                tl.atomic_add(hist_ptr + digit, rest.to(tl.int32), mask=rest, sem="relaxed")
    elif n > 0:
        tl.atomic_add(hist_ptr + digit, mask.to(tl.int32), mask=mask, sem="relaxed")


@triton.jit
def _is_last(ticket_ptr, P):
    """True in the program that completes this launch's work on the row (the P-th to arrive).

    Every program's earlier global writes and atomics are visible to it: a CTA barrier, then one
    thread's acq_rel atomic on the row's ticket (the usual split-K semaphore pattern)."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == P - 1


@triton.jit
def _group_max_kernel(scores_ptr, lengths_ptr, ws_ptr, S, row_stride, P, k,
                      HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """Pass 0: digit-1 histogram of the maxima of each run of G positions (valid runs only); the
    last program stores dm (0 when fewer than k runs are valid)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ws = ws_ptr + b * _WS_ROW
    x = _load_scores(scores_ptr, lengths_ptr, b, pid * BLOCK + tl.arange(0, BLOCK), S, row_stride, HAS_LEN)
    # a max ignoring NaN can only under-estimate a run's maximum: dm stays a valid bound
    gmax = _to_key(tl.max(tl.reshape(x, [BLOCK // G, G]), axis=1))
    gmax = tl.reshape(gmax, [BLOCK // G], can_reorder=True)  # any order: lets it leave the sliced layout
    _hist_add(ws + _HM, (gmax >> 21) + 1024, gmax > _NEG_INF_KEY, 2048, W, 8)
    if _is_last(ws + _ST + 9, P):
        dm, _, km = _find_digit(ws + _HM, k, 2048)
        tl.store(ws + _ST + 1, tl.where(km < k, 0, dm))


@triton.jit
def _slot_keys(scores_ptr, lengths_ptr, cp_ptr, b, slot, n, S, row_stride, HAS_LEN: tl.constexpr, CAP: tl.constexpr):
    """(positions, keys, valid) of the n <= CAP candidates listed in candidate slot `slot`."""
    i = tl.arange(0, CAP)
    pos = tl.where(i < n, tl.load(cp_ptr + slot * CAP + i), 0)  # load not gated on n: one less round trip
    key, valid = _keys(scores_ptr, lengths_ptr, b, pos, S, row_stride, HAS_LEN)
    return pos, key, valid & (i < n)


@triton.jit
def _candidates_kernel(scores_ptr, lengths_ptr, ws_ptr, cc_ptr, cp_ptr, S, row_stride, P, k,
                       BOUND: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                       W: tl.constexpr):
    """Pass 1: the block's candidates (valid, digit 1 >= dm): count -> cc, positions in increasing
    order -> candidate slot (when at most CAP), digit 1 -> hist1 (histogram windows even for a few
    candidates: their digits 1 crowd into a few bins, per-element atomics would collide there).
    The last program finds d1."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ws = ws_ptr + b * _WS_ROW
    offs, key, valid = _row_keys(scores_ptr, lengths_ptr, b, pid, S, row_stride, HAS_LEN, BLOCK)
    tl.atomic_add(ws + _ST + 0, tl.sum(valid.to(tl.int32), axis=0), sem="relaxed")
    digit1 = (key >> 21) + 1024
    if BOUND:
        valid = valid & (digit1 >= tl.load(ws + _ST + 1))
    n = tl.sum(valid.to(tl.int32), axis=0)
    slot = b.to(tl.int64) * P + pid
    tl.store(cc_ptr + slot, n)
    if n <= CAP:  # rank of each candidate in the block: prefix over rows of 32, then within the row
        v2 = tl.reshape(valid.to(tl.int32), [BLOCK // 32, 32])
        rows = tl.sum(v2, axis=1)
        rank = (tl.cumsum(rows, axis=0) - rows)[:, None] + tl.cumsum(v2, axis=1) - 1
        tl.store(cp_ptr + slot * CAP + rank, tl.reshape(offs, [BLOCK // 32, 32]), mask=v2 > 0)
        tl.debug_barrier()  # the slot, read back by other threads of this program
        _pos, key_c, valid_c = _slot_keys(scores_ptr, lengths_ptr, cp_ptr, b, slot, n, S, row_stride, HAS_LEN, CAP)
        _hist_add(ws + _H1, (key_c >> 21) + 1024, valid_c, 2048, W, 8)
    else:
        _hist_add(ws + _H1, digit1, valid, 2048, W, 8)
    if _is_last(ws + _ST + 10, P):
        d1, k_rem, k_sel = _find_digit(ws + _H1, tl.minimum(tl.load(ws + _ST + 0, volatile=True), k), 2048)
        tl.store(ws + _ST + 2, d1)
        tl.store(ws + _ST + 3, k_rem)
        tl.store(ws + _ST + 4, k_sel)


@triton.jit
def _refine(ws, key, valid, d1, d2, PASS: tl.constexpr, W: tl.constexpr, SPARSE: tl.constexpr):
    """Pass 2: digit-2 histogram of the keys with digit 1 == d1; pass 3: digit 3 of those matching d1 d2."""
    match = valid & ((key >> 21) + 1024 == d1)
    if PASS == 2:
        _hist_add(ws + _H2, (key >> 10) & 0x7FF, match, 2048, W, SPARSE)
    else:
        _hist_add(ws + _H3, key & 0x3FF, match & (((key >> 10) & 0x7FF) == d2), 1024, W, SPARSE)


@triton.jit
def _refine_kernel(scores_ptr, lengths_ptr, ws_ptr, cc_ptr, cp_ptr, S, row_stride, P,
                   PASS: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                   W: tl.constexpr, SPARSE: tl.constexpr):
    """Pass 2 or 3 over the block's candidate slot (or, past CAP, its scores). The last program
    finds d2 (pass 2), or d3 and with it the threshold key T and `need` (pass 3)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ws = ws_ptr + b * _WS_ROW
    d1 = tl.load(ws + _ST + 2)
    d2 = tl.load(ws + _ST + 5)  # pass 3 only
    slot = b.to(tl.int64) * P + pid
    n = tl.load(cc_ptr + slot)
    if n <= CAP:
        _refine(ws, *_slot_keys(scores_ptr, lengths_ptr, cp_ptr, b, slot, n, S, row_stride, HAS_LEN, CAP)[1:], d1, d2,
                PASS, W, SPARSE)
    else:
        _refine(ws, *_row_keys(scores_ptr, lengths_ptr, b, pid, S, row_stride, HAS_LEN, BLOCK)[1:], d1, d2, PASS,
                W, SPARSE)
    if _is_last(ws + _ST + 9 + PASS, P):
        if PASS == 2:
            d2, k_rem, _ = _find_digit(ws + _H2, tl.load(ws + _ST + 3), 2048)
            tl.store(ws + _ST + 5, d2)
            tl.store(ws + _ST + 6, k_rem)
        else:
            d3, need, _ = _find_digit(ws + _H3, tl.load(ws + _ST + 6), 1024)
            tl.store(ws + _ST + 7, ((d1 - 1024) << 21) | (d2 << 10) | d3)  # T
            tl.store(ws + _ST + 8, need)


@triton.jit
def _count(key, valid, T):
    """(#(key > T), #(key == T)) over the valid keys."""
    return tl.sum((valid & (key > T)).to(tl.int32), axis=0), tl.sum((valid & (key == T)).to(tl.int32), axis=0)


@triton.jit
def _count_kernel(scores_ptr, lengths_ptr, ws_ptr, cc_ptr, cp_ptr, cnt_ptr, S, row_stride, P,
                  HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """cnt[0, b, pid] = #(key > T) and cnt[1, b, pid] = #(key == T) over the block."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    T = tl.load(ws_ptr + b * _WS_ROW + _ST + 7)
    slot = b.to(tl.int64) * P + pid
    n = tl.load(cc_ptr + slot)
    if n <= CAP:
        gt, eq = _count(*_slot_keys(scores_ptr, lengths_ptr, cp_ptr, b, slot, n, S, row_stride, HAS_LEN, CAP)[1:], T)
    else:
        gt, eq = _count(*_row_keys(scores_ptr, lengths_ptr, b, pid, S, row_stride, HAS_LEN, BLOCK)[1:], T)
    tl.store(cnt_ptr + slot, gt)
    tl.store(cnt_ptr + tl.num_programs(1) * P + slot, eq)


@triton.jit
def _write_sel(out_row, pos, key, valid, T, need, pre_gt, pre_eq):
    """Store the selected positions (key > T, or key == T among the first `need` ties) in order."""
    eq = valid & (key == T)
    tie_rank = pre_eq + tl.cumsum(eq.to(tl.int32), axis=0) - 1  # among the row's keys == T
    sel = (valid & (key > T)) | (eq & (tie_rank < need))
    slot = pre_gt + tl.minimum(pre_eq, need) + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot, pos.to(tl.int64), mask=sel)


@triton.jit
def _write_kernel(scores_ptr, lengths_ptr, ws_ptr, cc_ptr, cp_ptr, cnt_ptr, out_ptr, S, row_stride, P, k,
                  HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, P_POW2: tl.constexpr):
    """The block's selected positions, in position order, at their slots of out[b] (after the
    counts of the blocks before it); program 0 also writes the -1 padding."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ws = ws_ptr + b * _WS_ROW
    out_row = out_ptr + b.to(tl.int64) * k
    need = tl.load(ws + _ST + 8)
    gt_row = cnt_ptr + b * P
    eq_row = cnt_ptr + (tl.num_programs(1) + b) * P
    j = tl.arange(0, P_POW2)
    pre_gt = tl.sum(tl.load(gt_row + j, mask=j < pid, other=0), axis=0)
    pre_eq = tl.sum(tl.load(eq_row + j, mask=j < pid, other=0), axis=0)
    if (tl.load(gt_row + pid) > 0) | ((tl.load(eq_row + pid) > 0) & (pre_eq < need)):
        T = tl.load(ws + _ST + 7)
        slot = b.to(tl.int64) * P + pid
        n = tl.load(cc_ptr + slot)
        if n <= CAP:
            _write_sel(out_row, *_slot_keys(scores_ptr, lengths_ptr, cp_ptr, b, slot, n, S, row_stride, HAS_LEN, CAP),
                       T, need, pre_gt, pre_eq)
        else:
            _write_sel(out_row, *_row_keys(scores_ptr, lengths_ptr, b, pid, S, row_stride, HAS_LEN, BLOCK), T, need,
                       pre_gt, pre_eq)
    if pid == 0:
        k_sel = tl.load(ws + _ST + 4)
        for start in range(0, k, BLOCK):
            s = start + tl.arange(0, BLOCK)
            tl.store(out_row + s, tl.full([BLOCK], -1, tl.int64), mask=(s >= k_sel) & (s < k))


def _group_size(S: int, k: int) -> int:
    """Run length G of the pass-0 maxima: the largest power of two <= min(32, S / (2k)); 1 = no pass 0."""
    return max(1, min(32, 1 << max(0, (S // (2 * k)).bit_length() - 1)))


def topk_indices(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    block: int = 4096,
    num_warps: int = 8,
    window: int = 128,
    sparse: int = 128,
    group: int | None = None,
    cap: int = 256,
    slot_warps: int = 4,
    maxnreg: int | None = 64,
) -> torch.Tensor:
    """Positions of the k largest scores of each row among positions < lengths[b] with score > -inf.

    scores: fp32 [B, S] (any row stride); lengths: [B] integer on the same device (clamped to
    [0, S]) or None (all S). Returns int64 [B, k]: per row the min(k, #valid) selected positions in
    increasing order, then -1. The selected set equals `topk_reference`'s (ties: the earlier
    position wins). out: optional contiguous int64 [B, k] buffer (every element is written).
    Tuning only (the result does not depend on them): block (positions per program), window (bins
    per histogram window), cap (candidate slots per block): powers of two, block >= 32, window
    >= 32; num_warps (passes 0 and 1, which scan the scores), slot_warps (the passes over the
    candidate slots), maxnreg (register cap: 64 keeps 4 8-warp programs per SM, no spills); sparse
    (most matches counted by per-element atomics in passes 2 and 3); group (pass-0 run length, a
    power of two <= block, 1 = no pass 0; default `_group_size`).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [B, S], got {scores.dtype} {tuple(scores.shape)}")
    B, S = scores.shape
    if out is None:
        out = torch.empty(B, k, dtype=torch.int64, device=scores.device)
    elif out.shape != (B, k) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [{B}, {k}] tensor")
    if lengths is not None and lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = [{B}], got {tuple(lengths.shape)}")
    for name, v, lo in (("block", block, 32), ("window", window, 32), ("cap", cap, 1)):
        if v < lo or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {lo}, got {v}")
    if B == 0:
        return out
    if S == 0:
        return out.fill_(-1)
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    G = _group_size(S, k) if group is None else group
    P = triton.cdiv(S, block)
    dev = scores.device
    ws = torch.zeros(B, WS_ROW, dtype=torch.int32, device=dev)
    cc = torch.empty(B, P, dtype=torch.int32, device=dev)  # candidates per block
    cp = torch.empty(B, P, cap, dtype=torch.int32, device=dev)  # their positions (blocks with <= cap)
    cnt = torch.empty(2, B, P, dtype=torch.int32, device=dev)  # per block: #(key > T), #(key == T)
    lens = lengths if lengths is not None else ws  # not read without lengths
    a = (scores, lens, ws)
    st = scores.stride(0)
    meta = dict(HAS_LEN=lengths is not None, BLOCK=block, maxnreg=maxnreg)
    dense = dict(meta, num_warps=num_warps)
    slots = dict(meta, num_warps=slot_warps, CAP=cap)
    grid = (P, B)
    if G > 1:
        _group_max_kernel[grid](*a, S, st, P, k, G=G, W=window, **dense)
    _candidates_kernel[grid](*a, cc, cp, S, st, P, k, BOUND=G > 1, CAP=cap, W=window, **dense)
    for p in (2, 3):
        _refine_kernel[grid](*a, cc, cp, S, st, P, PASS=p, W=window, SPARSE=sparse, **slots)
    _count_kernel[grid](*a, cc, cp, cnt, S, st, P, **slots)
    _write_kernel[grid](*a, cc, cp, cnt, out, S, st, P, k, P_POW2=max(2, triton.next_power_of_2(P)), **slots)
    return out
