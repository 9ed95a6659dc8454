"""Sampling layer: SamplingParams validation, reference sampling ops, Sampler, detokenizer."""

import codecs
import math
import random

import pytest
import torch

from kimiserve.engine.bad_words import bad_words_token_ids, banned_tokens
from kimiserve.engine.detokenizer import IncrementalDetokenizer
from kimiserve.engine.sampler import (
    SampleRequest, Sampler, greedy_tokens, mix_seed, prompt_logprobs, prompt_logprobs_chunk,
)
from kimiserve.ops.sampling import reference as ops
from kimiserve.sampling_params import (
    MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams,
)
from kimiserve.tokenizer import load_tokenizer

R, V = 5, 37


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def req(params=None, prompt=(), output=(), seed=None, eos=None, **kw):
    return SampleRequest(params or SamplingParams(**kw), list(prompt), list(output), seed, eos)


# ---- SamplingParams -------------------------------------------------------------------------
BAD_PARAMS = [
    (dict(n=0), "n must be >= 1"), (dict(n=1.0), "n must be an int"), (dict(n=True), "n must be an int"),
    (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    (dict(temperature="1"), "temperature must be a number"), (dict(temperature=True), "temperature must be a number"),
    (dict(temperature=float("nan")), "temperature must be a finite"),
    (dict(top_p=0), "top_p must be in (0, 1], got 0"), (dict(top_p=1.01), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be"), (dict(top_k=2.0), "top_k must be an int"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"), (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
    (dict(seed=1.5), "seed must be an int"), (dict(seed=False), "seed must be an int"),
    (dict(stop=3), "stop must be a string or a list of strings, got int"),
    (dict(stop=["a", 3]), "stop must be a string or a list of strings, got int"),
    (dict(stop=""), "stop must not contain empty strings"), (dict(stop=["a", ""]), "stop must not contain empty"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of ints, got int"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids must be a list of ints, got str"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be a list of ints, got bool"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0"),
    (dict(max_tokens=0), "max_tokens must be >= 1"), (dict(max_tokens=None), "max_tokens must be an int"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"), (dict(min_tokens=17), "min_tokens must be <= max_tokens"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"), (dict(logprobs=21), "logprobs must be in [0, 20]"),
    (dict(logprobs=-1), "logprobs must be in [0, 20]"), (dict(prompt_logprobs=True), "prompt_logprobs must be an int"),
    (dict(prompt_logprobs=100), "prompt_logprobs must be in [0, 20]"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be a bool"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be a bool"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=3), "allowed_token_ids must be a list of ints, got int"),
    (dict(allowed_token_ids=[1, 2.0]), "allowed_token_ids must be a list of ints, got float"),
    (dict(allowed_token_ids=[False]), "allowed_token_ids must be a list of ints, got bool"),
    (dict(allowed_token_ids=[0, -1]), "allowed_token_ids must be >= 0, got -1"),
    (dict(bad_words="word"), "bad_words must be a list of strings, got str"),
    (dict(bad_words=["a", None]), "bad_words must be a list of strings, got NoneType"),
    (dict(bad_words=["a", ""]), "bad_words must not contain empty strings"),
    (dict(bad_words=["w"] * (MAX_BAD_WORDS + 1)), f"bad_words must hold at most {MAX_BAD_WORDS} strings"),
    (dict(bad_words=["x" * (MAX_BAD_WORD_CHARS + 1)]), f"bad_words must hold strings of at most {MAX_BAD_WORD_CHARS}"),
    (dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), f"stop must hold at most {MAX_STOP_STRINGS} strings"),
    (dict(stop="x" * (MAX_STOP_STRING_CHARS + 1)), f"stop must hold strings of at most {MAX_STOP_STRING_CHARS}"),
]


@pytest.mark.parametrize("kwargs,message", BAD_PARAMS,
                         ids=[f"{next(iter(k))}-{i}" for i, (k, _) in enumerate(BAD_PARAMS)])
def test_params_rejected(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert next(iter(kwargs)) in str(info.value)


def test_params_normalised():
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == [] and p.top_k == 0 and not p.greedy
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1, temperature=1, logprobs=0, prompt_logprobs=20)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and p.top_k == 0 and isinstance(p.temperature, float)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    SamplingParams(presence_penalty=-2, frequency_penalty=2, min_p=1, top_p=1, min_tokens=16, seed=-3)
    p = SamplingParams(stop_token_ids=[5, 10])
    p.validate_vocab(11)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 10\), got 10"):
        p.validate_vocab(10)
    # the limits themselves are accepted; allowed_token_ids drop duplicates and are checked against the vocabulary
    SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                   bad_words=["b" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS)
    p = SamplingParams(allowed_token_ids=(4, 2, 4), bad_words=("x",))
    assert p.allowed_token_ids == [4, 2] and p.bad_words == ["x"] and SamplingParams().bad_words == []
    assert SamplingParams().allowed_token_ids is None
    p.validate_vocab(5)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 4\), got 4 at allowed_token_ids\[0\]"):
        p.validate_vocab(4)
    # vLLM's _SAMPLING_EPS: a temperature below 1e-5 is greedy
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9.99e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


