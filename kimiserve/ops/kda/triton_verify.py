"""A KDA layer's speculative verify positions in one Triton launch (`paged.kda_verify_steps`' contract):
T positions of B chunks, each chunk's state pages read once and never written, the state after every
position saved to its slot, so that committing the accepted tokens is a copy of one slot per chunk.

The launch is `triton_decode.launch_steps`, the decode step's own single kernel: one program per (chunk, head)
loops over the chunk's positions t < lengths[j], position t starting from the fp32 state it saved to slot t - 1
(the page's for t = 0; the pool's state dtype is fp32: a store and load keep the bits). The short conv's window before
position t is the last W - 1 entries of [the conv page, x_0 .. x_{t-1}], loaded from the page and from the
earlier positions' input rows, each input rounded to the conv page's dtype as the decode step's store to the
page rounds it; the window after position t goes to conv slot t. The decode step is the one-position case of
the same compiled kernel (its per-call arguments are left unspecialised), so every position's output and
slots are bit for bit what the decode step gives (and leaves in the pages) when the chunk's tokens are
decoded one step at a time, on the GPU as under the interpreter.

The single decode kernel only: where the decode step would take its V-split form (an explicit block_v or
one-launch counters; `default_block_v` no longer picks it), and for shapes the decode kernel does not take,
the positions run as `paged.kda_verify_steps`' loop of that very decode step.
"""

from __future__ import annotations

from kimiserve.ops.kda import paged
from kimiserve.ops.kda.triton_decode import default_block_v, kda_decode_step, launch_steps, supported


def kda_verify_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, grid, lengths, active, out, conv_slots,
                     state_slots, fallback=None, block_v="auto", counters=None):
    """See `paged.kda_verify_steps`; fallback, block_v and counters as `triton_decode.kda_decode_step`
    takes them (the decode step whose form and bits the positions have)."""
    H, K, V = states.shape[1:]
    W = weights.q_conv.shape[-1]
    B, T = grid.shape
    contiguous = (states[0].stride() == (K * V, V, 1) and conv[0].stride() == (conv.shape[2] * (W - 1), W - 1, 1)
                  and conv_slots.is_contiguous() and state_slots.is_contiguous() and out[0].is_contiguous()
                  and out.stride(0) == H * V)
    if block_v == "auto":
        block_v = default_block_v(B, H, K, V)
    if block_v is not None or counters is not None or not supported(K, V, W) or not contiguous or V != K:
        step = lambda *a: kda_decode_step(*a, fallback=fallback, block_v=block_v, counters=counters)  # noqa: E731
        return paged.kda_verify_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, grid, lengths, active,
                                      out, conv_slots, state_slots, decode_step=step)
    return launch_steps(q, k, v, f, b, gate, weights, conv, states, page_ids, out, grid=grid, lengths=lengths,
                        slots=(conv_slots, state_slots))


__all__ = ["kda_verify_steps"]
