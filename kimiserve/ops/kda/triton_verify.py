"""A KDA layer's speculative verify positions in one Triton launch (`paged.kda_verify_steps`' contract):
T positions of B chunks, each chunk's state pages read once and never written, the state after every
position saved to its slot, so that committing the accepted tokens is a copy of one slot per chunk.

One program per (chunk, head) loops over the chunk's positions t < lengths[j] with the head's [K, V] fp32
state tile in registers (the pool's state dtype is fp32: a store and load would give the same bits), and
per position does what `triton_decode._kda_decode_step_kernel` does for one token, with the same helpers
and operations in the same order: the short convs, SiLU, L2 norms, gate and beta, the delta rule, the
rounded output and its gated norm. The short conv's window before position t is the last W - 1 entries of
[the conv page, x_0 .. x_{t-1}], loaded from the page and from the earlier positions' input rows, each input
rounded to the conv page's dtype as the decode step's store to the page rounds it; the window after
position t goes to conv slot t. So every position's output and slots are bit for bit what the decode
kernel gives (and leaves in the pages) when the chunk's tokens are decoded one step at a time.

The single decode kernel only: where the decode step would take its V-split form (`default_block_v`, from
768 head-sequences up; or an explicit block_v / one-launch counters), and for shapes the decode kernel does
not take, the positions run as `paged.kda_verify_steps`' loop of that very decode step.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kimiserve.ops.kda import paged
from kimiserve.ops.kda.triton_decode import (_conv_apply, _conv_store, _delta_rule_tile, _gate_beta, _gated_norm,
                                             _l2_normalize, default_block_v, kda_decode_step, supported)


@triton.jit
def _conv_window(x_ptr, row_stride, chunk_rows, rows_pos_stride, page_base, chan, mask, t,
                 W: tl.constexpr, BW: tl.constexpr, CONV_DTYPE: tl.constexpr):
    """The conv state [channels, BW] (conv dtype; columns past W - 2 zero) of the channels `chan` before
    position t: the last W - 1 entries of [the page's W - 1 columns, the inputs x_0 .. x_{t-1}]."""
    ww = tl.arange(0, BW)
    src = t + ww  # index into [page columns, x_0, x_1, ...]
    col = ww < W - 1
    in_x = col & (src >= W - 1)
    from_page = mask[:, None] & (col & (src < W - 1))[None, :]
    from_x = mask[:, None] & in_x[None, :]
    rows = tl.load(chunk_rows + tl.maximum(src - (W - 1), 0) * rows_pos_stride, mask=in_x, other=0).to(tl.int64)
    page = tl.load(page_base + chan[:, None] * (W - 1) + src[None, :], mask=from_page, other=0.0)
    x = tl.load(x_ptr + rows[None, :] * row_stride + chan[:, None], mask=from_x, other=0.0)
    return tl.where(from_x, x.to(CONV_DTYPE), page)


@triton.jit
def _conv_position(x_ptr, row_off, row_stride, chunk_rows, rows_pos_stride, page_base, slot_base, w_state, w_cur,
                   chan, mask, t, W: tl.constexpr, BW: tl.constexpr, CONV_DTYPE: tl.constexpr,
                   OUT_DTYPE: tl.constexpr):
    """`triton_decode._conv_silu` of position t from its window; the window after t goes to the slot."""
    state = _conv_window(x_ptr, row_stride, chunk_rows, rows_pos_stride, page_base, chan, mask, t, W, BW, CONV_DTYPE)
    x = tl.load(x_ptr + row_off + chan, mask=mask, other=0.0)
    y = _conv_apply(state, x, w_state, w_cur, OUT_DTYPE)
    after = _conv_window(x_ptr, row_stride, chunk_rows, rows_pos_stride, page_base, chan, mask, t + 1, W, BW,
                         CONV_DTYPE)
    _conv_store(after, slot_base, chan, mask, W, BW)
    return y


@triton.jit
def _conv_weights(w_ptr, chan, mask, W: tl.constexpr, BW: tl.constexpr):
    ww = tl.arange(0, BW)
    w_state = tl.load(w_ptr + chan[:, None] * W + ww[None, :], mask=mask[:, None] & (ww[None, :] < W - 1), other=0.0)
    return w_state, tl.load(w_ptr + chan * W + (W - 1), mask=mask, other=0.0)


@triton.jit
def _kda_verify_steps_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, out_ptr, q_stride, k_stride, v_stride, f_stride, b_stride, gate_stride,
    grid_ptr, grid_chunk_stride, grid_pos_stride, lengths_ptr, num_chunks,
    qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_ptr, conv_page_stride, state_ptr, state_page_stride, pages_ptr, pages_stride, conv_slots_ptr, state_slots_ptr,
    lower_bound, scale, norm_eps,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, HAS_LENGTHS: tl.constexpr,
):
    j = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + j * pages_stride).to(tl.int64)
    OUT_DTYPE = out_ptr.dtype.element_ty
    CONV_DTYPE = conv_ptr.dtype.element_ty
    P = H * K
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths_ptr + j)
    chunk_rows = grid_ptr + j.to(tl.int64) * grid_chunk_stride
    conv_page = conv_ptr + page * conv_page_stride
    q_chan, k_chan, v_chan = h * K + kk, h * K + kk, h * V + vv
    wq, wq_cur = _conv_weights(qw_ptr, q_chan, mk, W, BW)
    wk, wk_cur = _conv_weights(kw_ptr, k_chan, mk, W, BW)
    wv, wv_cur = _conv_weights(vw_ptr, v_chan, mv, W, BW)
    s_head = h * K * V + kk[:, None] * V + vv[None, :]
    m_s = mk[:, None] & mv[None, :]
    S = tl.load(state_ptr + page * state_page_stride + s_head, mask=m_s, other=0.0)
    for t in range(0, n):
        row = tl.load(chunk_rows + t * grid_pos_stride).to(tl.int64)
        item = (t * num_chunks + j).to(tl.int64)  # slot [t, j]
        slot = conv_slots_ptr + item * (3 * P * (W - 1))
        q = _conv_position(q_ptr, row * q_stride, q_stride, chunk_rows, grid_pos_stride, conv_page, slot, wq, wq_cur,
                           q_chan, mk, t, W, BW, CONV_DTYPE, OUT_DTYPE)
        k = _conv_position(k_ptr, row * k_stride, k_stride, chunk_rows, grid_pos_stride, conv_page + P * (W - 1),
                           slot + P * (W - 1), wk, wk_cur, k_chan, mk, t, W, BW, CONV_DTYPE, OUT_DTYPE)
        v = _conv_position(v_ptr, row * v_stride, v_stride, chunk_rows, grid_pos_stride, conv_page + 2 * P * (W - 1),
                           slot + 2 * P * (W - 1), wv, wv_cur, v_chan, mv, t, W, BW, CONV_DTYPE, OUT_DTYPE)
        g, beta = _gate_beta(f_ptr, b_ptr, row * f_stride, row * b_stride, a_log_ptr, dt_bias_ptr, h, lower_bound, kk, mk, K,
                             HAS_LOWER_BOUND)
        q = _l2_normalize(q, OUT_DTYPE)
        k = _l2_normalize(k, OUT_DTYPE)
        S, o = _delta_rule_tile(S, tl.exp(g), k, v, beta, q * scale)
        tl.store(state_slots_ptr + item * (H * K * V) + s_head, S, mask=m_s)
        o = _gated_norm(o.to(OUT_DTYPE).to(tl.float32), gate_ptr + row * gate_stride + h * V + vv, norm_w_ptr, vv, mv, norm_eps, V)
        tl.store(out_ptr + row * (H * V) + h * V + vv, o.to(OUT_DTYPE), mask=mv)