# ---- reference ops vs brute force -----------------------------------------------------------
def brute_filter(row, k, p, mp):
    """Per-row Python reference of top-k -> top-p -> min-p; returns the kept token set."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    kept = order[:k] if k > 0 else order
    z = [math.exp(row[i] - row[kept[0]]) for i in kept]
    probs = [v / sum(z) for v in z]
    if p < 1:
        mass, cut = 0.0, []
        for i, pr in zip(kept, probs):
            if cut and mass >= p:
                break
            cut.append(i)
            mass += pr
        kept = cut
    best = math.exp(0.0)
    return {i for i in kept if math.exp(row[i] - row[kept[0]]) >= mp * best}


def test_top_k_top_p_min_p_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        logits = torch.randn(R, V, generator=g) * 2
        logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
        logits[1, :] = logits[1].round()  # many ties (top-k threshold ties)
        top_k = torch.randint(0, 8, (R,), generator=g)
        top_p = torch.rand(R, generator=g).clamp_min(0.05)
        top_p[trial % R] = 1.0
        min_p = torch.rand(R, generator=g) * 0.3
        out = ops.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        for r in range(R):
            want = brute_filter(logits[r].double().tolist(), int(top_k[r]), float(top_p[r]), float(min_p[r]))
            got = set(torch.nonzero(out[r] > float("-inf")).flatten().tolist())
            assert got == want, (trial, r)
            assert torch.equal(out[r][list(got)], logits[r][list(got)])


def test_top_k_ties_keep_smaller_ids():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    out = ops.apply_top_k_top_p_min_p(logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert (out[0] > float("-inf")).tolist() == [False, True, True, False, False]
    # exact boundaries: top-p stops as soon as the mass reaches p; min-p keeps prob == min_p * max
    flat = torch.zeros(2, 4)
    out = ops.apply_top_k_top_p_min_p(flat, torch.tensor([0, 0]), torch.tensor([0.5, 1.0]), torch.tensor([0.0, 1.0]))
    assert (out > float("-inf")).tolist() == [[True, True, False, False], [True] * 4]


def test_penalties_match_loop():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(R, V, generator=g)
    prompt_mask = torch.rand(R, V, generator=g) < 0.2
    counts = torch.randint(0, 3, (R, V), generator=g) * (torch.rand(R, V, generator=g) < 0.3)
    pres, freq = torch.rand(R, generator=g) * 4 - 2, torch.rand(R, generator=g) * 4 - 2
    rep = torch.rand(R, generator=g) * 2 + 0.1
    out = ops.apply_penalties(logits, prompt_mask, counts, pres, freq, rep)
    for r in range(R):
        for v in range(V):
            x = float(logits[r, v])
            if prompt_mask[r, v] or counts[r, v] > 0:
                x = x / float(rep[r]) if x > 0 else x * float(rep[r])
            x -= float(freq[r]) * int(counts[r, v]) + float(pres[r]) * (int(counts[r, v]) > 0)
            assert abs(out[r, v].item() - x) < 1e-5


def test_temperature_and_sample_distribution():
    logits = torch.randn(3, V)
    out = ops.apply_temperature(logits, torch.tensor([0.5, 0.0, 2.0]))
    assert torch.allclose(out, logits * torch.tensor([[2.0], [1.0], [0.5]]))
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 20000
    gen = torch.Generator().manual_seed(3)
    ids = ops.sample(probs.expand(n, 5).contiguous(), [gen] * n)
    freq = torch.bincount(ids, minlength=5).double() / n
    assert freq[4] == 0
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-12).all(), freq


def test_logprobs_with_top():
    lp = torch.log_softmax(torch.randn(R, V), -1)
    lp[2, 10] = lp[2, 4] = lp[2].max() + 0.5  # a tie: id 4 ranks before id 10
    ids = torch.tensor([0, 5, 10, 36, 4])
    tok_lp, rank, top_ids, top_lp = ops.logprobs_with_top(lp, ids, 6)
    for r in range(R):
        row = lp[r].tolist()
        order = sorted(range(V), key=lambda i: (-row[i], i))
        assert tok_lp[r].item() == row[ids[r]]
        assert rank[r].item() == order.index(int(ids[r])) + 1
        assert top_ids[r].tolist() == order[:6]
        assert top_lp[r].tolist() == [row[i] for i in order[:6]]
    assert rank[2].item() == 2
    assert ops.logprobs_with_top(lp, torch.tensor([0, 0, 4, 0, 0]), 1)[1][2].item() == 1
    assert ops.logprobs_with_top(lp, ids, 0)[2].shape == (R, 0)


# ---- Sampler --------------------------------------------------------------------------------
def test_greedy_is_argmax_and_top_k_1_equals_greedy():
    logits = torch.randn(R, V)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # tie -> lowest id
    sampler = Sampler(seed=0)
    greedy = sampler(logits, [req(temperature=0) for _ in range(R)])
    assert [t for t, _ in greedy] == [5] + logits[1:].argmax(-1).tolist()
    top1 = sampler(logits, [req(top_k=1, temperature=1.7, seed=i) for i in range(R)])
    assert top1 == greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_fast_path_matches_the_draw(dtype):
    """A plain all-greedy batch takes `greedy_tokens` (two device ops); the tokens are the general
    path's (saturate the float32 logits, `_draw`, a row without a finite logit -> 0) on poisoned rows."""
    gen = torch.Generator().manual_seed(7)
    raw = torch.randn(13, V, generator=gen, dtype=torch.float64) * 4
    raw[0] = -INF
    raw[1] = float("nan")
    raw[2, 3], raw[2, 30] = INF, INF  # the first +inf
    raw[3, ::2] = float("nan")
    raw[4, 5] = raw[4, 9] = raw[4].max() + 1  # a tie: the smaller id
    raw[5, 1], raw[5, 2] = torch.finfo(dtype).max if dtype != torch.float64 else 1e300, INF  # +inf beats the max
    raw[6, 8] = -INF
    raw[7] = -INF
    raw[7, 20] = float("nan")
    logits = raw.to(dtype)
    reqs = [req(temperature=0) if i % 2 else req(top_k=1, temperature=0.8) for i in range(13)]
    sampler = Sampler(seed=0)
    x = ops.saturate(logits.float())
    drawn, valid = sampler._draw(x, reqs)
    expected = torch.where(valid, drawn, 0)
    assert torch.equal(greedy_tokens(logits), expected)
    assert torch.equal(sampler.sample_plain(logits, reqs), expected)
    assert [t for t, _ in sampler(logits.float(), reqs)] == expected.tolist()


