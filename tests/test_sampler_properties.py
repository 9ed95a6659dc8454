"""Property test: no SamplingParams value the validation accepts makes the Sampler raise.

SamplingParams are drawn from their whole accepted ranges (ints up to 2**64 and beyond, floats
down to subnormals and up to 1.8e308), logits from fp32 values with -inf, +inf, NaN and +-3.4e38
mixed in, with allowed_token_ids, bad-word sequences and min_tokens masks. Every row must get a
token in [0, V); a greedy row gets the argmax of the masked and penalised logits (computed here
row by row, in fp32, by an independent loop), or the documented fallback when no logit is left;
a sampled row gets a token with a finite masked and penalised logit, and the argmax when the
best logit leads by more than 200 temperatures (the others then have probability 0); seeded and greedy rows get
the same token alone as in the batch. Bounded: 100 examples, a few seconds on a CPU (the
examples are fixed when CI is set, random otherwise).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimiserve.engine.bad_words import banned_tokens
from kimiserve.engine.sampler import SampleRequest, Sampler
from kimiserve.sampling_params import SAMPLING_EPS, SamplingParams

F64_MAX = 1.7976931348623157e308
F32 = torch.finfo(torch.float32)
INF = math.inf

PROPERTY = settings(max_examples=100, deadline=timedelta(seconds=2), database=None,
                    derandomize=bool(os.environ.get("CI")),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

huge_ints = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30])


def floats_in(lo: float, hi: float, **kw):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, **kw)


logit_values = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),  # anything fp32, +-3.4e38 included
    floats_in(-8, 8, width=32),
    st.sampled_from([-INF, -INF, 0.0, F32.max, -F32.max, INF, math.nan]),
)


@st.composite
def sample_requests(draw, V: int):
    temperature = draw(st.one_of(st.just(0.0), floats_in(0, SAMPLING_EPS), floats_in(0, 2), floats_in(0, F64_MAX),
                                 st.sampled_from([5e-324, 1e-300, 1e-5, 1e38, 1e308])))
    top_k = draw(st.one_of(st.sampled_from([-1, 0, 1, 2, V - 1, V, V + 1]), st.integers(1, 2**64 + 1), huge_ints))
    repetition = draw(st.one_of(st.just(1.0), floats_in(0, F64_MAX, exclude_min=True), floats_in(0.1, 4),
                                st.sampled_from([5e-324, 1e-300, 1e-38, 1e38, 1e308])))
    min_tokens = draw(st.integers(0, 4))
    params = SamplingParams(
        temperature=temperature,
        top_p=draw(st.one_of(st.just(1.0), floats_in(0, 1, exclude_min=True), st.just(5e-324))),
        top_k=top_k,
        min_p=draw(st.one_of(st.just(0.0), floats_in(0, 1), st.just(1.0))),
        presence_penalty=draw(st.one_of(st.just(0.0), floats_in(-2, 2))),
        frequency_penalty=draw(st.one_of(st.just(0.0), floats_in(-2, 2))),
        repetition_penalty=repetition,
        seed=draw(st.one_of(st.none(), st.integers(-2**70, 2**70), huge_ints)),
        stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=3)),
        max_tokens=draw(st.one_of(st.integers(max(min_tokens, 1), 64), huge_ints)),
        min_tokens=min_tokens,
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        allowed_token_ids=draw(st.one_of(st.none(), st.lists(st.integers(0, V - 1), min_size=1, max_size=V + 2))),
    )
    params.validate_vocab(V)
    # bad words as token sequences (what update_from_tokenizer makes), some ids beyond the vocabulary
    seqs = draw(st.lists(st.lists(st.integers(0, V + 2), min_size=1, max_size=3), max_size=4))
    params._bad_words_token_ids = seqs or None
    output = draw(st.lists(st.integers(0, V - 1), max_size=8))
    if seqs and draw(st.booleans()):  # end the output with a bad word's prefix, so that its last token is banned
        output += [t for t in draw(st.sampled_from(seqs))[:-1] if t < V]
    prompt = draw(st.lists(st.integers(0, V - 1), max_size=8))
    eos = draw(st.one_of(st.none(), st.integers(0, V - 1)))
    return SampleRequest(params, prompt, output, params.seed, eos)


@st.composite
def batches(draw):
    V = draw(st.integers(1, 40))
    R = draw(st.integers(1, 6))
    requests = [draw(sample_requests(V)) for _ in range(R)]
    rows = [draw(st.lists(logit_values, min_size=V, max_size=V)) for _ in range(R)]
    return torch.tensor(rows, dtype=torch.float32), requests


# ---- the oracle: one row at a time, Python loops over the vocabulary -------------------------
def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def saturate(v: float) -> float:
    return -INF if math.isnan(v) else (F32.max if v == INF else v)


def first_argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def hard_masks(r: SampleRequest, V: int) -> tuple[list[bool], list[bool]]:
    """(allowed, allowed and not banned) per token."""
    p = r.params
    allowed = [p.allowed_token_ids is None or t in p.allowed_token_ids for t in range(V)]
    banned = set()
    for seq in p._bad_words_token_ids or ():
        k = len(seq) - 1
        if k <= len(r.output_ids) and (k == 0 or r.output_ids[-k:] == seq[:-1]):
            banned.add(seq[-1])
    if len(r.output_ids) < p.min_tokens:
        banned |= set(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            banned.add(r.eos_token_id)
    return allowed, [a and t not in banned for t, a in enumerate(allowed)]


def processed_row(raw: list[float], r: SampleRequest, penalised: bool) -> list[float]:
    """Saturated raw logits -> hard masks -> penalties (fp32 arithmetic, saturating)."""
    V, p = len(raw), r.params
    _, ok = hard_masks(r, V)
    x = [saturate(v) if ok[t] else -INF for t, v in enumerate(raw)]
    if not penalised:
        return x
    rep = min(max(f32(p.repetition_penalty), F32.tiny), F32.max)
    freq, pres = f32(p.frequency_penalty), f32(p.presence_penalty)
    out = []
    for t, v in enumerate(x):
        count = r.output_ids.count(t)
        if count or t in r.prompt_ids:
            v = f32(v / rep) if v > 0 else f32(v * rep)
        v = f32(f32(v - f32(freq * count)) - f32(pres * (count > 0)))
        out.append(saturate(v))
    return out


def fallback(raw: list[float], r: SampleRequest) -> int:
    allowed, strict = hard_masks(r, len(raw))
    for ok in (strict, allowed, [True] * len(raw)):
        ids = [t for t in range(len(raw)) if ok[t]]
        if ids:
            scores = [saturate(raw[t]) for t in ids]
            return ids[first_argmax(scores)]
    raise AssertionError("unreachable")


@PROPERTY
@given(batches(), st.integers(0, 2**64 - 1))
def test_sampler_never_raises_and_honours_greedy_and_masks(batch, sampler_seed):
    logits, requests = batch
    R, V = logits.shape
    out = Sampler(seed=sampler_seed)(logits, requests)
    assert len(out) == R
    penalised = any(r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1
                    for r in requests)
    for row, (r, (token, lp)) in enumerate(zip(requests, out)):
        assert isinstance(token, int) and 0 <= token < V
        assert (lp is None) == (r.params.logprobs is None)
        if lp is not None:
            assert lp.token_id == token and len(lp.top) == min(r.params.logprobs, V)
        raw = logits[row].tolist()
        x = processed_row(raw, r, penalised)
        if max(x) == -INF:
            assert token == fallback(raw, r), (row, x)
        elif r.params.greedy:
            assert token == first_argmax(x), (row, x)
        else:
            assert x[token] > -INF, (row, x)
            # a best logit ahead of all others by 200 temperatures leaves them probability 0 in fp32
            # (exp(-200) underflows), whatever top-k/top-p/min-p keep: the draw is the argmax
            best = first_argmax(x)
            gap = min((x[best] - v for t, v in enumerate(x) if t != best), default=INF)
            if gap > 200 * min(r.params.temperature, F32.max):
                assert token == best, (row, x)
        if r.params.greedy or r.seed is not None:  # the batch does not change this row's token
            assert Sampler(seed=sampler_seed + 1)(logits[row:row + 1], [r])[0][0] == token


@settings(max_examples=100, deadline=timedelta(seconds=1), database=None, derandomize=bool(os.environ.get("CI")))
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), max_size=5),
       st.lists(st.integers(0, 5), max_size=8), st.integers(1, 7))
def test_banned_tokens_matches_brute_force(seqs, output, V):
    # banned: the tokens that, appended, make the output end with a whole sequence
    want = [s[-1] for s in seqs if s[-1] < V and len(s) <= len(output) + 1 and (output + s[-1:])[-len(s):] == s]
    assert banned_tokens(seqs, output, V) == want
