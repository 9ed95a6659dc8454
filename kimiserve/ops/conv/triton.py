"""KDA's short conv over a prefill chunk as Triton kernels: `short_conv`, the contract of
`kimiserve.ops.kda.paged.short_conv` (causal depthwise conv of q, k, v from the conv state, SiLU, the
per-head L2 norm of q and k).

The reference builds [C, W - 1 + T] fp32 copies of each input (state and transposed tokens
concatenated), runs torch's depthwise conv, SiLU, transposes back, casts, and L2-normalises q and k
in four more passes. Here one program takes BLOCK_T tokens x one head's channels: it reads the W
shifted token rows it needs (the W - 1 before the chunk from the conv state), sums the taps in fp32,
applies SiLU, rounds to the input dtype (where the reference casts), and for q and k divides by the
head's L2 norm in fp32 before the final rounding; one launch per input. The new conv state (the last
W - 1 inputs) is a few [C, W - 1] copies in torch. Only the fp32 summation order differs from the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.kda import paged as reference

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
L2_EPS = 1e-6  # kimiserve.ops.norm.reference.l2_normalize's default, as the reference calls it


@triton.jit
def _short_conv_kernel(x_ptr, state_ptr, w_ptr, out_ptr, T, s_xt, s_sc, s_sj, s_wc, s_wj, s_ot, eps,
                       W: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                       NORM: tl.constexpr, DTYPE: tl.constexpr):
    """Tokens [pid_t * BLOCK_T, +BLOCK_T) x channels of head program_id(1) (HD of them)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    c = tl.program_id(1) * HD + d
    d_ok = d < HD
    t_ok = t < T
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j  # the input token tap j reads; < 0: the conv state's slot W - 1 + src
        in_x = (src >= 0) & t_ok
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * s_xt + c[None, :], mask=in_x[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)
        in_s = (src < 0) & t_ok
        sv = tl.load(state_ptr + c[None, :] * s_sc + (W - 1 + src)[:, None] * s_sj,
                     mask=in_s[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + c * s_wc + j * s_wj, mask=d_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    y = (acc / (1.0 + tl.exp(-acc))).to(DTYPE).to(tl.float32)  # SiLU, rounded to x's dtype as the reference does
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, axis=1) + eps)[:, None]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * s_ot + c[None, :], y.to(DTYPE), mask=t_ok[:, None] & d_ok[None, :])


def _conv_one(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, heads: int, norm: bool) -> torch.Tensor:
    """x [T, C] (unit channel stride), state [C, W - 1], weight [C, W] -> [T, C] in x's dtype."""
    T, C = x.shape
    W = weight.shape[-1]
    hd = C // heads
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    block_t = 32
    _short_conv_kernel[(triton.cdiv(T, block_t), heads)](
        x, state, weight, out, T, x.stride(0), state.stride(0), state.stride(1), weight.stride(0), weight.stride(1),
        C, L2_EPS, W=W, HD=hd, BLOCK_D=triton.next_power_of_2(hd), BLOCK_T=block_t, NORM=norm,
        DTYPE=TL_DTYPES[x.dtype], num_warps=4)
    return out


def short_conv(q, k, v, weights: reference.KDADecodeWeights, num_heads: int, conv_state=None):
    """`reference.short_conv`: q, k, v [B, T, H * K] (H * V for v) from conv_state [B, 3, H * K, W - 1]
    (zeros when None) -> (q, k [B, T, H, K] L2-normalised, v [B, T, H, V], new conv state [B, 3, ., W - 1]
    in the state's dtype)."""
    B, T, C = q.shape
    if (q.dtype not in TL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype or T == 0
            or C % num_heads or v.shape[-1] % num_heads):
        return reference.short_conv(q, k, v, weights, num_heads, conv_state)
    W = weights.q_conv.shape[-1]
    if conv_state is None:
        conv_state = q.new_zeros(B, 3, C, W - 1)
    outs, states = [], []
    for i, (x, w, norm) in enumerate(((q, weights.q_conv, True), (k, weights.k_conv, True), (v, weights.v_conv, False))):
        per_b = []
        for b in range(B):
            xb = x[b] if x[b].stride(-1) == 1 else x[b].contiguous()
            per_b.append(_conv_one(xb, conv_state[b, i], w, num_heads, norm))
        outs.append(torch.stack(per_b) if B > 1 else per_b[0].unsqueeze(0))
        # the last W - 1 inputs: the state's tail, then the tokens
        seq = torch.cat([conv_state[:, i], x[:, max(0, T - (W - 1)):].transpose(1, 2).to(conv_state.dtype)], dim=-1)
        states.append(seq[..., seq.shape[-1] - (W - 1):])
    heads = lambda t: t.view(B, T, num_heads, -1)  # noqa: E731
    return heads(outs[0]), heads(outs[1]), heads(outs[2]), torch.stack(states, dim=1)


__all__ = ["short_conv"]