def test_greedy_sees_penalties():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    assert Sampler()(logits, [req(temperature=0, output=[3])])[0][0] == 3
    assert Sampler()(logits, [req(temperature=0, output=[3], presence_penalty=1.0)])[0][0] == 4
    assert Sampler()(logits, [req(temperature=0, prompt=[3], repetition_penalty=2.0)])[0][0] == 4
    assert Sampler()(logits, [req(temperature=0, output=[3], frequency_penalty=0.3)])[0][0] == 3
    assert Sampler()(logits, [req(temperature=0, output=[3, 3], frequency_penalty=0.3)])[0][0] == 4


def test_sampler_penalties_batched_match_loop():
    rng = random.Random(3)
    logits = torch.randn(R, V)
    reqs = [req(prompt=[rng.randrange(V) for _ in range(rng.randrange(6))],
                output=[rng.randrange(V) for _ in range(rng.randrange(12))],
                presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                repetition_penalty=rng.uniform(0.5, 2)) for _ in range(R)]
    out = Sampler._penalise(logits, reqs)
    for r, q in enumerate(reqs):
        p = q.params
        for v in range(V):
            x, count = logits[r, v].item(), q.output_ids.count(v)
            if v in q.prompt_ids or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert out[r, v].item() == pytest.approx(x, abs=1e-5)


def test_seed_reproducible_across_batches():
    g = torch.Generator().manual_seed(4)
    row = torch.randn(V, generator=g)
    params = SamplingParams(temperature=1.3, top_p=0.9, top_k=20)
    target = req(params, prompt=[1, 2], output=[7, 8, 9], seed=1234)
    alone = [Sampler(seed=s)(row[None], [target])[0][0] for s in range(3)]
    assert len(set(alone)) == 1  # the shared generator does not matter
    for trial in range(8):
        others = [req(temperature=1.0, output=[1] * trial, seed=None if trial % 2 else trial) for _ in range(3)]
        batch = others[:trial % 4] + [target] + others[trial % 4:]
        logits = torch.randn(len(batch), V, generator=g)
        logits[batch.index(target)] = row
        out = Sampler(seed=trial)(logits, batch)
        assert out[batch.index(target)][0] == alone[0]
    draws = {Sampler()(row[None].repeat(1, 1), [req(temperature=5.0, seed=s)])[0][0] for s in range(40)}
    assert len(draws) > 5  # different seeds differ
    steps = {Sampler()(row[None], [req(temperature=5.0, seed=7, output=[0] * k)])[0][0] for k in range(40)}
    assert len(steps) > 5  # the step enters the seed
    assert mix_seed(7, 0) != mix_seed(7, 1) != mix_seed(8, 1) and 0 <= mix_seed(-5, 3) < 2**63


