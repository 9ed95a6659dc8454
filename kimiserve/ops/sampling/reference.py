"""Sampling ops on fp32 logits [R, V], pure torch (the oracle every fast kernel must match).

Each row r has its own parameters, given as tensors of shape [R]. Tie rule: among equal values
the smaller token id counts as better (it wins top-k, comes first in top-n lists and ranks).

Extreme parameters saturate instead of producing inf or NaN: a repetition penalty or a
temperature beyond the float range is clamped into it, and `saturate` maps what overflowed
(+inf) to the largest finite value and NaN to -inf, so any row with one finite logit keeps a
finite, well-defined distribution.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def saturate(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf (never sampled), +inf -> the largest finite value (ties with every other +inf,
    so the argmax is still the first one); -inf and finite values are kept. Returns a new tensor."""
    return torch.nan_to_num(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max, neginf=NEG_INF)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM semantics); returns new logits.

    prompt_mask: bool [R, V], True for tokens in the prompt; output_counts: int [R, V], how often
    each token is in the output so far. Repetition (HF style) applies to tokens seen in the prompt
    or the output: positive logits are divided by it, negative ones multiplied. Then, for output
    tokens only, logits -= frequency * count + presence * (count > 0).

    The repetition penalty is clamped to the positive finite range of the logits' dtype (in fp32
    1e-300 would round to 0 and 1e308 to inf, giving inf or NaN): extreme penalties saturate the
    logits they touch at +-inf, never NaN (for logits without NaN).
    """
    in_output = output_counts > 0
    info = torch.finfo(logits.dtype)
    rep = repetition.view(-1, 1).to(logits.dtype).clamp(min=info.tiny, max=info.max)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | in_output, penalised, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency.view(-1, 1) * counts - presence.view(-1, 1) * in_output.to(logits.dtype)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / temperature per row; rows with temperature 0 (greedy) are left unscaled.

    A temperature beyond the dtype's range (1e308 is inf in fp32) is clamped to its largest value,
    so -inf logits stay -inf instead of becoming NaN. Subtract the row max first (as the Sampler
    does) so that small temperatures can only push logits down to -inf, never up to inf."""
    t = temperature.view(-1, 1).to(logits.dtype).clamp(max=torch.finfo(logits.dtype).max)
    return logits / torch.where(t > 0, t, torch.ones_like(t))


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask dropped tokens with -inf: top-k, then top-p, then min-p; returns new logits.

    Every row needs at least one finite logit.
    top_k: int [R], 0 = off; keeps exactly k tokens (a stable sort: the smaller id wins ties);
    k >= V keeps them all.
    top_p: [R] in (0, 1]; keeps the smallest best-first set whose mass, renormalised after
    top-k, reaches p (always at least the best token); p = 1 is off.
    min_p: [R] in [0, 1]; drops tokens whose probability is below min_p * the best probability
    (a ratio, so it does not matter which masks were applied before it).
    """
    R, V = logits.shape
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    position = torch.arange(V, device=logits.device).expand(R, V)
    k = top_k.view(-1, 1).to(position.dtype)
    drop_sorted = (k > 0) & (position >= k)
    sorted_logits = sorted_logits.masked_fill(drop_sorted, NEG_INF)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    p = top_p.view(-1, 1).to(probs.dtype)
    drop_sorted |= (mass_before >= p) & (p < 1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    logits = logits.masked_fill(drop, NEG_INF)
    probs = torch.softmax(logits, dim=-1)
    best = probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < min_p.view(-1, 1).to(probs.dtype) * best, NEG_INF)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of probs [R, V], row r using generators[r] (None: torch's default RNG).

    Exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with probability
    probs[i]. Each row's noise comes only from its own generator, so a row's draw does not depend
    on the other rows of the batch. Returns int64 ids [R].
    """
    R, V = probs.shape
    if len(generators) != R:
        raise ValueError(f"need one generator per row: {R} rows, {len(generators)} generators")
    noise = torch.empty_like(probs)
    if R and all(gen is generators[0] for gen in generators):  # one generator for every row: one draw
        noise.exponential_(generator=generators[0])
    else:
        for r, gen in enumerate(generators):
            noise[r].exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return torch.argmax(probs / noise, dim=-1)


def logprobs_with_top(logprobs: torch.Tensor, token_ids: torch.Tensor, n: int):
    """The chosen tokens' logprobs, their ranks and the n best alternatives per row.

    logprobs: [R, V]; token_ids: int [R]. Returns (token_logprob [R], rank int64 [R] (1-based;
    a tie counts as better when its id is smaller), top_ids int64 [R, n], top_logprobs [R, n])
    with the top lists best first (ties: smaller id first).
    """
    ids = token_ids.view(-1, 1).to(torch.int64)
    chosen = torch.gather(logprobs, -1, ids)
    vocab = torch.arange(logprobs.shape[-1], device=logprobs.device)
    better = (logprobs > chosen) | ((logprobs == chosen) & (vocab < ids))
    rank = better.sum(dim=-1) + 1
    if n > 0:
        top_lp, top_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        top_lp, top_ids = top_lp[:, :n], top_ids[:, :n]
    else:
        top_lp = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = torch.empty(logprobs.shape[0], 0, dtype=torch.int64, device=logprobs.device)
    return chosen.squeeze(-1), rank, top_ids, top_lp


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The oracle of `kimiserve.ops.sampling.bitmask.apply_token_bitmask`, one token at a time:
    token t of row r keeps its logit when bit t % 32 of word bitmask[r, t // 32] is set, else -inf.
    bitmask: int32 [R, ceil(V / 32)] (llguidance's / xgrammar's layout); tokens past 32 x W are
    dropped. Returns new logits."""
    out = logits.clone()
    words = bitmask.to(torch.int64).tolist()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words[r]) or not (words[r][w] >> (t % 32)) & 1:
                out[r, t] = NEG_INF
    return out
