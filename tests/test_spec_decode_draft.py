"""Draft-model speculation on the tiny model: the target drafting for itself accepts (nearly) every
draft; a tiny model with other random weights accepts some; both give the greedy and seeded outputs of
speculation off, through chunked prefill, preemption and prefix hits, and free every draft page."""

from __future__ import annotations

import pytest

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.sampling_params import SamplingParams
from test_spec_decode import FEW, mixed_params, spec_counts, tokens


def draft(k, **kw):
    return {"method": "draft_model", "model": "tiny", "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def reference():
    prompts = random_prompts([20, 57, 9, 90], seed=7)
    params = mixed_params(30)
    params[1] = SamplingParams(max_tokens=30, **GREEDY)
    params[3] = SamplingParams(max_tokens=30, n=2, seed=5, temperature=0.9, top_k=4, allowed_token_ids=FEW,
                               ignore_eos=True)
    off = make_engine(max_num_batched_tokens=32)
    return prompts, params, tokens(run(off, prompts, params))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_accepts_and_matches(reference, k):
    prompts, params, want = reference
    on = make_engine(max_num_batched_tokens=32, speculative_config=draft(k))
    counts = {}
    release = on.scheduler.on_finish
    on.scheduler.on_finish = lambda r: (counts.__setitem__((r.request_id, r.sample_index),
                                                           (r.num_draft_tokens, r.num_accepted_tokens)), release(r))
    assert tokens(run(on, prompts, params)) == want
    drafted, accepted, per_pos = spec_counts(on)
    # the same weights: greedy requests without penalties (which the draft does not apply) accept every
    # draft; the penalised and the sampled ones some
    for rid in ("r0", "r1"):
        assert counts[(rid, 0)][0] > 0 and counts[(rid, 0)][1] == counts[(rid, 0)][0], counts
    assert 0 < accepted < drafted and per_pos[-1] > 0
    on.check_idle()


def test_other_weights_draft_preemption_prefix_hits(reference):
    prompts, params, want = reference
    on = make_engine(max_num_batched_tokens=32, num_pages=24, speculative_config=draft(3, draft_seed=1,
                                                                                       draft_num_pages=40))
    assert tokens(run(on, prompts, params)) == want
    assert on.stats()["preemptions"] > 0
    drafted, accepted, _ = spec_counts(on)
    assert 0 < accepted < drafted
    on.check_idle()
    on.allocator.evict_all()
    again = make_engine(max_num_batched_tokens=32, speculative_config=draft(3, draft_seed=1))
    run(again, prompts, params)
    assert tokens(run(again, prompts, params, ids=["a", "b", "c", "d"])) == {
        new: want[old] for new, old in zip("abcd", want)}
    assert again.stats()["prefix_hit_tokens"] > 0
    again.check_idle()


def test_draft_model_errors():
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(speculative_config=draft(2, model="small"))


def test_benchmark_quick(tmp_path):
    """benchmarks/spec_decode.py --quick runs every method and writes complete rows; speculation gives
    the tokens of speculation off."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import spec_decode

    out = tmp_path / "spec.json"
    assert spec_decode.main(["--quick", "--batch-sizes", "1", "--kinds", "repetitive,agentic", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["method"]) for r in rows] == [(k, m) for k in ("repetitive", "agentic")
                                                        for m in ("off", "ngram", "draft")]
    assert all(r["same_tokens_as_off"] for r in rows if r["method"] != "off")
    assert all(r["acceptance_length"] == 4.0 for r in rows if r["method"] == "draft")  # the target drafting for itself


def test_abort_mid_round_frees_draft_pages():
    engine = make_engine(speculative_config=draft(3, draft_seed=1))
    p = SamplingParams(max_tokens=40, allowed_token_ids=FEW, **GREEDY)
    for i, prompt in enumerate(random_prompts([30, 45], seed=2)):
        engine.add_request(f"q{i}", prompt, p)
    while len(engine.scheduler.running) < 2 or not all(r.spec_token_ids for r in engine.scheduler.running):
        engine.step()
    assert engine.proposer.allocator.num_used > 0
    engine.abort_request("q0")  # drafts pending
    engine.step()  # q1 verifies
    engine.abort_request("q1")
    engine.check_idle()  # the target's pages and the draft model's (check_idle of its allocator)
    assert engine.proposer.allocator.num_used == 0