def test_unseeded_rows_use_the_sampler_generator():
    logits = torch.zeros(4, V)
    a = Sampler(seed=11)(logits, [req() for _ in range(4)])
    b = Sampler(seed=11)(logits, [req() for _ in range(4)])
    assert a == b
    assert len({t for t, _ in Sampler(seed=11)(torch.zeros(64, V), [req() for _ in range(64)])}) > 10


def test_sampler_frequencies():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    out = Sampler(seed=5)(logits, [req(temperature=1.0) for _ in range(4000)])
    freq = torch.bincount(torch.tensor([t for t, _ in out]), minlength=4).double() / 4000
    assert ((freq - probs.double()).abs() < 5 * (probs.double() * (1 - probs.double()) / 4000).sqrt()).all()
    # temperature 0.5 squares the probabilities (0.828, 0.144, 0.023, 0.006 renormalised);
    # top_p 0.9 then keeps only tokens 0 and 1
    out = Sampler(seed=6)(logits, [req(temperature=0.5, top_p=0.9, seed=i) for i in range(4000)])
    freq = torch.bincount(torch.tensor([t for t, _ in out]), minlength=4).double() / 4000
    sq = torch.tensor([0.36, 0.0625]).double()
    want = sq / sq.sum()
    assert freq[2] == freq[3] == 0 and abs(freq[0] - want[0]) < 5 * math.sqrt(want[0] * want[1] / 4000)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(4, V)
    logits[:, 0], logits[:, 1], logits[:, 2] = 9.0, 8.0, 7.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    out = Sampler()(logits, [req(p, eos=0), req(p, output=[5], eos=0), req(p, output=[5, 5], eos=0),
                             req(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), eos=0)])
    assert [t for t, _ in out] == [2, 2, 0, 0]
    sampled = Sampler(seed=0)(logits[:1], [req(SamplingParams(min_tokens=3, stop_token_ids=[1, 2]), eos=0)])
    assert sampled[0][0] not in (0, 1, 2)


