"""Speculative decoding with the KDA verify positions saved in per-position slots (`DecodeOps.kda_verify_steps`,
`ops.backend.kda_verify_slot_ops`; the reference loop on the CPU) and the commit a copy of one slot per chunk
(`spec_decode.verify_slots`): greedy tokens equal speculation off, eager and through (emulated) verify graphs,
for n-gram and draft-model proposers (the draft's catch-up takes the same path), the state bit for bit that of
the per-position path and its replay, and steps past the slots' capacity falling back to that path."""

import pytest
import torch

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.engine.spec_decode import verify_slots
from kimiserve.model.kda import KimiDeltaAttention
from kimiserve.ops.backend import kda_verify_slot_ops
from kimiserve.sampling_params import SamplingParams
from test_spec_decode import FEW, mixed_params, ngram, spec_counts, tokens
from test_verify_graphs import eager_graphs  # noqa: F401  (the fixture)

DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}


def with_slots(engine):
    for runner in (engine.runner, getattr(engine.proposer, "runner", None)):
        if runner is not None:
            runner.ops = kda_verify_slot_ops(runner.ops)
    return engine


@pytest.fixture
def calls(monkeypatch):
    """Counts of slot commits and of per-position replays (`KimiDeltaAttention.replay_verified`)."""
    seen = {"commit": 0, "replay": 0}
    commit, replay = verify_slots.KDAVerifySlots.commit, KimiDeltaAttention.replay_verified

    def counted_commit(self, *a):
        seen["commit"] += 1
        return commit(self, *a)

    def counted_replay(self, *a):
        seen["replay"] += 1
        return replay(self, *a)

    monkeypatch.setattr(verify_slots.KDAVerifySlots, "commit", counted_commit)
    monkeypatch.setattr(KimiDeltaAttention, "replay_verified", counted_replay)
    return seen


@pytest.mark.parametrize("spec", [ngram(3), DRAFT], ids=["ngram", "draft"])
def test_eager_slots_equal_off(spec, calls):
    prompts = random_prompts([20, 57, 9, 33], seed=7)
    params = mixed_params()
    want = tokens(run(make_engine(), prompts, params))
    on = with_slots(make_engine(speculative_config=spec))
    assert on.runner.verify_graphs is None and on.runner.verify_slots.max_chunks >= 4
    assert tokens(run(on, prompts, params)) == want
    drafted, accepted, _ = spec_counts(on)
    assert accepted > 0 and calls["commit"] > 5 and calls["replay"] == 0
    on.check_idle()


def test_graph_slots_state_bit_equal_per_position_path(eager_graphs, calls):  # noqa: F811
    """Step for step, verify graphs on slots and verify graphs position by position (with the replay graph):
    the same tokens and the same KDA state pages, bit for bit."""
    prompts = random_prompts([37, 25, 50], seed=9)
    p = SamplingParams(max_tokens=40, allowed_token_ids=FEW, **GREEDY)
    slots, plain = with_slots(make_engine(speculative_config=ngram(3))), make_engine(speculative_config=ngram(3))
    for e in (slots, plain):
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, p)
    checked = 0
    while slots.has_unfinished_requests():
        slots.step()
        plain.step()
        assert [r.all_ids for r in slots.scheduler.running] == [r.all_ids for r in plain.scheduler.running]
        for a, b in zip(slots.scheduler.running, plain.scheduler.running):
            pa, pb = torch.tensor(a.state_pages), torch.tensor(b.state_pages)
            assert torch.equal(slots.pool.recurrent[pa], plain.pool.recurrent[pb])
            assert torch.equal(slots.pool.conv[pa], plain.pool.conv[pb])
            checked += 1
    graphs = slots.runner.verify_graphs
    assert checked > 10 and graphs.replays > 5 and graphs.uses_slots(4)
    assert not plain.runner.verify_graphs.uses_slots(4) and calls["commit"] > 5
    slots.check_idle()
    plain.check_idle()


def test_draft_model_graphs_on_slots(eager_graphs, calls):  # noqa: F811
    prompts = random_prompts([20, 57, 9], seed=7)
    params = [SamplingParams(max_tokens=40, **GREEDY)] * 3
    want = tokens(run(make_engine(), prompts, params))
    on = with_slots(make_engine(speculative_config=DRAFT))
    assert tokens(run(on, prompts, params)) == want
    draft = on.proposer.runner
    assert on.runner.verify_graphs.replays > 5 and draft.verify_graphs.replays > 5 and draft.verify_graphs.uses_slots(1)
    assert calls["replay"] == 0 and calls["commit"] > 10
    on.check_idle()


def test_steps_past_capacity_run_position_by_position(monkeypatch, calls):
    """Slots for 2 chunks: steps verifying more chunks at once take the per-position path and its replay."""
    monkeypatch.setattr(verify_slots, "max_verify_chunks", lambda max_num_seqs, num_tokens: 2)
    prompts = random_prompts([20, 57, 9, 33], seed=3)
    params = [SamplingParams(max_tokens=30, allowed_token_ids=FEW[:3], **GREEDY)] * 4
    want = tokens(run(make_engine(), prompts, params))
    on = with_slots(make_engine(speculative_config=ngram(3)))
    assert on.runner.verify_slots.max_chunks == 2
    assert tokens(run(on, prompts, params)) == want
    assert calls["commit"] > 0 and calls["replay"] > 0
    on.check_idle()


