"""Sampled requests under speculation follow the target distribution: a chi-square test of the first
three output tokens over many seeds, on a three-token vocabulary slice (allowed_token_ids), against the
exact probabilities from full forwards; the same test rejects a wrong acceptance rule."""

from __future__ import annotations

import itertools
import math

import torch

from engine_utils import make_engine
from kimiserve.engine.engine import LLMEngine
from kimiserve.engine.spec_decode.verify import accept_drafts
from kimiserve.sampling_params import SamplingParams

SLICE = [3, 7, 11]
PROMPT = [3, 7, 11, 7, 3, 11, 3, 7, 11, 7, 3, 11, 3, 7]  # every token recurs: n-gram always drafts
N = 800


def chi2_limit(dof: int) -> float:
    """The chi-square critical value at p = 1e-4 (z = 3.719), Wilson-Hilferty's approximation (within 1%
    of scipy's chi2.isf(1e-4, dof) for dof >= 5): the right rule fails once in 10^4 runs."""
    return dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3


def exact_joint(engine) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of the target at temperature 1 over SLICE, from full forwards of prompt + t1 + t2."""
    joint = {}
    for t1, t2 in itertools.product(SLICE, SLICE):
        logits = engine.model(torch.tensor(PROMPT + [t1, t2]), kv_cache_dtype=engine.layout.kv_cache_dtype)
        p = torch.softmax(logits[len(PROMPT) - 1 :, SLICE].double(), -1)
        for t3 in SLICE:
            joint[(t1, t2, t3)] = float(p[0, SLICE.index(t1)] * p[1, SLICE.index(t2)] * p[2, SLICE.index(t3)])
    return joint


def sample_counts(engine) -> dict[tuple[int, int, int], int]:
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, allowed_token_ids=SLICE, ignore_eos=True)
              for s in range(N)]
    for s, p in enumerate(params):
        engine.add_request(f"s{s}", PROMPT, p)
    counts = dict.fromkeys(itertools.product(SLICE, SLICE, SLICE), 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[tuple(out.outputs[0].token_ids)] += 1
    engine.check_idle()
    return counts


def chi_square(counts, joint) -> tuple[float, int]:
    """(statistic, degrees of freedom); cells expecting fewer than 5 samples pooled into one."""
    big = [c for c in counts if N * joint[c] >= 5]
    small = [c for c in counts if N * joint[c] < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    expected = [N * joint[c] for c in big] + [N * sum(joint[c] for c in small)]
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0), len(big) - (not small)


def test_sampled_tokens_follow_target_distribution(monkeypatch):
    engine = make_engine(max_num_seqs=256, num_pages=400,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    joint = exact_joint(engine)
    counts = sample_counts(engine)
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    good, dof = chi_square(counts, joint)
    assert dof >= 12
    assert good < chi2_limit(dof), (good, dof, counts)

    # a wrong rule, the classic one: after a rejection, emit a fresh draw from the whole target p (which
    # may be the rejected draft again) instead of the residual p without the draft. Its chi-square here,
    # seen: 179 at N = 800 against a limit of 54 (the right rule: 24)
    def wrong_append(self, chunk, result):
        drafts = chunk.draft_token_ids
        sampled = [t for t, _ in result.samples]
        a = accept_drafts(drafts, sampled)
        self.spec_stats.record(len(drafts), a)
        kept = sampled[:a + 1]
        if a < len(drafts):
            r = chunk.request
            row = self.recorded[(tuple(r.prompt_ids), r.seed, len(r.output_ids) + a)]
            gen = torch.Generator().manual_seed(r.seed * 7919 + len(r.output_ids) + a)
            kept[a] = SLICE[int(torch.multinomial(torch.softmax(row[SLICE], -1), 1, generator=gen))]
        for token in kept:
            self._append_token(r := chunk.request, token, None)
            if r.finished:
                return kept.index(token) + 1
        return len(kept)

    monkeypatch.setattr(LLMEngine, "_append_verified", wrong_append)
    engine = make_engine(max_num_seqs=256, num_pages=400,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    bad, _ = chi_square(sample_counts(engine), joint)
    print(f"chi-square over {N} seeds, {dof} dof: right rule {good:.1f}, wrong rule {bad:.1f}, limit {chi2_limit(dof):.1f}")
    assert bad > chi2_limit(dof)
