"""Speculative decoding on CUDA (skipped without a GPU): verify steps and their KDA replay captured as
CUDA graphs (`spec_decode.verify_graphs`) give the tokens of speculation off; the verify path's KDA
numerics are the fused decode kernel's (see also test_spec_verify_kda.py::test_verify_matches_decode_cuda)."""

import pytest
import torch

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.sampling_params import SamplingParams
from test_spec_decode import FEW, mixed_params, ngram, spec_counts, tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[False, True], ids=["per_position", "slots"])
def slots(request, monkeypatch):
    """Engines built with the KDA verify positions per position and the replay, or in one launch per layer into
    state slots and the commit a slot copy (`backend.KDA_VERIFY_SLOTS_ON_CUDA`)."""
    from kimiserve.ops import backend

    monkeypatch.setattr(backend, "KDA_VERIFY_SLOTS_ON_CUDA", request.param)
    return request.param


def check_slots_used(engine, slots: bool) -> None:
    for runner in (engine.runner, getattr(engine.proposer, "runner", None)):
        if runner is not None:
            assert (runner.ops.kda_verify_steps is not None) == slots
            assert runner.verify_graphs is None or runner.verify_graphs.uses_slots(1) == slots


@pytest.mark.parametrize("k", [1, 3])
def test_verify_graphs_on_cuda_match_speculation_off(k, slots):
    prompts = random_prompts([20, 57, 9, 90, 33], seed=7)
    params = mixed_params() + [SamplingParams(max_tokens=40, allowed_token_ids=FEW[:2], **GREEDY)]
    kw = dict(device="cuda", max_num_seqs=8, num_pages=400)
    want = tokens(run(make_engine(**kw), prompts, params))
    on = make_engine(speculative_config=ngram(k), **kw)
    got = tokens(run(on, prompts, params))
    graphs = on.runner.verify_graphs
    assert graphs.disabled is None and graphs.replays > 5, (graphs.disabled, graphs.replays)
    assert got == want
    drafted, accepted, _ = spec_counts(on)
    assert 0 < accepted < drafted
    check_slots_used(on, slots)
    eager = make_engine(speculative_config=ngram(k), enforce_eager=True, **kw)
    assert tokens(run(eager, prompts, params)) == want
    check_slots_used(eager, slots)
    on.check_idle()
    eager.check_idle()


def test_verify_graphs_on_cuda_draft_model(slots):
    """The target drafting for itself (full K + 1 chunks, replays keeping every token); the draft model's
    catch-up chunks on its verify graphs and its drafting loop as one graph. fp32: in bf16 the verify
    step's other GEMM shapes move logits by a bf16 ulp, enough to flip near-tied greedy picks now and
    then (bf16 KDA numerics are checked bit for bit by test_spec_verify_kda.py)."""
    prompts = random_prompts([30, 70], seed=3)
    params = SamplingParams(max_tokens=40, **GREEDY)
    kw = dict(device="cuda", num_pages=400)
    want = tokens(run(make_engine(**kw), prompts, params))
    on = make_engine(speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}, **kw)
    assert tokens(run(on, prompts, params)) == want
    graphs, draft, loop = on.runner.verify_graphs, on.proposer.runner.verify_graphs, on.proposer.loop_graphs
    for g in (graphs, draft, loop):
        assert g.disabled is None and g.replays > 3, (type(g).__name__, g.disabled, g.replays)
    drafted, accepted, _ = spec_counts(on)
    assert accepted >= 0.9 * drafted, (accepted, drafted)  # the loop's drafts are (nearly all) the target's picks
    check_slots_used(on, slots)
    on.check_idle()


def test_device_drafts_on_cuda():
    """Plain rows: the draft model's drafts go from its loop graph to the target's verify graph on the device
    (`spec_decode.device_drafts`), read by the host only after the verify step; the outputs are those of
    speculation off (an engine without the tests' recording sampler, which has no device fast path)."""
    from kimiserve.engine.args import EngineArgs
    from kimiserve.engine.engine import LLMEngine
    from kimiserve.engine.spec_decode import device_drafts

    prompts = random_prompts([30, 70, 12], seed=3)
    params = [SamplingParams(max_tokens=40, **GREEDY)] * 2 + [
        SamplingParams(max_tokens=40, seed=5, temperature=0.9, top_k=4, ignore_eos=True)]
    args = dict(model="tiny", dtype="float32", device="cuda", num_pages=400, max_model_len=512)
    want = tokens(run(LLMEngine(EngineArgs(**args)), prompts, params))
    made, rounds = device_drafts.DeviceDrafts.of, []
    device_drafts.DeviceDrafts.of = classmethod(lambda cls, t: (rounds.append(1), made(t))[1])
    try:
        on = LLMEngine(EngineArgs(speculative_config={"method": "draft_model", "model": "tiny",
                                                      "num_speculative_tokens": 3}, **args))
        assert tokens(run(on, prompts, params)) == want
    finally:
        device_drafts.DeviceDrafts.of = made
    assert len(rounds) > 3 and len(rounds) == on.proposer.loop_graphs.replays
    drafted, accepted, _ = spec_counts(on)
    assert accepted >= 0.6 * drafted, (accepted, drafted)
    on.check_idle()