def kda_verify_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, grid, lengths, active, out, conv_slots,
                     state_slots, fallback=None, block_v="auto", counters=None):
    """See `paged.kda_verify_steps`; fallback, block_v and counters as `triton_decode.kda_decode_step`
    takes them (the decode step whose form and bits the positions have)."""
    H, K, V = states.shape[1:]
    W = weights.q_conv.shape[-1]
    B, T = grid.shape
    contiguous = (states[0].stride() == (K * V, V, 1) and conv[0].stride() == (conv.shape[2] * (W - 1), W - 1, 1)
                  and conv_slots.is_contiguous() and state_slots.is_contiguous() and out.is_contiguous())
    if block_v == "auto":
        block_v = default_block_v(B, H, K, V)
    if block_v is not None or counters is not None or not supported(K, V, W) or not contiguous or V != K:
        step = lambda *a: kda_decode_step(*a, fallback=fallback, block_v=block_v, counters=counters)  # noqa: E731
        return paged.kda_verify_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, grid, lengths, active,
                                      out, conv_slots, state_slots, decode_step=step)
    if B == 0:
        return out
    xs = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, f, b, gate)]  # rows at any stride (views
    # of one merged projection's output)
    lower = weights.lower_bound
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _kda_verify_steps_kernel[(B, H)](
            *xs, out, *(t.stride(0) for t in xs),
            grid, grid.stride(0), grid.stride(1), lengths if lengths is not None else grid, B,
            weights.q_conv, weights.k_conv, weights.v_conv, weights.A_log, weights.dt_bias, weights.norm_weight,
            conv, conv.stride(0), states, states.stride(0), page_ids, page_ids.stride(0), conv_slots, state_slots,
            0.0 if lower is None else float(lower), K ** -0.5, float(weights.eps),
            T=T, H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
            BW=triton.next_power_of_2(W - 1), HAS_LOWER_BOUND=lower is not None, HAS_LENGTHS=lengths is not None,
            num_warps=8 if K * V > 4096 else 4,
        )
    return out


__all__ = ["kda_verify_steps"]
