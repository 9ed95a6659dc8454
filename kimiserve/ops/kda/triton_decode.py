"""One KDA layer's decode step for one token per sequence as a single Triton kernel (issue 15):
short conv of q, k, v from the conv state page, L2 norm of q and k, the gate, beta, the delta-rule
update of the recurrent state page in place, and the gated RMSNorm of the output.

The same contract and arithmetic as `kimiserve.ops.kda.paged.kda_decode_step` (the reference, the
composition of the ops the layer runs elsewhere), only summation orders differ: the conv sums its
taps in fp32 and rounds to the model dtype after SiLU, q and k are normalised in fp32 and rounded to
the model dtype, the state update and the output dot are fp32, the output is rounded to the model
dtype before the norm (as the reference's o is), and the normed output is rounded once more.

One program per (sequence, head) holds that head's whole [K, V] fp32 state tile (K, V <= 128: 64 KB
in registers at 4 warps, 128 floats a thread; the sm_90 build takes 226 registers, no spills), so the
state page is read and written once, the conv state page once, and the head's output is complete for
the norm; no atomics, no host synchronisation (CUDA graphs).
That kernel (`_kda_steps_kernel`, `launch_steps`) loops over a chunk's positions: a decode step is
its one-position case, and speculative verify steps (`triton_verify`) run several positions per
sequence through the same compiled kernel, saving the state after each, so that every verify
position has the bits a decode step gives.

A split form (`block_v`, see below the single kernel): the conv, norms and gates
in a first kernel, the delta rule over [K, block_v] slices of the state in a second, the norm in a
third, with the same values (opt-in since session 13: `default_block_v`). And a one-launch
split form for small batches (`counters`, opt-in): the same V blocks in one kernel, each program recomputing
its head's q, k, gate and beta, the last of a head's programs to finish (an atomic counter per sequence and
head) doing the norm.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 128  # a program holds the head's [K, V] fp32 tile
# Warps of the steps kernel's programs. 4, not 8, from session 13's H200 run (`benchmarks/kda_decode_step.py`, us
# per call inside a graph of 16 layers): 9.1 against 14.4 us at 96 heads x batch 1, 5.7 against 11.1 at 12 x 1,
# 21.7 against 40.1 at 96 x 4, faster than the split forms there too.
STEPS_NUM_WARPS = 4


def supported(K: int, V: int, conv_size: int) -> bool:
    return K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM and 2 <= conv_size <= 8


@triton.jit
def _conv_load(x_ptr, w_ptr, conv_base, chan, mask, W: tl.constexpr, BW: tl.constexpr):
    """What the short conv of the channels `chan` of one token reads: (the conv state [channels, BW], the
    token's inputs x, the weights of the state taps, the weight of the current tap)."""
    ww = tl.arange(0, BW)
    m_state = mask[:, None] & (ww[None, :] < W - 1)
    state = tl.load(conv_base + chan[:, None] * (W - 1) + ww[None, :], mask=m_state, other=0.0)
    x = tl.load(x_ptr + chan, mask=mask, other=0.0)
    w_state = tl.load(w_ptr + chan[:, None] * W + ww[None, :], mask=m_state, other=0.0)
    w_cur = tl.load(w_ptr + chan * W + (W - 1), mask=mask, other=0.0)
    return state, x, w_state, w_cur


@triton.jit
def _conv_apply(state, x, w_state, w_cur, OUT_DTYPE: tl.constexpr):
    """SiLU(sum_j w[c, j] * [state, x][c, j]), rounded to the model dtype, returned in fp32."""
    y = tl.sum(state.to(tl.float32) * w_state, axis=1) + x.to(tl.float32) * w_cur
    y = y * tl.sigmoid(y)
    return y.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _conv_next_state(x, conv_base, chan, mask, W: tl.constexpr, BW: tl.constexpr):
    """The shifted conv state of the channels `chan` ([s_1 .. s_{W-2}, x]: the state read one column to the
    right, the token's input x in the last column), as a [channels, BW] tile; reads the page only."""
    ww = tl.arange(0, BW)
    m_shift = mask[:, None] & (ww[None, :] < W - 2)
    shifted = tl.load(conv_base + chan[:, None] * (W - 1) + ww[None, :] + 1, mask=m_shift, other=0.0)
    return tl.where(ww[None, :] == W - 2, x[:, None], shifted)


@triton.jit
def _conv_store(new_state, conv_base, chan, mask, W: tl.constexpr, BW: tl.constexpr):
    ww = tl.arange(0, BW)
    tl.store(conv_base + chan[:, None] * (W - 1) + ww[None, :], new_state, mask=mask[:, None] & (ww[None, :] < W - 1))


@triton.jit
def _conv_shift(x, conv_base, dst_base, chan, mask, W: tl.constexpr, BW: tl.constexpr):
    """Writes the shifted conv state of the channels `chan` (their last W-1 inputs, x the newest) read at
    conv_base to dst_base (which may be conv_base)."""
    new_state = _conv_next_state(x, conv_base, chan, mask, W, BW)
    tl.debug_barrier()  # every lane has read the state before any lane overwrites it
    _conv_store(new_state, dst_base, chan, mask, W, BW)


@triton.jit
def _conv_silu(x_ptr, w_ptr, conv_base, dst_base, chan, mask, W: tl.constexpr, BW: tl.constexpr,
               OUT_DTYPE: tl.constexpr):
    """SiLU(sum_j w[c, j] * [state, x][c, j]) for the channels `chan` of one token from the conv state at
    conv_base (the page, or a slot saved after the position before), rounded to the model dtype (returned in
    fp32); writes the shifted conv state (its last W-1 inputs) to dst_base (which may be conv_base)."""
    state, x, w_state, w_cur = _conv_load(x_ptr, w_ptr, conv_base, chan, mask, W, BW)
    y = _conv_apply(state, x, w_state, w_cur, OUT_DTYPE)
    _conv_shift(x, conv_base, dst_base, chan, mask, W, BW)
    return y


@triton.jit
def _l2_normalize(x, OUT_DTYPE: tl.constexpr):
    """x / ||x|| (fp32, eps 1e-6 under the root) rounded to the model dtype, returned in fp32."""
    return (x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _gate_beta_of(f, dt_bias, a_log, b_logit, lower_bound, HAS_LOWER_BOUND: tl.constexpr):
    """The gate g (log decay, fp32) and beta (fp32) of a head from its loaded f, dt_bias, A_log and b."""
    f = f.to(tl.float32) + dt_bias
    a = tl.exp(a_log)
    if HAS_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * f)
    else:  # -a * softplus(f), softplus as torch computes it (linear above 20)
        g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
    return g, tl.sigmoid(b_logit.to(tl.float32))


@triton.jit
def _gate_beta(f_ptr, b_ptr, x_off, b_off, a_log_ptr, dt_bias_ptr, h, lower_bound, kk, mk, K: tl.constexpr,
               HAS_LOWER_BOUND: tl.constexpr):
    """Head h's gate g (log decay, fp32 [K]) and beta (fp32) of one token."""
    return _gate_beta_of(tl.load(f_ptr + x_off + h * K + kk, mask=mk, other=0.0),
                         tl.load(dt_bias_ptr + h * K + kk, mask=mk, other=0.0), tl.load(a_log_ptr + h),
                         tl.load(b_ptr + b_off + h), lower_bound, HAS_LOWER_BOUND)


@triton.jit
def _mix_head(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, x_off, b_off, qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr,
              conv_base, h, lower_bound, kk, mk, vv, mv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Head h of one token before the delta rule: the short convs of q, k, v (conv pages shifted in place),
    SiLU, the L2 norms of q and k (each rounded to the model dtype), the gate g (log decay) and beta."""
    P = H * K
    k_base, v_base = conv_base + P * (W - 1), conv_base + 2 * P * (W - 1)
    q = _conv_silu(q_ptr + x_off, qw_ptr, conv_base, conv_base, h * K + kk, mk, W, BW, OUT_DTYPE)
    k = _conv_silu(k_ptr + x_off, kw_ptr, k_base, k_base, h * K + kk, mk, W, BW, OUT_DTYPE)
    v = _conv_silu(v_ptr + x_off, vw_ptr, v_base, v_base, h * V + vv, mv, W, BW, OUT_DTYPE)
    g, beta = _gate_beta(f_ptr, b_ptr, x_off, b_off, a_log_ptr, dt_bias_ptr, h, lower_bound, kk, mk, K,
                         HAS_LOWER_BOUND)
    return _l2_normalize(q, OUT_DTYPE), _l2_normalize(k, OUT_DTYPE), v, g, beta


@triton.jit
def _delta_rule_tile(S, decay, k, v, beta, q_scaled):
    """The delta-rule update of a [K, columns] fp32 state tile; returns (the new tile, the columns' output)."""
    S = S * decay[:, None]
    residual = v - tl.sum(S * k[:, None], axis=0)
    S = S + (beta * k)[:, None] * residual[None, :]
    return S, tl.sum(S * q_scaled[:, None], axis=0)


@triton.jit
def _delta_rule(state_ptr, s_off, m_s, decay, k, v, beta, q_scaled):
    """The delta-rule update of a [K, columns] state tile in place; returns the columns' output (fp32)."""
    S, o = _delta_rule_tile(tl.load(state_ptr + s_off, mask=m_s, other=0.0), decay, k, v, beta, q_scaled)
    tl.store(state_ptr + s_off, S, mask=m_s)
    return o


@triton.jit
def _rms_gate(o, gate, norm_w, mv, norm_eps, V: tl.constexpr):
    """RMSNorm(o) * norm_w * sigmoid(gate) of a head's whole row, fp32 (gate and norm_w loaded)."""
    o = o * tl.rsqrt(tl.sum(tl.where(mv, o * o, 0.0), axis=0) / V + norm_eps)
    return o * norm_w * tl.sigmoid(gate)


@triton.jit
def _gated_norm(o, gate_ptrs, norm_w_ptr, vv, mv, norm_eps, V: tl.constexpr):
    """KDA's output norm of a head's whole row: RMSNorm(o) * weight * sigmoid(gate), fp32."""
    gate = tl.load(gate_ptrs, mask=mv, other=0.0).to(tl.float32)
    return _rms_gate(o, gate, tl.load(norm_w_ptr + vv, mask=mv, other=0.0), mv, norm_eps, V)


@triton.jit
def _row_at(chunk_rows, t, pos_stride, j, identity_rows):
    """The packed row of position t of chunk j: grid[j, t], or j itself when identity_rows (decode: one position)."""
    listed = tl.load(chunk_rows + t * pos_stride, mask=identity_rows == 0, other=0).to(tl.int64)
    return tl.where(identity_rows == 0, listed, j.to(tl.int64))


# Arguments whose values or alignment differ between a decode step's launch and a verify step's (views of a
# merged projection or gathered rows, a page-id column of any stride, position counts, conv destinations): left
# unspecialised, so that both run one compiled kernel, hence the same thread layouts and summation orders. The
# state tile's pointers and strides stay specialised: at 16-float alignment its loads and stores are vectors and
# the tile keeps their layout (unaligned, the compiler spills it). The pool's page strides and the slots' are
# multiples of 16 floats, so decode and verify specialise alike in the engine (and in tests with such pages).
_PER_CALL_ARGS = ["q_ptr", "k_ptr", "v_ptr", "f_ptr", "b_ptr", "gate_ptr", "out_ptr", "q_stride", "k_stride",
                  "v_stride", "f_stride", "b_stride", "gate_stride", "grid_ptr", "grid_chunk_stride", "grid_pos_stride",
                  "identity_rows", "lengths_ptr", "has_lengths", "num_positions", "num_chunks", "pages_ptr",
                  "pages_stride", "conv_dst_ptr", "conv_dst_page_stride", "conv_dst_item_stride"]


@triton.jit(do_not_specialize=_PER_CALL_ARGS, do_not_specialize_on_alignment=_PER_CALL_ARGS)
def _kda_steps_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, out_ptr, q_stride, k_stride, v_stride, f_stride, b_stride, gate_stride,
    grid_ptr, grid_chunk_stride, grid_pos_stride, identity_rows, lengths_ptr, has_lengths, num_positions, num_chunks,
    qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_ptr, conv_page_stride, state_ptr, state_page_stride, pages_ptr, pages_stride,
    conv_dst_ptr, conv_dst_page_stride, conv_dst_item_stride, state_dst_ptr, state_dst_page_stride,
    state_dst_item_stride, lower_bound, scale, norm_eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    j = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + j * pages_stride).to(tl.int64)
    OUT_DTYPE = out_ptr.dtype.element_ty
    P = H * K
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    n = num_positions
    if has_lengths != 0:
        n = tl.load(lengths_ptr + j).to(tl.int32)
    chunk_rows = grid_ptr + j.to(tl.int64) * grid_chunk_stride
    conv_page = conv_ptr + page * conv_page_stride
    q_chan, k_chan, v_chan = h * K + kk, h * K + kk, h * V + vv
    s_head = h * K * V + kk[:, None] * V + vv[None, :]
    m_s = mk[:, None] & mv[None, :]
    for t in range(0, n):
        item = (t * num_chunks + j).to(tl.int64)  # slot [t, j]
        row = _row_at(chunk_rows, t, grid_pos_stride, j, identity_rows)
        conv_dst = conv_dst_ptr + page * conv_dst_page_stride + item * conv_dst_item_stride
        # the conv states before position t: the page's, or those saved to slot t - 1 (a pointer select; the
        # barrier makes the slot's stores by every lane visible)
        tl.debug_barrier()
        window = tl.where(t == 0, conv_page, conv_dst - num_chunks * conv_dst_item_stride)
        q = _conv_silu(q_ptr + row * q_stride, qw_ptr, window, conv_dst, q_chan, mk, W, BW, OUT_DTYPE)
        k = _conv_silu(k_ptr + row * k_stride, kw_ptr, window + P * (W - 1), conv_dst + P * (W - 1), k_chan, mk, W,
                       BW, OUT_DTYPE)
        v = _conv_silu(v_ptr + row * v_stride, vw_ptr, window + 2 * P * (W - 1), conv_dst + 2 * P * (W - 1), v_chan,
                       mv, W, BW, OUT_DTYPE)
        g, beta = _gate_beta(f_ptr, b_ptr, row * f_stride, row * b_stride, a_log_ptr, dt_bias_ptr, h, lower_bound, kk,
                             mk, K, HAS_LOWER_BOUND)
        q = _l2_normalize(q, OUT_DTYPE)
        k = _l2_normalize(k, OUT_DTYPE)
        # the state before position t: the page's, or the one this program saved to slot t - 1. A reload, not a
        # tile carried over the loop, and loaded after the convs: so the tile keeps its load's layout and the
        # vectors are converted to it (else the compiler moves the 64 KB tile to the convs' layout and back)
        before = tl.where(t == 0, state_ptr + page * state_page_stride,
                          state_dst_ptr + page * state_dst_page_stride + (item - num_chunks) * state_dst_item_stride)
        S = tl.load(before + s_head, mask=m_s, other=0.0)  # a select, not a branch: the load can issue early
        S, o = _delta_rule_tile(S, tl.exp(g), k, v, beta, q * scale)
        tl.store(state_dst_ptr + page * state_dst_page_stride + item * state_dst_item_stride + s_head, S, mask=m_s)
        o = _gated_norm(o.to(OUT_DTYPE).to(tl.float32), gate_ptr + row * gate_stride + h * V + vv, norm_w_ptr, vv, mv,
                        norm_eps, V)
        tl.store(out_ptr + row * (H * V) + h * V + vv, o.to(OUT_DTYPE), mask=mv)


def launch_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, out, grid=None, lengths=None, slots=None):
    """The single-kernel form for B chunks (page_ids [B], any stride, int64): one program per (chunk, head) runs
    the chunk's positions in order, each from the state the one before saved (fp32: the same bits as kept in
    registers), the head's whole [K, V] state tile in registers at a time.

    A decode step: grid None (chunk j is row j of q, k, v, f, b, gate and out, one position), slots None (the new
    states go back to the pages). Verify positions: grid [B, T] int64 (the packed row of position t of chunk j),
    lengths [B] int64 or None (all T), slots (conv_slots [T, B, 3, H * K, W - 1], state_slots [T, B, H, K, V])
    receive the states after every position; the pages are only read. Inputs: rows at any stride (views of one
    merged projection's output; copied only where the last stride is not 1). Both uses launch one compiled kernel
    (`_PER_CALL_ARGS`), so a verify position's bits are a decode step's."""
    q, k, v, f, b, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, f, b, gate))
    H, K, V = states.shape[1:]
    W = weights.q_conv.shape[-1]
    B = page_ids.shape[0]
    page_ids = page_ids if page_ids.dtype == torch.int64 else page_ids.to(torch.int64)  # one kernel signature
    if B == 0:
        return out
    if grid is None:
        T, grid_ptr, grid_strides, identity = 1, page_ids, (0, 0), 1
        conv_dst, conv_dst_strides = conv, (conv.stride(0), 0)
        state_dst, state_dst_strides = states, (states.stride(0), 0)
    else:
        grid = grid if grid.dtype == torch.int64 else grid.to(torch.int64)
        T, grid_ptr, grid_strides, identity = grid.shape[1], grid, grid.stride(), 0
        conv_slots, state_slots = slots
        conv_dst, conv_dst_strides = conv_slots, (0, conv_slots.stride(1))
        state_dst, state_dst_strides = state_slots, (0, state_slots.stride(1))
    if lengths is not None and lengths.dtype != torch.int64:
        lengths = lengths.to(torch.int64)
    lower = weights.lower_bound
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _kda_steps_kernel[(B, H)](
            q, k, v, f, b, gate, out, *(x.stride(0) for x in (q, k, v, f, b, gate)),
            grid_ptr, *grid_strides, identity, page_ids if lengths is None else lengths, int(lengths is not None), T, B,
            weights.q_conv, weights.k_conv, weights.v_conv, weights.A_log, weights.dt_bias, weights.norm_weight,
            conv, conv.stride(0), states, states.stride(0), page_ids, page_ids.stride(0),
            conv_dst, *conv_dst_strides, state_dst, *state_dst_strides,
            0.0 if lower is None else float(lower), K ** -0.5, float(weights.eps),
            H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
            BW=triton.next_power_of_2(W - 1), HAS_LOWER_BOUND=lower is not None, num_warps=STEPS_NUM_WARPS,
        )
    return out


