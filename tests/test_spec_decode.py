"""Speculative decoding (n-gram proposer) on the tiny model: greedy and seeded outputs token for token
equal to speculation off, with drafts both accepted and rejected; KDA state equal to a run without
speculation; prefix-cache hits, chunked prefill, preemption, aborts mid-round and n > 1; no leaks."""

from __future__ import annotations

import random

import pytest
import torch

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.spec_decode.config import SpeculativeConfig
from kimiserve.engine.spec_decode.ngram import ngram_propose
from kimiserve.engine.spec_decode.verify import accept_drafts
from kimiserve.sampling_params import SamplingParams


def ngram(k, **kw):
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


# a few tokens allowed: greedy outputs repeat themselves, so n-gram drafts are often right (and often not)
FEW = [3, 7, 11, 19, 23]


def mixed_params(max_tokens=40):
    return [SamplingParams(max_tokens=max_tokens, allowed_token_ids=FEW, **GREEDY),
            SamplingParams(max_tokens=max_tokens, repetition_penalty=0.3, **GREEDY),
            SamplingParams(max_tokens=max_tokens, allowed_token_ids=FEW[:3], presence_penalty=0.5, **GREEDY),
            SamplingParams(max_tokens=max_tokens, **GREEDY)]


def tokens(outs):
    return {k: [list(c.token_ids) for c in o.outputs] for k, o in outs.items()}


def spec_counts(engine):
    s = engine.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"], s["spec_decode_num_accepted_tokens_per_pos"]


def test_config_errors():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_user({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="needs 'num_speculative_tokens'"):
        SpeculativeConfig.from_user({"method": "ngram"})
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_user("{method: ngram}")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_user(ngram(2, prompt_lookup_min=5, prompt_lookup_max=3))
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.from_user({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="for method draft_model"):
        SpeculativeConfig.from_user(ngram(2, model="tiny"))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with speculative_config"):
        EngineArgs(tensor_parallel_size=2, speculative_config=ngram(2)).validate()
    with pytest.raises(ValueError, match="prefill_context_parallel_size"):
        EngineArgs(prefill_context_parallel_size=2, speculative_config=ngram(2)).speculative()
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineArgs(batch_invariant=True, speculative_config=ngram(2)).validate()
    c = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 1, 2)


def _ngram_rule(seq, k, lo, hi):
    """The proposer's rule in plain Python: the longest n in [lo, hi] whose occurrence is followed by k tokens
    (its latest), else the earliest occurrence of the longest n-gram; n-grams end before the last token."""
    L = len(seq)
    def matched(i):  # the n-gram ending at i matching the sequence's last tokens, up to hi
        n = 0
        while n < hi and i - n >= 0 and n < L - 1 and seq[i - n] == seq[L - 1 - n]:
            n += 1
        return n
    if k < 1 or L < lo + 1:
        return []
    lengths = {i: matched(i) for i in range(L - 1)}
    best = max(lengths.values(), default=0)
    if best < lo:
        return []
    for n in range(best, lo - 1, -1):
        ends = [i for i, m in lengths.items() if m >= n and i + k <= L - 1]
        if ends:
            return seq[ends[-1] + 1 : ends[-1] + 1 + k]
    end = min(i for i, m in lengths.items() if m == best)
    return seq[end + 1 : end + 1 + k]


def test_ngram_propose_and_accept():
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3]
    assert ngram_propose(seq, 2, 1, 4) == [4, 8]  # "1 2 3" last seen before "4 8"
    assert ngram_propose(seq, 5, 1, 4) == [4, 8, 1, 2, 3]
    assert ngram_propose(seq, 6, 1, 4) == [4, 9, 1, 2, 3, 4]  # the later match has no 6 tokens after it
    assert ngram_propose([5, 6, 7], 3, 1, 4) == []
    assert ngram_propose([5, 6, 5, 7, 6], 2, 2, 4) == []  # only 1-grams match
    assert ngram_propose([7, 7, 7, 7, 7], 3, 1, 4) == [7, 7, 7]
    assert accept_drafts([4, 8, 1], [4, 8, 2, 5]) == 2
    rng = random.Random(0)
    for _ in range(400):  # against the rule written out in Python, on short sequences over few tokens
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 3)
        hi = rng.randrange(lo, 6)
        assert ngram_propose(seq, k, lo, hi) == _ngram_rule(seq, k, lo, hi), (seq, k, lo, hi)
    assert accept_drafts([4, 8, 1], [5, 8, 1, 5]) == 0
    assert accept_drafts([4, 8, 1], [4, 8, 1, 5]) == 3


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equal_mixed_batch_chunked(k):
    """Four requests of mixed lengths in one batch; a 24-token budget chunks the long prompts, so verify
    chunks share steps with prefill chunks and the budget cuts drafts short."""
    prompts = random_prompts([20, 57, 9, 90], seed=7)
    params = mixed_params()
    off = make_engine(max_num_batched_tokens=24)
    on = make_engine(max_num_batched_tokens=24, speculative_config=ngram(k))
    want, got = tokens(run(off, prompts, params)), tokens(run(on, prompts, params))
    assert got == want
    drafted, accepted, per_pos = spec_counts(on)
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    if k > 1:
        assert per_pos[1] > 0  # acceptances past the first position
    off.check_idle()
    on.check_idle()


