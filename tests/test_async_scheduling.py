"""Async scheduling (`EngineArgs.async_scheduling`): a plain decode step is launched while the step
before it runs, its tokens fed from the device. On the CPU the "device" is the host, so nothing
overlaps in time, but the bookkeeping is the same: the overlapped loop must give token for token what
the synchronous one gives (stops, max_tokens, aborts, n > 1, preemption, requests arriving late,
steps that cannot overlap), fail requests alone, and leak no page."""

from __future__ import annotations

import pytest
import torch

from engine_utils import random_prompts
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.engine.outputs import RequestOutputKind
from kimiserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fixed_threads  # each test compares the overlapped loop with the synchronous one in one
# process: the same batches at the same thread count on both sides, so the 2-thread pass would assert nothing new

MIXED = [
    SamplingParams(max_tokens=20, temperature=0),
    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.8, seed=5),
    SamplingParams(max_tokens=25, temperature=1.0, seed=9, n=3),
    SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[5, 17, 100, 200, 300, 400, 500, 600, 700]),
    SamplingParams(max_tokens=33, temperature=0.7, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
]


def engine(async_scheduling: bool, **kwargs) -> LLMEngine:
    kwargs = {"max_model_len": 512, "num_pages": 200, **kwargs}
    return LLMEngine(EngineArgs(model="tiny", dtype="float32", kv_cache_dtype="bf16",
                                async_scheduling=async_scheduling, **kwargs))