def test_logprobs_are_raw():
    logits = torch.randn(R, V)
    reqs = [req(temperature=0.3, logprobs=3, repetition_penalty=1.5, prompt=[1, 2], seed=r) for r in range(R - 1)]
    reqs.append(req(temperature=0))
    out = Sampler()(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    for r, (token, lp) in enumerate(out[:-1]):
        order = sorted(range(V), key=lambda i: (-raw[r, i].item(), i))
        assert lp.token_id == token and lp.logprob == pytest.approx(raw[r, token].item(), abs=1e-6)
        assert lp.rank == order.index(token) + 1
        assert [i for i, _ in lp.top] == order[:3] and len(lp.top) == 3
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    assert out[-1][1] is None
    mixed = Sampler()(logits[:2], [req(temperature=0, logprobs=0), req(temperature=0, logprobs=5)])
    assert mixed[0][1].top == [] and len(mixed[1][1].top) == 5 and mixed[0][1].rank == 1


def test_prompt_logprobs_whole_and_chunked():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = torch.randn(len(prompt), V)  # the last row predicts the first output token
    whole = prompt_logprobs(logits, prompt, 2)
    assert len(whole) == len(prompt) and whole[0] is None
    raw = torch.log_softmax(logits, -1)
    for i in range(1, len(prompt)):
        assert whole[i].token_id == prompt[i]
        assert whole[i].logprob == pytest.approx(raw[i - 1, prompt[i]].item(), abs=1e-6)
        assert [t for t, _ in whole[i].top] == raw[i - 1].argsort(descending=True, stable=True)[:2].tolist()
    chunked = [None]
    for start, end in ((0, 3), (3, 5), (5, 8)):
        chunked += prompt_logprobs_chunk(logits[start:end], prompt[start + 1:end + 1], 2)
    assert chunked == whole
    assert prompt_logprobs(logits[:7], prompt, 0)[1:] == [
        type(e)(e.token_id, e.logprob, e.rank, []) for e in whole[1:]]


# ---- robustness: values SamplingParams accepts never make the sampler raise ------------------
INF = float("inf")


def test_huge_top_k_keeps_every_token():
    logits = torch.randn(3, V)
    want = Sampler()(logits, [req(seed=s) for s in range(3)])
    for k in (V, V + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30):  # 2**63 used to overflow torch.tensor
        assert Sampler()(logits, [req(top_k=k, seed=s) for s in range(3)]) == want
    assert Sampler()(logits, [req(top_k=V - 1, seed=s) for s in range(3)]) is not None


def test_tiny_temperature_is_greedy_and_huge_values_saturate():
    logits = torch.randn(R, V) * 3
    argmax = logits.argmax(-1).tolist()
    for t in (1e-300, 5e-324, 9e-6):  # 1e-300 used to turn the logits into inf and the probabilities into NaN
        assert [tok for tok, _ in Sampler()(logits, [req(temperature=t) for _ in range(R)])] == argmax
    big = (torch.rand(R, V) * 2 - 1) * 3.4e38  # huge finite logits: dividing by a small temperature overflows without the max shift
    big[:, :3] = -INF
    out = Sampler(seed=1)(big, [req(temperature=1e-5, seed=i) for i in range(R)])
    assert [tok for tok, _ in out] == big.argmax(-1).tolist()
    out = Sampler(seed=1)(big, [req(temperature=1e308, top_p=1e-300, min_p=1e-300, seed=i) for i in range(R)])
    assert all(3 <= tok < V for tok, _ in out)
    # temperature 1e308 (inf in fp32) is uniform over the finite tokens: -inf stays -inf, never NaN
    flat = torch.randn(1, 4).expand(2000, 4).contiguous()
    flat[:, 0] = -INF
    out = Sampler(seed=2)(flat, [req(temperature=1e308, seed=i) for i in range(2000)])
    freq = torch.bincount(torch.tensor([t for t, _ in out]), minlength=4)
    assert freq[0] == 0 and (freq[1:] > 550).all(), freq


def test_extreme_penalties_saturate():
    logits = torch.tensor([[3.0, -1.0, 0.0, 2.0, -0.5]])
    seen = [0, 1, 2, 3, 4]
    # 1e-300 is 0 in fp32 (x / 0 = inf); 1e308 is inf (0 * inf = NaN): both are clamped into range
    for rep in (1e-300, 5e-324, 1e-38, 1e38, 1e308):
        out = Sampler()(logits.expand(2, 5), [req(temperature=0, prompt=seen, repetition_penalty=rep),
                                 req(temperature=0.7, prompt=seen, repetition_penalty=rep, seed=3)])
        assert all(0 <= t < 5 for t, _ in out)
    # a penalty < 1 saturates every positive seen logit at the top: the smallest id among them wins
    assert Sampler()(logits, [req(temperature=0, prompt=[3, 0], repetition_penalty=1e-300)])[0][0] == 0
    # every logit negative and seen, a huge penalty: all -inf -> fallback to the raw argmax
    neg = -torch.rand(2, V) - 0.1
    out = Sampler()(neg, [req(temperature=0, prompt=range(V), repetition_penalty=1e308),
                          req(temperature=1.0, prompt=range(V), repetition_penalty=1e308, seed=0)])
    assert [t for t, _ in out] == neg.argmax(-1).tolist()


def test_rows_without_a_finite_logit_fall_back():
    raw = torch.full((6, V), -INF)
    raw[1, 9] = float("nan")  # NaN counts as -inf
    raw[2, 4], raw[2, 7] = 1.0, 2.0
    raw[3, 11] = INF  # +inf is the best logit, not a NaN probability
    raw[4, 5] = raw[5, 5] = 1.0
    reqs = [req(temperature=0), req(seed=1, top_p=0.5),
            req(allowed_token_ids=[3, 8], seed=2),  # the allowed tokens are all -inf: the first allowed one
            req(seed=3, min_p=0.5, logprobs=2),
            req(temperature=0, eos=5, min_tokens=2, stop_token_ids=[9]),  # only eos is finite, min_tokens bans it
            req(allowed_token_ids=[5], eos=5, min_tokens=2)]  # allowed ids all banned: allowed_token_ids win
    out = Sampler(seed=0)(raw, reqs)
    assert [t for t, _ in out] == [0, 0, 3, 11, 0, 5]
    assert out[3][1].token_id == 11
    # a row with finite logits among the allowed ones is unaffected by a fallback row beside it
    raw[0, 20] = 0.0
    out = Sampler(seed=0)(raw[:3], [req(temperature=0), req(), req(allowed_token_ids=[4, 8], temperature=0)])
    assert [t for t, _ in out] == [20, 0, 4]


# ---- allowed_token_ids ----------------------------------------------------------------------
def test_allowed_token_ids_greedy_and_seeded_sampling():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(R, V, generator=g)
    allowed = [3, 17, 30]
    best = max(allowed, key=lambda i: logits[0, i].item())
    out = Sampler()(logits, [req(temperature=0, allowed_token_ids=allowed), req(temperature=0),
                             req(top_k=1, allowed_token_ids=[36]), req(temperature=0, allowed_token_ids=list(range(V))),
                             req(temperature=0, allowed_token_ids=allowed, logprobs=1)])
    assert [t for t, _ in out] == [best, logits[1].argmax().item(), 36, logits[3].argmax().item(),
                                   max(allowed, key=lambda i: logits[4, i].item())]
    raw = torch.log_softmax(logits[4], -1)  # logprobs stay those of the raw distribution
    assert out[4][1].logprob == pytest.approx(raw[out[4][0]].item(), abs=1e-6)
    assert out[4][1].top[0][0] == raw.argmax().item()
    # sampling: only allowed ids, each about as often as its renormalised probability
    flat = torch.zeros(3000, V)
    flat[:, 5] = 5.0  # the best token is not allowed
    flat[:, 17] = math.log(3.0)
    draws = Sampler(seed=1)(flat, [req(allowed_token_ids=allowed, seed=i) for i in range(3000)])
    freq = torch.bincount(torch.tensor([t for t, _ in draws]), minlength=V)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(allowed)
    assert abs(freq[17].item() / 3000 - 0.6) < 0.05
    # a seeded row with allowed_token_ids draws the same token in any batch
    target = req(allowed_token_ids=allowed, temperature=1.5, top_p=0.95, seed=99, output=[1, 2])
    alone = Sampler()(logits[:1], [target])[0][0]
    for trial in range(4):
        others = [req(allowed_token_ids=[trial], seed=trial), req(), req(temperature=0, allowed_token_ids=[1, 2])]
        batch = others[:trial] + [target] + others[trial:]
        rows = torch.randn(len(batch), V, generator=g)
        rows[trial] = logits[0]
        assert Sampler(seed=trial)(rows, batch)[trial][0] == alone


def test_allowed_ids_cached_per_request():
    p = SamplingParams(allowed_token_ids=[1, 2, 3])
    ids = Sampler._allowed_ids(p, V)
    assert Sampler._allowed_ids(p, V) is ids and ids.tolist() == [1, 2, 3]
    assert Sampler._allowed_ids(p, 3).tolist() == [1, 2]  # ids beyond the logits are ignored
    p.allowed_token_ids = [4]
    assert Sampler._allowed_ids(p, V).tolist() == [4]


# ---- bad words ------------------------------------------------------------------------------
def test_bad_words_token_ids(tok):
    enc = lambda text: tok.encode(text, allow_special=False)  # noqa: E731
    assert enc(" the") != enc("the") and len(enc(" the")) != len(enc("the"))
    # " the" is another token than "the": both are banned (vLLM keeps the spaced form only at equal length)
    assert bad_words_token_ids(tok, ["the"]) == [enc("the"), enc(" the")]
    # " hello" ends with "hello"'s tokens: banning "hello" already bans it
    assert enc(" hello")[1:] == enc("hello") and bad_words_token_ids(tok, ["hello"]) == [enc("hello")]
    # leading whitespace is stripped, duplicates dropped, whitespace-only words kept as they are
    assert bad_words_token_ids(tok, ["  the", "the", "\n"]) == [enc("the"), enc(" the"), enc("\n")]
    assert bad_words_token_ids(tok, ["<|im_end|>"])[0] == enc("<|im_end|>") != [tok.eos_token_id]


def test_banned_tokens_rule():
    seqs = [[5], [1, 2, 3], [2, 3, 4], [7, 50]]
    assert banned_tokens(seqs, [], 40) == [5]
    assert banned_tokens(seqs, [9, 1, 2], 40) == [5, 3]
    assert banned_tokens(seqs, [1, 2, 3], 40) == [5, 4]
    assert banned_tokens(seqs, [2], 40) == [5]  # [1, 2, 3] needs both prefix tokens
    assert banned_tokens(seqs, [7], 40) == [5]  # 50 is outside the vocabulary: never generated, skipped
    assert banned_tokens(seqs, [7], 51) == [5, 50]


def test_update_from_tokenizer(tok):
    p = SamplingParams(bad_words=["the", "hello"])
    assert p._bad_words_token_ids is None
    p.update_from_tokenizer(tok)
    assert p._bad_words_token_ids == bad_words_token_ids(tok, ["the", "hello"])
    p.update_from_tokenizer(tok)  # idempotent: one SamplingParams may serve several requests
    assert p._bad_words_token_ids == bad_words_token_ids(tok, ["the", "hello"])
    SamplingParams().update_from_tokenizer(None)  # nothing to do without bad words
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None)
    many = SamplingParams(bad_words=["".join(chr(0x4E00 + 97 * i + j) for j in range(MAX_BAD_WORD_CHARS))
                                     for i in range(MAX_BAD_WORDS)])
    with pytest.raises(ValueError, match=f"bad_words tokenize to .* at most {MAX_BAD_WORDS_TOKENS}"):
        many.update_from_tokenizer(tok)


