"""The speculative paths that run on CUDA graphs (verify graphs and their KDA replay, the draft model's
decode / verify / drafting-loop graphs), run on the CPU with emulated graphs (`graph_emulation`): greedy
outputs token for token equal to speculation off, every graph set replayed, no leaked pages."""

from __future__ import annotations

import pytest
import torch

from engine_utils import GREEDY, make_engine, random_prompts, run
from graph_emulation import emulate_cuda_graphs
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams
from test_spec_decode import FEW, mixed_params, ngram, spec_counts, tokens


@pytest.fixture(scope="module")
def reference():
    prompts = random_prompts([20, 57, 9], seed=7)
    params = mixed_params(24)[:2] + [SamplingParams(max_tokens=24, **GREEDY)]
    return prompts, params, tokens(run(make_engine(enforce_eager=True), prompts, params))


def test_ngram_on_emulated_verify_graphs(reference, monkeypatch):
    prompts, params, want = reference
    emulate_cuda_graphs(monkeypatch)
    on = make_engine(speculative_config=ngram(3))
    assert on.runner.verify_graphs is not None
    assert tokens(run(on, prompts, params)) == want
    assert on.runner.verify_graphs.replays > 3
    drafted, accepted, _ = spec_counts(on)
    assert 0 < accepted < drafted
    on.check_idle()


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_on_emulated_graphs(reference, monkeypatch, k):
    prompts, params, want = reference
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": k}
    eager = make_engine(enforce_eager=True, speculative_config=spec)
    assert tokens(run(eager, prompts, params)) == want
    emulate_cuda_graphs(monkeypatch)
    on = make_engine(speculative_config=spec)
    assert tokens(run(on, prompts, params)) == want
    sets = [on.runner.verify_graphs, on.proposer.runner.verify_graphs] + ([on.proposer.loop_graphs] if k > 1 else [])
    for graphs in sets:
        assert graphs.disabled is None and graphs.replays > 2, (type(graphs).__name__, graphs.disabled, graphs.replays)
    # the same drafts as the draft model stepping eagerly (the target drafting for itself: the rows without
    # penalties accept every draft, the penalised one none)
    assert spec_counts(on) == spec_counts(eager)
    assert spec_counts(on)[1] > 0
    on.check_idle()


def test_drafts_left_on_the_device(monkeypatch):
    """Plain rows (greedy and seeded sampling): the drafting loop's drafts go to the verify step without the
    host reading them, through the verify graphs and (steps with a prefill chunk, chunked at 32 tokens) the
    eager verify path; the next catch-ups start from the loop's saved state after the accepted drafts;
    the outputs are those of speculation off, the drafts (accepted alike) those of the eager draft."""
    from kimiserve.engine import runner as runner_mod
    from kimiserve.engine.spec_decode import device_drafts, draft_model, verify_graphs

    prompts = random_prompts([20, 57, 9, 70], seed=3)
    params = [SamplingParams(max_tokens=24, **GREEDY)] * 3 + [
        SamplingParams(max_tokens=24, seed=5, temperature=0.9, top_k=4, ignore_eos=True)]
    want = tokens(run(make_engine(enforce_eager=True, max_num_batched_tokens=32), prompts, params))
    emulate_cuda_graphs(monkeypatch)
    calls = {"rounds": 0, "graph": 0, "eager": 0}
    made = device_drafts.DeviceDrafts.of
    monkeypatch.setattr(device_drafts.DeviceDrafts, "of",
                        classmethod(lambda cls, t: (calls.__setitem__("rounds", calls["rounds"] + 1), made(t))[1]))
    for module, key in ((verify_graphs, "graph"), (runner_mod, "eager")):
        original = module.write_drafts
        monkeypatch.setattr(module, "write_drafts", lambda *a, _o=original, _k=key: (
            calls.__setitem__(_k, calls[_k] + 1), _o(*a))[1])
    # not make_engine: its recording sampler has no device fast path, which device drafts need
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}
    args = dict(model="tiny", dtype="float32", kv_cache_dtype="bf16", max_model_len=512, num_pages=200,
                max_num_batched_tokens=32, speculative_config=spec)
    eager = LLMEngine(EngineArgs(enforce_eager=True, **args))  # no graph sets: the draft steps one at a time
    on = LLMEngine(EngineArgs(**args))
    restored = []  # catch-ups that start from the loop's saved state after the accepted drafts
    restore = draft_model.DraftSequence.restore_accepted
    monkeypatch.setattr(draft_model.DraftSequence, "restore_accepted",
                        lambda seq, new: (lambda copies: (restored.append(len(copies)), copies)[1])(restore(seq, new)))
    assert tokens(run(on, prompts, params)) == want
    assert calls["rounds"] > 3 and calls["graph"] > 3 and calls["eager"] > 0, calls
    assert sum(1 for n in restored if n) > 3, restored
    assert calls["rounds"] == on.proposer.loop_graphs.replays
    assert tokens(run(eager, prompts, params)) == want
    assert spec_counts(on) == spec_counts(eager)  # the same drafts, accepted alike
    on.check_idle()