def test_prefix_hits_preemption_and_seeded_n():
    """A small pool preempts (and recomputes) running requests mid-round; the second run hits the prefix
    cache; seeded sampled requests with n = 3 get the very tokens they get without speculation (in a
    roomy pool, no prefix hits: that neither changes tokens without speculation is test_engine's)."""
    prompts = random_prompts([40, 70, 33], seed=3)
    params = mixed_params(48)[:2] + [SamplingParams(max_tokens=48, n=3, seed=11, temperature=0.8, top_p=0.9, top_k=5,
                                                    allowed_token_ids=FEW, frequency_penalty=0.3, ignore_eos=True)]
    want = tokens(run(make_engine(), prompts, params))
    assert len(set(map(tuple, want["r2"]))) == 3  # three different samples
    small = make_engine(num_pages=21, speculative_config=ngram(3))
    assert tokens(run(small, prompts, params)) == want
    assert small.stats()["preemptions"] > 0
    small.check_idle()
    engine = make_engine(speculative_config=ngram(3))
    run(engine, [p[:-3] for p in prompts] + prompts[:1], params[:1] * 4)
    assert tokens(run(engine, prompts, params, ids=["r0", "r1", "r2"])) == want
    assert engine.stats()["prefix_hit_tokens"] > 0
    engine.check_idle()
    drafted, accepted, _ = spec_counts(small)
    assert 0 < accepted < drafted


def _state(engine, request):
    pool = engine.pool
    pages = torch.tensor(request.state_pages)
    return pool.recurrent[pages].clone(), pool.conv[pages].clone()


def test_kda_state_matches_run_without_speculation_and_abort_mid_round():
    """After every verify round the sequence's KDA recurrent and conv states equal those of a run without
    speculation at the same position (each step of which advances one token); aborting a request whose
    drafts are pending (and another in the middle of a verify) leaves no page held."""
    prompt = random_prompts([37], seed=9)[0]
    p = SamplingParams(max_tokens=60, allowed_token_ids=FEW, **GREEDY)
    # the indexer selects every position (index_topk >= the 97-token context): with the tiny preset's top-8 a
    # near-tie in the index scores can select another position in one run than in the other from the rounding below
    # (seen on an Intel Xeon: the states' error jumped from 2e-7 to 2.4e-5 at one token), which is the sparse
    # attention's discontinuity, not the KDA state this test is about
    wide = {"index_topk": 128}
    on = make_engine(speculative_config=ngram(4), model_overrides=wide)
    off = make_engine(model_overrides=wide)
    on.add_request("a", prompt, p)
    off.add_request("a", prompt, p)
    checked = rounds_with_rejection = 0
    worst = 0.0
    while on.has_unfinished_requests():
        before = on.stats()["spec_decode_num_accepted_tokens"], on.stats()["spec_decode_num_draft_tokens"]
        on.step()
        if not on.scheduler.running:
            break
        r_on = on.scheduler.running[0]
        while off.scheduler.running[0].num_computed < r_on.num_computed if off.scheduler.running else True:
            off.step()
        r_off = off.scheduler.running[0]
        assert r_off.num_computed == r_on.num_computed and r_off.all_ids[: r_on.num_tokens] == r_on.all_ids
        (rec_on, conv_on), (rec_off, conv_off) = _state(on, r_on), _state(off, r_off)
        # the verify step's projections run other batch shapes (other BLAS kernels), so the KDA inputs differ
        # by fp32 rounding (seen: <= 2e-6 relative over the whole state); a state one token behind is off by 0.23.
        # For the same inputs the verify path is bit for bit a decode step's (tests/test_spec_verify_kda.py)
        for a, b in ((rec_on, rec_off), (conv_on, conv_off)):
            worst = max(worst, float((a - b).norm() / b.norm()))
            assert worst < 1e-5, (checked, worst)
        checked += 1
        after = on.stats()["spec_decode_num_accepted_tokens"], on.stats()["spec_decode_num_draft_tokens"]
        rounds_with_rejection += after[1] - before[1] > after[0] - before[0]
    print(f"{checked} rounds checked, worst relative state error {worst:.2e}")
    assert checked > 5 and rounds_with_rejection > 0 and on.stats()["spec_decode_num_accepted_tokens"] > 0
    on.check_idle()

    # aborts between a round's proposal and its verification (the drafts pending), and right after a
    # verify step that released rejected pages
    on.add_request("x", prompt, p)
    on.add_request("y", random_prompts([25], seed=4)[0], p)
    while len(on.scheduler.running) < 2 or not all(r.spec_token_ids for r in on.scheduler.running):
        on.step()
    on.abort_request("x")
    on.step()  # y verifies its drafts
    on.abort_request("y")
    assert not on.has_unfinished_requests()
    on.check_idle()
    assert on.allocator.stats()["pages_used"] == on.allocator.stats()["pages_cached"]