def contains(seq, part):
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bad_words_never_generated(tok, temperature):
    """A fake model that wants to write a script full of bad words: with bad_words set, no bad
    sequence ever appears, and every step whose unconstrained choice completes no bad word
    keeps that choice (greedy, and seeded sampling: the exponential race picks the same token)."""
    words = ["the", "hello", "e"]
    seqs = bad_words_token_ids(tok, words)
    assert any(len(s) == 1 for s in seqs) and any(len(s) > 1 for s in seqs)
    script = tok.encode("hello the cat, hello there: the end e the" * 2, allow_special=False)
    Vt = tok.vocab_size
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(len(script), Vt, generator=g)
    params = SamplingParams(temperature=temperature, bad_words=words, max_tokens=len(script))
    params.update_from_tokenizer(tok)
    free_params = SamplingParams(temperature=temperature)
    out, kept = [], 0
    for step, want in enumerate(script):
        logits = noise[step:step + 1].clone()
        logits[0, want] += 8.0
        seed = 1000 + step
        got = Sampler()(logits, [req(params, output=out, seed=seed)])[0][0]
        free = Sampler()(logits, [req(free_params, output=out, seed=seed)])[0][0]
        banned = {s[-1] for s in seqs if out[len(out) - len(s) + 1:] == s[:-1] or len(s) == 1}
        assert got not in banned
        if free not in banned:
            assert got == free
            kept += 1
        out.append(got)
    assert all(not contains(out, s) for s in seqs)
    assert 0 < kept < len(script)
    for word in words:
        assert word not in tok.decode(out).split()  # as whole words: other words can still contain the letters


