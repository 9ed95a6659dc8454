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
KDA (recurrent state and the short-conv window): the verify forward computes its outputs from a copy
of each state page and leaves the page at the committed state, keeping the layer's inputs (q, k, v
before the conv, g, beta: (K + 1) x (4 H K + H) values per layer, not K + 1 states of H K K each);
after sampling, `replay_verified` runs the conv and the recurrent form over the accepted tokens only,
from the committed state, with the same ops a decode step runs. A rejection therefore costs no
recompute of the prefix and no per-position state pages in the pool (a K3.1 state page is one
attention page of >= 64 tokens per KDA layer: K + 1 slots for 69 layers per sequence would cost more
than the sequences' attention pages), at the price of a second, decode-sized recurrent pass over the
accepted tokens.
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
    lists the step indices of `batch.verify_chunks`) into its KDA state pages, every KDA layer."""
    from kimiserve.model.kda import KimiDeltaAttention

    picked = [(n, j) for n, j in enumerate(order) if accepted.get(j, 0) > 0]
    if not picked or not batch.verify_inputs:
        return
    chunks = batch.verify_chunks
    lengths = [accepted[j] for _, j in picked]
    rows = torch.tensor([n for n, _ in picked], device=batch.verify_rows.device)
    for layer in model.modules():
        if not isinstance(layer, KimiDeltaAttention):
            continue
        i = layer.cache_index
        pages = torch.stack([chunks[n].state_pages[i] for n, _ in picked])
        inputs = tuple(t[rows] for t in batch.verify_inputs[i])
        layer.replay_verified(batch.pool, batch.ops, pages, inputs, lengths)