def drive(e: LLMEngine, prompts, params, events=None, max_steps=2000) -> dict:
    """Step to the end; events: {step number: callable(engine)} run before that step. Returns
    {request id: [(token ids, finish reason, stop reason) per sample]}."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        e.add_request(f"r{i}", prompt, p)
    outs, steps = {}, 0
    while e.has_unfinished_requests() and steps < max_steps:
        steps += 1
        if events and steps in events:
            events[steps](e)
        for out in e.step():
            if out.finished:
                outs[out.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
    assert not e.has_unfinished_requests()
    e.check_idle()
    return outs


def both(prompts, params, events=None, **kwargs):
    sync, overlapped = engine(False, **kwargs), engine(True, **kwargs)
    a = drive(sync, prompts, params, events)
    b = drive(overlapped, prompts, params, events)
    assert sync.stats()["overlapped_steps"] == 0
    return a, b, overlapped


EVENTS = {
    6: lambda e: e.add_request("late", [1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0)),
    9: lambda e: e.abort_request("r0"),
    14: lambda e: e.add_request("late2", [9, 8, 7], SamplingParams(max_tokens=9, temperature=0.5, seed=2, n=2)),
}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_overlapped_steps_give_the_same_tokens(prefix_caching):
    prompts = random_prompts([10 + 7 * i for i in range(len(MIXED))], seed=3)
    a, b, e = both(prompts, MIXED, EVENTS, enable_prefix_caching=prefix_caching)
    assert a == b
    assert "r0" not in a and {"late", "late2", "r3"} <= set(a) and len(a["r3"]) == 3
    assert {reason for samples in a.values() for _, reason, _ in samples} == {"stop", "length"}
    assert e.stats()["overlapped_steps"] >= 15


def test_overlapped_steps_under_preemption():
    """A pool too small for every request: preemptions and recomputation; the same tokens, no leak."""
    prompts = random_prompts([40, 70, 25, 60, 33, 50], seed=5)
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * 3 + MIXED[2:5]
    a, b, e = both(prompts, params, num_pages=24, max_num_seqs=6)
    assert a == b
    assert e.stats()["preemptions"] >= 1 and e.stats()["overlapped_steps"] >= 10


def test_steps_that_need_the_host_run_synchronously():
    """Rows with logprobs, or with min_tokens still banning stop tokens, need the host: their batches do not
    overlap; once the last such row is gone the batch overlaps."""
    prompts = random_prompts([12, 20, 9], seed=8)
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, min_tokens=10, stop_token_ids=[3])]
    a, b, e = both(prompts, params)
    assert a == b
    # overlap only once the logprobs request (8 tokens) is done and the min_tokens one has its 10 tokens
    assert 0 < e.stats()["overlapped_steps"] <= 30 - 10


def test_a_stop_while_the_next_row_runs_keeps_no_stale_snapshot():
    """A request ending on a stop token while its next row is in flight keeps no prefix-cache snapshot of
    its state (the row moved it past the cached tokens): a follow-up prompt extending its output gets
    the tokens the synchronous engine gives it."""
    prompt = random_prompts([30], seed=21)[0]
    first = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=list(range(0, 1024, 9)))
    results = []
    for async_on in (False, True):
        e = engine(async_on)
        out = drive(e, [prompt], [first])["r0"][0]
        assert out[1] == "stop" and len(out[0]) > 2, out
        follow = prompt + out[0] + [11, 12]
        results.append((out, drive(e, [follow], [SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)])))
    assert results[0] == results[1]


def test_guided_and_stop_string_requests_among_overlapped_ones():
    """A grammar (compiled on its thread, then sampled under its mask: never overlapped) and stop strings
    (found by the detokenizer after the step) beside plain requests: the same tokens and texts."""
    pytest.importorskip("llguidance", reason="guided decoding needs llguidance (the guided / test extras)")
    from kimiserve.structured_output import StructuredOutputsParams as Spec

    prompts = random_prompts([14, 9, 21, 30], seed=17)
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=Spec(regex=r"[0-9]{3}-[a-z]{2,4}")),
              SamplingParams(max_tokens=40, temperature=0, stop=["e", "a"], ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, stop=[" t"], include_stop_str_in_output=True),
              SamplingParams(max_tokens=35, temperature=0, ignore_eos=True)]
    texts = []
    for async_on in (False, True):
        e = engine(async_on)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            e.add_request(f"r{i}", prompt, p)
        done = {}
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
        e.check_idle()
        texts.append(done)
        assert (e.stats()["overlapped_steps"] > 0) is async_on
    assert texts[0] == texts[1] and len(texts[0]) == 4


def test_aborting_everything_while_a_step_runs():
    """Every request aborted while a step is in flight: the next step() schedules what came after."""
    e = engine(True)
    prompts = random_prompts([8, 9], seed=2)
    for i, prompt in enumerate(prompts):
        e.add_request(f"a{i}", prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(6):
        e.step()
    assert e._in_flight is not None
    for i in range(2):
        e.abort_request(f"a{i}")
    assert not e.has_unfinished_requests()
    before = e.num_steps
    expected = drive(engine(False), [prompts[0]], [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    outs = drive(e, [prompts[0]], [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert outs == expected and e.num_steps > before


def test_a_failing_overlapped_step_fails_its_request_alone():
    prompts = random_prompts([5, 40, 33], seed=11)
    params = [SamplingParams(max_tokens=25, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=0, ignore_eos=True)]
    expected = drive(engine(True), prompts, params)
    e = engine(True)
    forward, failed = e.runner.forward, []
    bad = list(range(30))

    def failing(step):  # a kernel failing on request "bad" past 40 tokens, before writing anything
        culprit = next((r for r in e.scheduler.running if r.request_id == "bad"), None)
        if culprit is not None and any(c.state_pages == culprit.state_pages and c.context_start + c.end - c.start > 40
                                       for c in step.chunks):
            failed.append(len(step.chunks))
            raise RuntimeError("kernel failed")
        return forward(step)

    e.runner.forward = failing
    e.add_request("bad", bad, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    outs = drive(e, prompts, params)
    assert failed and failed[0] > 1  # it failed inside a batch, then alone
    assert outs.pop("bad")[0][1] == "error"
    assert outs == expected
    assert e.stats()["failed_requests"] == 1


def test_the_default_and_its_checks():
    assert not EngineArgs(model="tiny", device="cpu").resolved_async_scheduling(torch.device("cpu"))
    assert EngineArgs(model="tiny", async_scheduling=True).resolved_async_scheduling(torch.device("cpu"))
    with pytest.raises(ValueError, match="async_scheduling runs on one rank"):
        EngineArgs(model="tiny", device="cpu", async_scheduling=True, tensor_parallel_size=2).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_cuda_graph_steps_give_the_same_tokens():
    """On CUDA (the default there) with CUDA graphs: the same tokens as the synchronous engine."""
    prompts = random_prompts([10 + 7 * i for i in range(len(MIXED))], seed=3)
    outs = []
    for async_on in (False, True):
        e = LLMEngine(EngineArgs(model="tiny", device="cuda", dtype="float32", kv_cache_dtype="bf16",
                                 max_model_len=512, num_pages=200, async_scheduling=async_on))
        assert e.async_scheduling is async_on and e.runner.graphs is not None
        outs.append(drive(e, prompts, MIXED, EVENTS))
        assert (e.stats()["overlapped_steps"] >= 15) is async_on and e.runner.graphs.replays > 0
    assert outs[0] == outs[1]
    assert LLMEngine(EngineArgs(model="tiny", device="cuda", max_model_len=256, num_pages=40)).async_scheduling


@pytest.mark.parametrize("num_pages", [200, 24])
def test_reused_sampling_rows_equal_rebuilt_ones(num_pages):
    """`plain_sample_requests` hands the same requests' rows of the step before back (a persistent batch's
    sampling rows); at every call they equal rows built afresh, and the step gives the synchronous tokens
    (24 pages: the pool runs short, so steps that could not launch ahead run synchronously in between)."""
    e = engine(True, num_pages=num_pages, max_num_seqs=6)
    runner, original = e.runner, e.runner.plain_sample_requests
    reused = []

    def checking(requests, pending):
        before = runner._plain_rows
        rows = original(requests, pending)
        runner._plain_rows = None
        fresh = original(requests, pending)
        runner._plain_rows = (pending, rows) if rows is not None else before
        assert (rows is None) == (fresh is None)
        if rows is not None:
            assert rows == fresh and all(a.output_ids is b.output_ids for a, b in zip(rows, fresh))
            reused.append(before is not None and rows is before[1])
            other = original(requests, 1 - pending)  # the same requests with the other pending count
            runner._plain_rows = None
            assert other == original(requests, 1 - pending)
            runner._plain_rows = (pending, rows)
        return rows

    runner.plain_sample_requests = checking
    params = MIXED + [SamplingParams(max_tokens=15, temperature=0.9, seed=3, min_tokens=6, stop_token_ids=[7])]
    prompts = random_prompts([5, 9, 14, 3, 21, 8, 11], seed=4)
    got = drive(e, prompts, params, EVENTS)
    assert any(reused) and not all(reused)
    assert got == drive(engine(False, num_pages=num_pages, max_num_seqs=6), prompts, params, EVENTS)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_reports_once_what_cumulative_ends_with(async_scheduling):
    """RequestOutputKind.FINAL_ONLY (`LLM.generate`'s kind): no output while a request runs, then one holding
    what a CUMULATIVE request's last output holds: the same text, tokens, logprobs and reasons, for n > 1,
    stop strings and logprobs too, and no output at all for a request aborted on the way."""
    params = MIXED + [SamplingParams(max_tokens=16, temperature=0, logprobs=2),
                      SamplingParams(max_tokens=40, temperature=0, stop=["e", "a"], ignore_eos=True)]
    prompts = random_prompts([9 + 5 * i for i in range(len(params))], seed=11)

    def run(kind: RequestOutputKind) -> tuple[dict, dict]:
        e = engine(async_scheduling)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            e.add_request(f"r{i}", prompt, p, kind)
        last, counts, steps = {}, {}, 0
        while e.has_unfinished_requests() and steps < 2000:
            steps += 1
            if steps == 4:
                e.abort_request("r1")
            for out in e.step():
                counts[out.request_id] = counts.get(out.request_id, 0) + 1
                last[out.request_id] = out
        e.check_idle()
        if async_scheduling:
            assert e.stats()["overlapped_steps"] >= 10
        return {k: (o.finished, [(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                                 for c in o.outputs]) for k, o in last.items()}, counts

    cumulative, cumulative_counts = run(RequestOutputKind.CUMULATIVE)
    final, final_counts = run(RequestOutputKind.FINAL_ONLY)
    assert "r1" not in final and set(final) == set(cumulative) - {"r1"}
    assert all(count == 1 for count in final_counts.values()) and max(cumulative_counts.values()) > 10
    assert final == {k: v for k, v in cumulative.items() if k != "r1"}
    assert all(done and any(text for text, *_ in samples) for done, samples in final.values())