# The split form for larger batches: three kernels, so that a head's V columns spread over programs.
# 1. `_kda_mix_kernel`, one program per (sequence, head): the short convs (each conv page read and
#    shifted once, by the one program that owns its channels: no race), SiLU, the L2 norms, the
#    decay exp(g), beta; q * scale, k, decay, v and beta go to an fp32 scratch row per head, each
#    value computed with the same operations and rounding points as the single kernel (`_mix_head`).
# 2. `_kda_delta_kernel`, one program per (sequence, head, BV columns of V): the delta rule on the
#    [K, BV] slice of the state page in place (columns are independent: the residual and the output
#    of a column only sum over K), o rounded to the model dtype into the output.
# 3. `_kda_norm_kernel`, one program per (sequence, head): the gated RMSNorm over the head's whole
#    o row, in place in the output.
# The kernels follow each other on the stream: no atomics, no host synchronisation (CUDA graphs).


@triton.jit
def _kda_mix_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, row_stride, b_stride,
    qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr,
    conv_ptr, conv_page_stride, pages_ptr, mixed_ptr, lower_bound, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + row).to(tl.int64)
    OUT_DTYPE = v_ptr.dtype.element_ty  # the model dtype, the output's
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    q, k, v, g, beta = _mix_head(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, row.to(tl.int64) * row_stride,
                                 row.to(tl.int64) * b_stride, qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr,
                                 conv_ptr + page * conv_page_stride, h, lower_bound, kk, mk, vv, mv,
                                 H, K, V, W, BW, HAS_LOWER_BOUND, OUT_DTYPE)

    # the head's scratch row: [q * scale (K), k (K), exp(g) (K), v (V), beta]
    base = mixed_ptr + (row.to(tl.int64) * H + h) * (3 * K + V + 1)
    tl.store(base + kk, q * scale, mask=mk)
    tl.store(base + K + kk, k, mask=mk)
    tl.store(base + 2 * K + kk, tl.exp(g), mask=mk)
    tl.store(base + 3 * K + vv, v, mask=mv)
    tl.store(base + 3 * K + V, beta)