def test_bad_words_only_touch_their_row(tok):
    p = SamplingParams(temperature=0, bad_words=["the"])
    p.update_from_tokenizer(tok)
    the = tok.encode(" the", allow_special=False)[0]
    logits = torch.randn(2, tok.vocab_size)
    logits[:, the] = 50.0
    out = Sampler()(logits, [req(p), req(temperature=0)])
    assert out[1][0] == the and out[0][0] == logits[0].masked_fill(
        torch.arange(tok.vocab_size) == the, -INF).argmax().item()


# ---- detokenizer ----------------------------------------------------------------------------
def feed(detok, ids):
    stops, deltas = [], []
    for i in ids:
        if detok.stop_str is not None:
            break
        stops.append(detok.add(i))
        deltas.append(detok.stream_delta())
    deltas.append(detok.stream_delta(finished=True))
    return stops, deltas


def test_detokenizer_multibyte(tok):
    text = "héllo 世界 🙂 ok"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [1, 2], True, [], False)
    seen = []
    for i in ids:
        d.add(i)
        seen.append(d.text)
        assert "\ufffd" not in d.text and text.startswith(d.text)
    assert d.text == tok.decode(ids, True) == text and len(set(seen)) < len(seen)  # bytes were held back
    _, deltas = feed(IncrementalDetokenizer(tok, [], True, [], False), ids)
    assert "".join(deltas) == text
    cut = ids[:-4]  # ends inside the emoji: finish() flushes it as decode() does
    d = IncrementalDetokenizer(tok, [], True, [], False)
    for i in cut:
        d.add(i)
    assert not d.text.endswith("\ufffd")
    assert d.stream_delta(finished=True) is not None and d.text == tok.decode(cut, True)


def test_detokenizer_special_tokens_and_random_bytes(tok):
    eos = tok.eos_token_id
    ids = tok.encode("a<think>b") + [eos] + tok.encode("c")
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, [], skip, [], False)
        for i in ids:
            d.add(i)
        d.finish()
        assert d.text == tok.decode(ids, skip)
    rng = random.Random(0)
    for _ in range(30):  # arbitrary ids, including broken UTF-8: always equal to decode()
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 20))]
        d = IncrementalDetokenizer(tok, [], True, [], False)
        for i in ids:
            d.add(i)
        d.finish()
        assert d.text == tok.decode(ids, True)


def test_detokenizer_stop_across_tokens(tok):
    text = "héllo 世界 🙂 STOP here"
    ids = tok.encode(text)
    for include, want in ((False, "héllo 世界 🙂 "), (True, "héllo 世界 🙂 ST")):
        d = IncrementalDetokenizer(tok, [], True, ["ST", "界 🙂 Z", "xyz"], include)
        stops, deltas = feed(d, ids)
        assert stops[-1] == "ST" and stops.count(None) == len(stops) - 1 and d.stop_str == "ST"
        assert d.text == want and "".join(deltas) == want
        assert tok.decode(ids[:len(stops)], True).startswith(want)
        with pytest.raises(RuntimeError):
            d.add(ids[0])
    d = IncrementalDetokenizer(tok, [], True, ["世界 🙂"], False)  # multi-byte stop string across tokens
    stops, deltas = feed(d, ids)
    assert stops[-1] == "世界 🙂" and d.text == "héllo " and "".join(deltas) == "héllo "


