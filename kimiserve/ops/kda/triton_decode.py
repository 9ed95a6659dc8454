"""One KDA layer's decode step for one token per sequence as a single Triton kernel (issue 15):
short conv of q, k, v from the conv state page, L2 norm of q and k, the gate, beta, the delta-rule
update of the recurrent state page in place, and the gated RMSNorm of the output.

The same contract and arithmetic as `kimiserve.ops.kda.paged.kda_decode_step` (the reference, the
composition of the ops the layer runs elsewhere), only summation orders differ: the conv sums its
taps in fp32 and rounds to the model dtype after SiLU, q and k are normalised in fp32 and rounded to
the model dtype, the state update and the output dot are fp32, the output is rounded to the model
dtype before the norm (as the reference's o is), and the normed output is rounded once more.

One program per (sequence, head) holds that head's whole [K, V] fp32 state tile (K, V <= 128: 64 KB
in registers at 8 warps), so the state page is read and written once, the conv state page once,
and the head's output is complete for the norm; no atomics, no host synchronisation (CUDA graphs).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 128  # a program holds the head's [K, V] fp32 tile


def supported(K: int, V: int, conv_size: int) -> bool:
    return K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM and 2 <= conv_size <= 8


@triton.jit
def _conv_silu(x_ptr, w_ptr, conv_base, chan, mask, W: tl.constexpr, BW: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """SiLU(sum_j w[c, j] * [state, x][c, j]) for the channels `chan` of one token, rounded to the model
    dtype; writes the shifted conv state (its last W-1 inputs) back to the page."""
    ww = tl.arange(0, BW)
    m_state = mask[:, None] & (ww[None, :] < W - 1)
    state = tl.load(conv_base + chan[:, None] * (W - 1) + ww[None, :], mask=m_state, other=0.0)
    x = tl.load(x_ptr + chan, mask=mask, other=0.0)
    w_state = tl.load(w_ptr + chan[:, None] * W + ww[None, :], mask=m_state, other=0.0)
    w_cur = tl.load(w_ptr + chan * W + (W - 1), mask=mask, other=0.0)
    y = tl.sum(state.to(tl.float32) * w_state, axis=1) + x.to(tl.float32) * w_cur
    y = y * tl.sigmoid(y)
    # new state [s_1 .. s_{W-2}, x]: the state read one column to the right, x in the last column
    m_shift = mask[:, None] & (ww[None, :] < W - 2)
    shifted = tl.load(conv_base + chan[:, None] * (W - 1) + ww[None, :] + 1, mask=m_shift, other=0.0)
    new_state = tl.where(ww[None, :] == W - 2, x[:, None], shifted)
    tl.debug_barrier()  # every lane has read the state before any lane overwrites it
    tl.store(conv_base + chan[:, None] * (W - 1) + ww[None, :], new_state, mask=m_state)
    return y.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _kda_decode_step_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, out_ptr, row_stride, b_stride,
    qw_ptr, kw_ptr, vw_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    conv_ptr, conv_page_stride, state_ptr, state_page_stride, pages_ptr,
    lower_bound, scale, norm_eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + row).to(tl.int64)
    OUT_DTYPE = out_ptr.dtype.element_ty
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    P = H * K
    conv_base = conv_ptr + page * conv_page_stride
    x_off = row.to(tl.int64) * row_stride

    q = _conv_silu(q_ptr + x_off, qw_ptr, conv_base, h * K + kk, mk, W, BW, OUT_DTYPE)
    k = _conv_silu(k_ptr + x_off, kw_ptr, conv_base + P * (W - 1), h * K + kk, mk, W, BW, OUT_DTYPE)
    v = _conv_silu(v_ptr + x_off, vw_ptr, conv_base + 2 * P * (W - 1), h * V + vv, mv, W, BW, OUT_DTYPE)
    q = (q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)).to(OUT_DTYPE).to(tl.float32)
    k = (k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)).to(OUT_DTYPE).to(tl.float32)

    f = tl.load(f_ptr + x_off + h * K + kk, mask=mk, other=0.0).to(tl.float32)
    f = f + tl.load(dt_bias_ptr + h * K + kk, mask=mk, other=0.0)
    a = tl.exp(tl.load(a_log_ptr + h))
    if HAS_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * f)
    else:  # -a * softplus(f), softplus as torch computes it (linear above 20)
        g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
    beta = tl.sigmoid(tl.load(b_ptr + row.to(tl.int64) * b_stride + h).to(tl.float32))

    s_off = page * state_page_stride + h * K * V + kk[:, None] * V + vv[None, :]
    m_s = mk[:, None] & mv[None, :]
    S = tl.load(state_ptr + s_off, mask=m_s, other=0.0)
    S = S * tl.exp(g)[:, None]
    residual = v - tl.sum(S * k[:, None], axis=0)
    S = S + (beta * k)[:, None] * residual[None, :]
    tl.store(state_ptr + s_off, S, mask=m_s)
    o = tl.sum(S * (q * scale)[:, None], axis=0).to(OUT_DTYPE).to(tl.float32)

    o = o * tl.rsqrt(tl.sum(tl.where(mv, o * o, 0.0), axis=0) / V + norm_eps)
    gate = tl.load(gate_ptr + x_off + h * V + vv, mask=mv, other=0.0).to(tl.float32)
    o = o * tl.load(norm_w_ptr + vv, mask=mv, other=0.0) * tl.sigmoid(gate)
    tl.store(out_ptr + row.to(tl.int64) * (H * V) + h * V + vv, o.to(OUT_DTYPE), mask=mv)


def kda_decode_step(q, k, v, f, b, gate, weights, conv, states, page_ids, fallback=None):
    """See `kimiserve.ops.kda.paged.kda_decode_step`: q, k, v, f, gate [Bd, H * K] (one token per
    sequence, model dtype), b [Bd, H]; conv the pool's conv view [P, 3, H * K, W - 1], states its
    recurrent view [P, H, K, V] fp32, page_ids [Bd] distinct. Updates those pages in place and returns
    the gated, normed output [Bd, H, V]. Shapes the kernel does not take (head dims over 128, pages
    not contiguous) run the reference composition around `fallback` (a `kda_decode`)."""
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
    xs = [t.contiguous() for t in (q, k, v, f, gate)]  # [Bd, H * K] each: one row stride
    row_stride = xs[0].stride(0)
    b = b.contiguous()
    lower = weights.lower_bound
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _kda_decode_step_kernel[(Bd, H)](
            *xs[:3], xs[3], b, xs[4], out, row_stride, b.stride(0),
            weights.q_conv, weights.k_conv, weights.v_conv, weights.A_log, weights.dt_bias, weights.norm_weight,
            conv, conv.stride(0), states, states.stride(0), page_ids.to(torch.int32),
            0.0 if lower is None else float(lower), K ** -0.5, float(weights.eps),
            H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
            BW=triton.next_power_of_2(W - 1), HAS_LOWER_BOUND=lower is not None, num_warps=8 if K * V > 4096 else 4,
        )
    return out


__all__ = ["MAX_HEAD_DIM", "kda_decode_step", "supported"]