@triton.jit
def _kda_delta_kernel(
    mixed_ptr, out_ptr, state_ptr, state_page_stride, pages_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + row).to(tl.int64)
    OUT_DTYPE = out_ptr.dtype.element_ty
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    base = mixed_ptr + (row.to(tl.int64) * H + h) * (3 * K + V + 1)
    q = tl.load(base + kk, mask=mk, other=0.0)
    k = tl.load(base + K + kk, mask=mk, other=0.0)
    decay = tl.load(base + 2 * K + kk, mask=mk, other=0.0)
    v = tl.load(base + 3 * K + vv, mask=mv, other=0.0)
    beta = tl.load(base + 3 * K + V)

    s_off = page * state_page_stride + h * K * V + kk[:, None] * V + vv[None, :]
    m_s = mk[:, None] & mv[None, :]
    o = _delta_rule(state_ptr, s_off, m_s, decay, k, v, beta, q)
    tl.store(out_ptr + row.to(tl.int64) * (H * V) + h * V + vv, o.to(OUT_DTYPE), mask=mv)


@triton.jit
def _kda_norm_kernel(out_ptr, gate_ptr, row_stride, norm_w_ptr, norm_eps, H: tl.constexpr, V: tl.constexpr,
                     BV: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    OUT_DTYPE = out_ptr.dtype.element_ty
    vv = tl.arange(0, BV)
    mv = vv < V
    o_ptrs = out_ptr + row.to(tl.int64) * (H * V) + h * V + vv
    o = tl.load(o_ptrs, mask=mv, other=0.0).to(tl.float32)
    o = _gated_norm(o, gate_ptr + row.to(tl.int64) * row_stride + h * V + vv, norm_w_ptr, vv, mv, norm_eps, V)
    tl.store(o_ptrs, o.to(OUT_DTYPE), mask=mv)


# The one-launch split form for small batches (`counters` given): one kernel over (sequence, head, V block),
# so that a batch-1 step spreads each head's state over n_blocks programs without three launches.
# Each program issues all its global reads first (its [K, BV] state slice, the conv states and inputs,
# the gate row, the norm weight: their latencies overlap), recomputes its head's q and k (short conv
# read from the conv page, not written; SiLU, L2 norm), the gate and beta, and the short conv of its own
# V columns only; runs the delta rule on its state slice; writes its o columns (rounded to the model
# dtype) and, after a block barrier, its V columns' shifted conv state (those channels are its alone);
# then counts itself in at the (sequence, head)'s counter (an acq_rel atomic after that barrier: its o
# columns and its reads of the q, k conv state come before).
# The program that arrives last (old count n_blocks - 1; any block, in whatever order they ran) reads the
# head's whole o row back from global memory, writes the gated RMSNorm over it in place, shifts the q and
# k conv state of the head (every other program has read it: they arrived before), and resets the
# counter to 0 for the next launch (a CUDA graph replays the same counters).


@triton.jit
def _kda_one_launch_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, out_ptr, row_stride, b_stride,
    qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_ptr, conv_page_stride, state_ptr, state_page_stride, pages_ptr, counters_ptr,
    lower_bound, scale, norm_eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BV_ROW: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + row).to(tl.int64)
    OUT_DTYPE = out_ptr.dtype.element_ty
    P = H * K
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    x_off = row.to(tl.int64) * row_stride
    conv_base = conv_ptr + page * conv_page_stride
    k_base = conv_base + P * (W - 1)
    v_base = conv_base + 2 * P * (W - 1)
    # every global read first, so that their latencies overlap: the state slice, the convs' states,
    # inputs and weights (and their next states), the gate's inputs, and the gate row and the norm weight
    # (for the norm, should this block be the head's last)
    s_off = page * state_page_stride + h * K * V + kk[:, None] * V + vv[None, :]
    m_s = mk[:, None] & mv[None, :]
    S = tl.load(state_ptr + s_off, mask=m_s, other=0.0)
    state_q, x_q, w_q, w_q_cur = _conv_load(q_ptr + x_off, qw_ptr, conv_base, h * K + kk, mk, W, BW)
    state_k, x_k, w_k, w_k_cur = _conv_load(k_ptr + x_off, kw_ptr, k_base, h * K + kk, mk, W, BW)
    state_v, x_v, w_v, w_v_cur = _conv_load(v_ptr + x_off, vw_ptr, v_base, h * V + vv, mv, W, BW)
    next_q = _conv_next_state(x_q, conv_base, h * K + kk, mk, W, BW)
    next_k = _conv_next_state(x_k, k_base, h * K + kk, mk, W, BW)
    next_v = _conv_next_state(x_v, v_base, h * V + vv, mv, W, BW)
    f = tl.load(f_ptr + x_off + h * K + kk, mask=mk, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + h * K + kk, mask=mk, other=0.0)
    a_log = tl.load(a_log_ptr + h)
    b_logit = tl.load(b_ptr + row.to(tl.int64) * b_stride + h)
    ww = tl.arange(0, BV_ROW)
    mw = ww < V
    gate = tl.load(gate_ptr + x_off + h * V + ww, mask=mw, other=0.0).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + ww, mask=mw, other=0.0)

    q = _l2_normalize(_conv_apply(state_q, x_q, w_q, w_q_cur, OUT_DTYPE), OUT_DTYPE)
    k = _l2_normalize(_conv_apply(state_k, x_k, w_k, w_k_cur, OUT_DTYPE), OUT_DTYPE)
    v = _conv_apply(state_v, x_v, w_v, w_v_cur, OUT_DTYPE)
    g, beta = _gate_beta_of(f, dt_bias, a_log, b_logit, lower_bound, HAS_LOWER_BOUND)
    S, o = _delta_rule_tile(S, tl.exp(g), k, v, beta, q * scale)
    tl.store(state_ptr + s_off, S, mask=m_s)
    o_row = out_ptr + row.to(tl.int64) * (H * V) + h * V
    tl.store(o_row + vv, o.to(OUT_DTYPE), mask=mv)
    tl.debug_barrier()  # every lane's o columns stored and conv state read: before the arrival and the v store
    _conv_store(next_v, v_base, h * V + vv, mv, W, BW)  # this block's v channels: no other block reads them
    counter = counters_ptr + row * H + h
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(2) - 1:  # every other block has stored its o columns and read the q, k conv state
        _conv_store(next_q, conv_base, h * K + kk, mk, W, BW)
        _conv_store(next_k, k_base, h * K + kk, mk, W, BW)
        o_all = tl.load(o_row + ww, mask=mw, other=0.0, cache_modifier=".cg").to(tl.float32)  # from L2
        o_all = _rms_gate(o_all, gate, norm_w, mw, norm_eps, V)
        tl.store(o_row + ww, o_all.to(OUT_DTYPE), mask=mw)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