def test_logprobs_stops_and_length_limits():
    """Kept tokens carry their own row's logprobs; a stop token or max_model_len inside an accepted run
    of drafts ends the request there, as without speculation."""
    prompts = random_prompts([30, 50, 40], seed=12)
    params = [SamplingParams(max_tokens=40, allowed_token_ids=FEW, logprobs=3, **GREEDY),
              SamplingParams(max_tokens=40, allowed_token_ids=FEW, stop_token_ids=[23], min_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=200, allowed_token_ids=FEW[:2], **GREEDY)]
    outs = []
    for spec in (None, ngram(5)):
        engine = make_engine(max_model_len=72, speculative_config=spec)
        outs.append(run(engine, prompts, params))
        engine.check_idle()
    (off, on) = outs
    assert tokens(on) == tokens(off)
    assert on["r1"].outputs[0].finish_reason == "stop" and on["r2"].outputs[0].finish_reason == "length"
    assert len(on["r2"].outputs[0].token_ids) == 72 - 40
    for a, b in zip(on["r0"].outputs[0].logprobs, off["r0"].outputs[0].logprobs):
        assert a.token_id == b.token_id and a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_llm_api_and_cli_flag():
    import argparse

    from kimiserve.entrypoints.llm import LLM

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert args.speculative().num_speculative_tokens == 2
    llm = LLM("tiny", max_model_len=128, num_pages=60, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prompt = [3, 7, 11, 3, 7, 11, 3, 7]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, allowed_token_ids=FEW, **GREEDY), use_tqdm=False)
    ref = LLM("tiny", max_model_len=128, num_pages=60).generate([prompt], SamplingParams(
        max_tokens=12, allowed_token_ids=FEW, **GREEDY), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0


def test_thinking_budget_inside_drafts():
    """A thinking budget forces </think> at the same position with speculation as without, also when
    the drafts run past the budget (each verify row sees the budget's state after the drafts before it)."""
    outs = []
    for spec in (None, ngram(4)):
        engine = make_engine(speculative_config=spec)
        start, end = (engine.tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
        prompt = random_prompts([20], seed=5)[0] + [start]
        params = [SamplingParams(max_tokens=30, thinking_token_budget=b, allowed_token_ids=FEW, **GREEDY)
                  for b in (3, 9)]
        outs.append(tokens(run(engine, [prompt, prompt], params)))
        engine.check_idle()
    assert outs[1] == outs[0]
    assert outs[0]["r0"][0][3] == end and outs[0]["r1"][0][9] == end


def test_structured_outputs_under_speculation():
    """Guided requests: every verify row is masked by the grammar as it is after the drafts before it
    (drafts the grammar refuses are never kept); greedy and seeded outputs equal speculation off and
    match the grammar."""
    import re

    pytest.importorskip("llguidance", reason="guided decoding needs llguidance (the guided / test extras)")
    from kimiserve.structured_output import StructuredOutputsParams as Spec

    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=Spec(regex="(ab|ba|abc ){4,12}")),
              SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured_outputs=Spec(regex="[xy]{6,20}z")),
              SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=Spec(choice=["yes yes yes", "no no"]))]
    prompt = "ab ba abc ab ba abc xy yx xyz yes no"
    outs = []
    for spec in (None, ngram(3)):
        engine = make_engine(speculative_config=spec)
        outs.append(run(engine, [prompt] * 3, params))
        engine.check_idle()
    off, on = outs
    assert tokens(on) == tokens(off)
    assert re.fullmatch("(ab|ba|abc ){4,12}", on["r0"].outputs[0].text) and on["r2"].outputs[0].text in ("yes yes yes", "no no")
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
