"""Verification of drafted tokens and the rollback of the KDA state.

The target scores a sequence's pending token and its K drafts d_1..d_K in one chunk of K + 1 tokens;
row i of the chunk is sampled by the ordinary sampler as if d_1..d_i had been generated (penalties,
bad words, min_tokens and allowed_token_ids see them; a seeded row draws from the generator of its
output position, `sampler.mix_seed(seed, len(output_ids))`). The round keeps x_0..x_a, where a is the
number of leading drafts equal to the target's own pick (x_i == d_{i+1}).

Exactness. Greedy rows pick the argmax: the kept tokens are the ones decoding without speculation
gives. A sampled row draws x_i ~ p_i, the target distribution after every processor (temperature,
top-k/top-p/min-p, penalties) given the tokens before it. Both proposers here draft deterministically
(n-gram lookup; the draft model greedily), so the draft distribution q_i is one-hot at d_{i+1}; the
rejection-sampling rule for that q (accept with probability min(1, p(d) / q(d)) = p(d), else draw from
the residual max(p - q, 0), renormalised, which is p without d) is what "draw x ~ p, accept iff x == d"
does: P(accept) = P(x = d) = p(d), and given a rejection x is distributed as p restricted to tokens
other than d, renormalised. So every kept token follows the target distribution, and a seeded request
gets the very tokens it gets without speculation (each position draws from its own generator).
`accept_drafts` is that rule; the statistical test in tests/test_spec_decode_sampling.py shows that
a wrong one (resampling from the whole p after a rejection) is caught.

Rollback. MLA: the latents and index keys written for rejected drafts sit past the sequence's
committed length; the scheduler releases the pages past it (`Scheduler.after_verify`) and later
tokens overwrite the slots of the last page; a prefix-cache snapshot covers committed tokens only.
KDA (recurrent state and the short-conv window), by default: the verify forward runs position t of every verify
chunk through `DecodeOps.kda_decode_step`, the very op of a plain decode step (the fused Triton kernel
on CUDA), on a copy of each chunk's conv and state pages, so its outputs have a decode step's
arithmetic; the pages stay at the committed state and the layer's inputs are kept (q, k, v before the
conv, the gate projection f, beta's logits b: (K + 1) x (4 H K + H) values per layer, not K + 1 states
of H K K each). After sampling, `replay_verified` runs the same op over the accepted tokens only, from
the committed state, in place on the pages: the state it leaves is bit for bit the one the verify
forward computed there, and the one decoding those tokens one step at a time leaves (for the same
inputs). A rejection therefore costs no recompute of the prefix and no per-position state pages in
the pool (a K3.1 state page is one attention page of >= 64 tokens per KDA layer: K + 1 slots for 69
layers per sequence would cost more than the sequences' attention pages), at the price of a second,
decode-sized pass over the accepted tokens. Under CUDA graphs (`verify_graphs.VerifyGraphs`) both the
verify forward and the replay are replayed graphs. With `DecodeOps.kda_verify_steps` set
(`ops.backend.kda_verify_slot_ops`) the verify forward runs each KDA layer's positions in one op with the
decode step's arithmetic (one Triton launch on CUDA), reading the committed pages and saving the states
after every position in `verify_slots.KDAVerifySlots`; the commit then copies each chunk's slot of its
last kept position into its pages (a gather and an index copy per state kind, for all layers at once).
"""

from __future__ import annotations

import torch


def accept_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the target's picks confirm: sampled[i] is the target's token at the row
    fed drafts[:i] (len(sampled) == len(drafts) + 1); the round keeps sampled[: result + 1]."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


@torch.inference_mode()
def replay_verified(model, batch, order: list[int], accepted: dict[int, int]) -> None:
    """Replay each committed verify chunk's first accepted[j] tokens (j: its index in the step; `order`
    lists the step indices of the batch's verify chunks, `batch.verify_grid` order) into its KDA state
    pages, every KDA layer."""
    picked = [(n, accepted[j]) for n, j in enumerate(order) if accepted.get(j, 0) > 0]
    if picked and batch.verify_slots is not None:  # the states after the last kept positions, saved in slots
        B = batch.verify_grid.shape[0]
        n, count = (torch.tensor(x, dtype=torch.int64) for x in zip(*picked))
        items, device = (count - 1) * B + n, batch.verify_grid.device
        batch.verify_slots.commit(batch.pool, items.to(device), batch.verify_state_pages[n.to(device)].t().contiguous())
        return
    if not picked or not batch.verify_inputs:
        return
    device = batch.verify_grid.device
    rows = [torch.tensor([n for n, count in picked if count > t], device=device)
            for t in range(max(count for _, count in picked))]
    for layer in kda_layers(model):
        i = layer.cache_index
        pages = batch.verify_state_pages[:, i]
        layer.replay_verified(batch.pool, batch.ops, batch.verify_inputs[i], [(r, pages[r]) for r in rows])


def kda_layers(model) -> list:
    from kimiserve.model.kda import KimiDeltaAttention

    return [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