class StepCounters:
    """The one-launch split form's arrival counters: int32 zeros, one per (sequence, head), a buffer per
    device, grown on demand; every launch leaves them zero again, so one instance serves every layer (they
    run one after another on a stream) and every CUDA-graph replay. Held by whoever holds the op (e.g. the
    `functools.partial` of `kda_decode_step` on a `DecodeOps`): not process-global. Two launches on
    different streams at once must not share one. A buffer cannot grow while a CUDA graph captures (its
    zero fill would not run): give `capacity` >= the largest batch x heads, or call the step once at the
    largest batch before capturing. Outgrown buffers are kept (graphs captured earlier still point at them)."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.buffers: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        held = self.buffers.setdefault(device, [])
        if held and held[-1].numel() >= n:
            return held[-1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"the one-launch KDA decode step needs {n} counters on {device} but holds "
                             f"{held[-1].numel() if held else 0} and cannot allocate zeroed ones while a CUDA graph "
                             "captures: make StepCounters(capacity) with capacity >= max batch x heads, or run the "
                             "step once at the largest batch before capturing")
        held.append(torch.zeros(max(n, self.capacity, 2 * held[-1].numel() if held else 0), dtype=torch.int32,
                                device=device))
        return held[-1]


def default_block_v(batch: int, H: int, K: int, V: int) -> int | None:
    """The V block of the split form for a batch of `batch` sequences at `H` heads of K x V, or None for
    the single kernel: None at every size. At 8 warps (session 5) the split with 32-column blocks was 1.5-1.7x
    faster from 768 head-sequences up; at 4 warps (`STEPS_NUM_WARPS`, session 13) the single kernel is the
    faster at every size timed on the H200 (`benchmarks/kda_decode_step.py`, 128 x 128 heads, us per call in a
    graph of 16 layers: 96 heads x batch 8 37.9 against 39.0 for the split, x 64 257.7 against 274.5, 12 x 64
    38.4 against 39.5; one call alone at 96 x 256 995.7 against 1107.4, level at 12 x 128, 78.0 against 77.5).
    The split stays for an explicit block_v."""
    return None


def kda_decode_step(q, k, v, f, b, gate, weights, conv, states, page_ids, fallback=None, block_v="auto",
                    counters: StepCounters | None = None):
    """See `kimiserve.ops.kda.paged.kda_decode_step`: q, k, v, f, gate [Bd, H * K] (one token per
    sequence, model dtype), b [Bd, H]; conv the pool's conv view [P, 3, H * K, W - 1], states its
    recurrent view [P, H, K, V] fp32, page_ids [Bd] distinct. Updates those pages in place and returns
    the gated, normed output [Bd, H, V]. Shapes the kernels do not take (head dims over 128, pages
    not contiguous) run the reference composition around `fallback` (a `kda_decode`).

    block_v: None for the single kernel (one program per sequence and head), a power of two for the
    split form (the head's V columns in blocks of block_v over programs; three kernels), "auto" for
    `default_block_v`'s choice. counters (a `StepCounters`, with a power-of-two block_v): the one-launch
    split form instead (opt-in: not yet run on a GPU). All forms compute the same values (each state
    column sums over K as in the single kernel); the one-launch form repeats the split form's operations
    on each value, so under the interpreter it is bit-equal to it, and on a GPU only the compiler's
    choice of thread layout for a sum (the L2 norms over K, the RMS over V) can move a last bit."""
    def power_of_two(n) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)

    if counters is not None and not power_of_two(block_v):
        raise ValueError(f"the one-launch form (counters given) needs block_v a power of two (a V block size), "
                         f"got {block_v!r}")
    if block_v == "auto":
        block_v = default_block_v(q.shape[0], *states.shape[1:])
    if block_v is not None and not power_of_two(block_v):
        raise ValueError(f"block_v must be None, 'auto' or a power of two (a V block size), got {block_v!r}")
    H, K, V = states.shape[1:]
    W = weights.q_conv.shape[-1]
    Bd = q.shape[0]
    contiguous = states[0].stride() == (K * V, V, 1) and conv[0].stride() == (conv.shape[2] * (W - 1), W - 1, 1)
    if not supported(K, V, W) or not contiguous or V != K:
        from kimiserve.ops.kda import paged

        return paged.kda_decode_step(q, k, v, f, b, gate, weights, conv, states, page_ids,
                                     kda_decode=fallback or paged.kda_decode)
    out = torch.empty(Bd, H, V, dtype=v.dtype, device=v.device)
    if Bd == 0:
        return out
    if block_v is None:  # the single kernel: rows at any stride (views of one merged projection's output)
        return launch_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, out)
    xs = [t.contiguous() for t in (q, k, v, f, gate)]  # [Bd, H * K] each: one row stride
    row_stride = xs[0].stride(0)
    b = b.contiguous()
    lower = weights.lower_bound
    pages = page_ids.to(torch.int32)
    sizes = dict(BK=triton.next_power_of_2(K), BW=triton.next_power_of_2(W - 1), HAS_LOWER_BOUND=lower is not None)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        bv = min(block_v, triton.next_power_of_2(V))
        if counters is not None:
            _kda_one_launch_kernel[(Bd, H, triton.cdiv(V, bv))](
                *xs[:3], xs[3], b, xs[4], out, row_stride, b.stride(0),
                weights.q_conv, weights.k_conv, weights.v_conv, weights.A_log, weights.dt_bias, weights.norm_weight,
                conv, conv.stride(0), states, states.stride(0), pages, counters.get(Bd * H, v.device),
                0.0 if lower is None else float(lower), K ** -0.5, float(weights.eps),
                H=H, K=K, V=V, W=W, BV=bv, BV_ROW=triton.next_power_of_2(V), **sizes,
                num_warps=8 if sizes["BK"] * bv > 4096 else 4,
            )
            return out
        mixed = torch.empty(Bd, H, 3 * K + V + 1, dtype=torch.float32, device=v.device)
        _kda_mix_kernel[(Bd, H)](
            *xs[:4], b, row_stride, b.stride(0),
            weights.q_conv, weights.k_conv, weights.v_conv, weights.A_log, weights.dt_bias,
            conv, conv.stride(0), pages, mixed, 0.0 if lower is None else float(lower), K ** -0.5,
            H=H, K=K, V=V, W=W, BV=triton.next_power_of_2(V), **sizes, num_warps=4,
        )
        _kda_delta_kernel[(Bd, H, triton.cdiv(V, bv))](
            mixed, out, states, states.stride(0), pages, H=H, K=K, V=V, BK=sizes["BK"], BV=bv,
            num_warps=8 if sizes["BK"] * bv > 4096 else 4,
        )
        _kda_norm_kernel[(Bd, H)](out, xs[4], row_stride, weights.norm_weight, float(weights.eps),
                                  H=H, V=V, BV=triton.next_power_of_2(V), num_warps=4)
    return out


__all__ = ["MAX_HEAD_DIM", "StepCounters", "default_block_v", "kda_decode_step", "launch_steps", "supported"]