def test_detokenizer_earliest_stop_and_min_tokens(tok):
    ids = tok.encode("abcdef")
    d = IncrementalDetokenizer(tok, [], True, ["ef", "bcdef"], False)
    feed(d, ids)
    assert d.stop_str == "bcdef" and d.text == "a"
    d = IncrementalDetokenizer(tok, [], True, ["a"], False, min_tokens=len(ids))
    feed(d, ids)
    assert d.stop_str is None and d.text == "abcdef"


def test_stream_delta_never_leaks_partial_stop(tok):
    rng = random.Random(1)
    alphabet = "ab世🙂 "
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(5, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        d = IncrementalDetokenizer(tok, [], True, stops, False)
        snapshots, streamed = [], ""
        for i in tok.encode(text):
            stopped = d.add(i)
            streamed += d.stream_delta()
            snapshots.append(streamed)
            if stopped:
                break
        streamed += d.stream_delta(finished=True)
        hits = [(text.find(s), s) for s in stops if s in text]
        assert d.text == (text[:min(hits)[0]] if hits else text) == streamed
        assert all(d.text.startswith(snap) for snap in snapshots)  # nothing streamed was taken back


def test_stream_delta_holds_back_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, [], True, ["STOP", "x"], False)
    assert [d.add(i) for i in tok.encode("go ST")] == [None] * len(tok.encode("go ST"))
    assert d.stream_delta() == "go" and d.text == "go ST"
    for i in tok.encode("AY"):
        d.add(i)
    assert d.stream_delta() == " S" and d.stream_delta(finished=True) == "TAY" and d.text == "go STAY"
    assert d.stream_delta(finished=True) == ""


def test_a_long_delta_stream_keeps_its_text_in_few_pieces(tok):
    """A DELTA stream never reads `text`; the deltas it was given are joined every 256, and `text` is still
    their concatenation and the one-shot decode."""
    rng = random.Random(2)
    ids = [rng.randrange(300) for _ in range(700)]
    d = IncrementalDetokenizer(tok, [], True)
    deltas = []
    for i in ids:
        d.add(i)
        deltas.append(d.stream_delta())
        assert len(d._sent) <= 257
    deltas.append(d.stream_delta(finished=True))
    assert d.text == "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_incremental_utf8_matches_one_shot():
    rng = random.Random(2)
    for _ in range(200):
        data = bytes(rng.choice([0x41, 0xC3, 0xA9, 0xE4, 0xB8, 0x96, 0xF0, 0x9F, 0x99, 0x82, 0xFF]) for _ in range(12))
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        parts = "".join(dec.decode(data[i:i + 1]) for i in range(len(data))) + dec.decode(b"", final=True)
        assert parts == data.decode("utf-8", errors="replace")


def test_sample_plain_is_the_general_path():
    """The device fast path (`Sampler.sample_plain`; all-greedy batches take a shorter chain) gives the
    tokens `__call__` gives, on odd-sized logits with NaN, +inf and all -inf rows, greedy and seeded rows."""
    from kimiserve.engine.sampler import SampleRequest, Sampler

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 37, generator=g) * 4
    x[1, 5] = float("nan")
    x[2, [3, 9]] = float("inf")
    x[3] = float("-inf")
    x[4, :] = float("nan")
    x[5, [0, 30]] = 2.5 + x[5].abs().max()  # a tie: the smaller id
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    for params in ([greedy] * 7, [greedy, seeded] * 3 + [greedy]):
        rows = [SampleRequest(p, [1, 2], [4] * i, p.seed, 0) for i, p in enumerate(params)]
        assert all(r.is_plain for r in rows)
        fast = Sampler(0).sample_plain(x, rows)
        # the general path (masks, bias, penalties, fallback): the same rows with a bias of 0, not plain
        general = [SampleRequest(SamplingParams(**{**vars(p), "logit_bias": {0: 0.0}}), [1, 2], [4] * i, p.seed, 0)
                   for i, p in enumerate(params)]
        assert not any(r.is_plain for r in general)
        assert fast.tolist() == [t for t, _ in Sampler(0)(x.clone(), general)]
        if params[1] is greedy:
            assert fast[5].item() == 0 and fast[3].item() == 0 and fast[2].item() == 3