def test_draft_state_after_accepted_drafts_is_the_caught_up_one(monkeypatch):
    """The draft model's committed KDA state, after a round that started from the loop's saved state (the
    accepted drafts not fed again), equals the state of a draft that fed every token (eager, no loop graph),
    step for step on the same request."""
    prompt = random_prompts([33], seed=5)[0]
    params = SamplingParams(max_tokens=30, **GREEDY)
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}
    args = dict(model="tiny", dtype="float32", kv_cache_dtype="bf16", max_model_len=512, num_pages=200,
                speculative_config=spec)
    eager = LLMEngine(EngineArgs(enforce_eager=True, **args))
    emulate_cuda_graphs(monkeypatch)
    graphs = LLMEngine(EngineArgs(**args))
    for engine in (eager, graphs):
        engine.add_request("r", prompt, params)
    compared = restored = 0
    while graphs.has_unfinished_requests():
        saved = [seq.num_saved for seq in graphs.proposer.sequences.values()]
        eager.step()
        graphs.step()
        restored += sum(1 for n in saved if n)
        (a, sa), (b, sb) = [next(iter(e.proposer.sequences.items()), (None, None)) for e in (eager, graphs)]
        if sa is None or sb is None:
            continue
        assert a.output_ids == b.output_ids and sa.num_computed == sb.num_computed
        for pool_a, pool_b in ((eager.proposer.pool.recurrent, graphs.proposer.pool.recurrent),
                               (eager.proposer.pool.conv, graphs.proposer.pool.conv)):
            # not bit for bit: the tokens before reached the KDA layers through other shapes (decode steps in the
            # loop, a verify chunk in the eager catch-up), whose reductions round apart (~1e-6); a state one
            # token off differs by orders of magnitude more
            torch.testing.assert_close(pool_b[sb.state_pages], pool_a[sa.state_pages], rtol=1e-3, atol=1e-5)
        compared += 1
    assert compared > 3 and restored > 3, (compared, restored)
    graphs.check_idle()


def test_draft_loop_graph_serves_requests_allowed_fewer_drafts(monkeypatch):
    """Near a request's max_tokens its drafts are capped below K; the drafting loop graph still drafts for the
    whole batch (K steps, the capped requests keep their first drafts) instead of every sequence stepping one draft
    at a time: no round drafts step by step, and the outputs and the accepted drafts are those of the eager
    draft (which drafts exactly the capped count)."""
    from kimiserve.engine.spec_decode import draft_model

    prompts = random_prompts([20, 57, 9], seed=11)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (9, 14, 23)]
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 5}
    args = dict(model="tiny", dtype="float32", kv_cache_dtype="bf16", max_model_len=512, num_pages=200,
                speculative_config=spec)
    want = tokens(run(make_engine(enforce_eager=True), prompts, params))
    eager = LLMEngine(EngineArgs(enforce_eager=True, **args))
    assert tokens(run(eager, prompts, params)) == want
    emulate_cuda_graphs(monkeypatch)
    stepped = []
    pick = draft_model.DraftModelProposer._pick
    monkeypatch.setattr(draft_model.DraftModelProposer, "_pick",
                        lambda self, logits, requests: (stepped.append(len(requests)), pick(self, logits, requests))[1])
    on = LLMEngine(EngineArgs(**args))
    assert tokens(run(on, prompts, params)) == want
    assert not stepped, stepped
    assert on.proposer.loop_graphs.replays > 3
    assert spec_counts(on) == spec_counts(eager)
    on.check_idle()