def test_slot_bytes_bounded():
    from kimiserve.cache.layout import CacheLayout
    from kimiserve.cache.pool import PagePool
    from kimiserve.config import load_preset

    cfg = load_preset("tiny")
    pool = PagePool(CacheLayout.from_config(cfg, "bf16", torch.float32), 4, "cpu")
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    per_chunk = 4 * len(cfg.kda_layers) * (4 * H * K * K + 4 * 3 * H * K * (W - 1))
    slots = verify_slots.KDAVerifySlots(pool, len(cfg.kda_layers), 4, 64)
    assert slots.max_chunks == 64 and slots.nbytes == 64 * per_chunk
    capped = verify_slots.KDAVerifySlots(pool, len(cfg.kda_layers), 4, 64, max_bytes=3 * per_chunk + 1)
    assert capped.max_chunks == 3 and capped.states is None  # nothing allocated before first use
    capped.allocate()
    assert capped.states.nbytes + capped.conv.nbytes == capped.nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the one-launch verify kernel, real CUDA graphs)")
@pytest.mark.parametrize("spec", [ngram(3), DRAFT], ids=["ngram", "draft"])
def test_cuda_graphs_on_slots_equal_off(spec, calls):
    """On CUDA (captured verify graphs, the Triton verify kernel, the commit graph) and eagerly: the tokens of
    speculation off, every commit a slot copy."""
    prompts = random_prompts([20, 57, 9, 33], seed=7)
    params = [SamplingParams(max_tokens=40, allowed_token_ids=FEW, **GREEDY)] * 2 + mixed_params()[:2]
    kw = dict(device="cuda", num_pages=400)
    want = tokens(run(make_engine(**kw), prompts, params))
    for eager in (False, True):
        on = with_slots(make_engine(speculative_config=spec, enforce_eager=eager, **kw))
        from kimiserve.ops.kda import triton_verify

        assert on.runner.ops.kda_verify_steps.func is triton_verify.kda_verify_steps
        assert tokens(run(on, prompts, params)) == want, f"enforce_eager={eager}"
        assert eager or on.runner.verify_graphs.replays > 5
        on.check_idle()
    assert calls["commit"] > 10 and calls["replay"] == 0


def test_graph_capture_mid_serving_writes_reserved_pages_only(eager_graphs):  # noqa: F811
    """Capturing a verify graph (forward and commit on padding rows) while requests hold state pages changes
    no page but the reserved ones."""
    engine = with_slots(make_engine(speculative_config=ngram(3)))
    for i, prompt in enumerate(random_prompts([30, 41], seed=4)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, allowed_token_ids=FEW, **GREEDY))
    for _ in range(6):
        engine.step()
    graphs, pool = engine.runner.verify_graphs, engine.pool
    assert engine.scheduler.running and graphs.uses_slots(8) and (8, 64) not in graphs.graphs
    pool.recurrent[0] = 1.5  # page 0, what an all-zero commit input would hit
    bits = lambda: (pool.recurrent.view(torch.int32).clone(), pool.conv.view(torch.int32).clone())  # noqa: E731
    before = bits()  # as bits: pages holding attention latents read as fp32 may be NaN
    assert graphs._capture(8, 64)
    others = torch.ones(pool.recurrent.shape[0], dtype=torch.bool)
    others[graphs.pad_state_pages] = others[graphs.pad_page] = False  # the reserved pages (padding rows' attention page too)
    after = bits()
    assert torch.equal(after[0][others], before[0][others]) and torch.equal(after[1][others], before[1][others])
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_idle()


def test_graph_slots_preemption_prefix_hits_and_sampling(eager_graphs, calls):  # noqa: F811
    """On slots through verify graphs: a small pool preempts mid-round, a second run hits the prefix cache,
    seeded n = 3 sampling; the tokens of speculation off, no leaks."""
    prompts = random_prompts([40, 70, 33], seed=3)
    params = mixed_params(48)[:2] + [SamplingParams(max_tokens=48, n=3, seed=11, temperature=0.8, top_p=0.9, top_k=5,
                                                    allowed_token_ids=FEW, frequency_penalty=0.3, ignore_eos=True)]
    want = tokens(run(make_engine(), prompts, params))
    small = with_slots(make_engine(num_pages=21, speculative_config=ngram(3)))
    assert tokens(run(small, prompts, params)) == want
    assert small.stats()["preemptions"] > 0 and small.runner.verify_graphs.replays > 0
    small.check_idle()
    engine = with_slots(make_engine(speculative_config=ngram(3)))
    run(engine, [p[:-3] for p in prompts], params)
    assert tokens(run(engine, prompts, params, ids=["r0", "r1", "r2"])) == want
    assert engine.stats()["prefix_hit_tokens"] > 0 and calls["commit"] > 5 and calls["replay"] == 0
    engine.check_idle()
