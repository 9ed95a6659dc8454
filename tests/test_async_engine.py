"""AsyncLLMEngine (the engine thread + asyncio handoff) and the app's behaviour when the engine dies."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.testclient import TestClient

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, OutputOverflowError, OutputSink
from kimiserve.entrypoints.openai.api_server import build_app
from kimiserve.entrypoints.openai.server_args import ServerArgs
from kimiserve.sampling_params import SamplingParams

ARGS = dict(model="tiny", max_model_len=256, num_pages=200)


def make_engine() -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(EngineArgs(**ARGS))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_generate_streams_and_matches_the_offline_engine():
    from kimiserve import LLM

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(**ARGS).generate(["Hello", "Kimi"], params, use_tqdm=False)

    async def main():
        engine = make_engine()
        engine.start()

        async def one(rid, prompt):
            deltas, last = [], None
            async for out in engine.generate(rid, prompt, params):
                deltas += out.outputs[0].delta_token_ids
                last = out
            return deltas, last

        results = await asyncio.gather(one("a", "Hello"), one("b", "Kimi"))
        await engine.shutdown()
        engine.engine.check_idle()
        return results

    for (deltas, last), exp in zip(run(main()), expected):
        # DELTA outputs: each holds only the new tokens, and together they are the offline result
        assert last.finished and deltas == exp.outputs[0].token_ids
        assert last.outputs[0].token_ids == last.outputs[0].delta_token_ids


def test_closing_the_consumer_aborts_and_frees_pages():
    async def main():
        engine = make_engine()
        engine.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        gen, seen = engine.generate("long", "Hello there", params), 0
        async for out in gen:
            seen += len(out.outputs[0].token_ids)
            if seen >= 3:
                break
        await gen.aclose()  # what a client disconnect does to the stream
        # a consumer cancelled while waiting also aborts
        task = asyncio.ensure_future(_drain(engine.generate("cancelled", "Hi", params)))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.sleep(0.3)
        stats = engine.stats()
        await engine.shutdown()
        return stats, engine

    stats, engine = run(main())
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["pages_used"] == stats["pages_cached"]
    engine.engine.check_idle()


async def _drain(gen):
    async for _ in gen:
        pass


def test_a_consumer_that_stops_reading_does_not_stall_the_others():
    async def main():
        engine = make_engine()
        engine.start()
        stalled = engine.generate("stalled", "Hello", SamplingParams(max_tokens=60, ignore_eos=True))
        await stalled.__anext__()  # reads one output, then nothing while the other request runs
        out, read = None, 0
        async for out in engine.generate("reader", "Kimi", SamplingParams(max_tokens=20, ignore_eos=True)):
            read += len(out.outputs[0].token_ids)
        for _ in range(100):  # the stalled request keeps running to its end without its reader
            if engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.05)
        finished_unread = engine.stats()["running"] == 0
        rest = [o async for o in stalled]  # everything it made was kept for it
        await engine.shutdown()
        return out, read, finished_unread, rest

    out, read, finished_unread, rest = run(main())
    assert out.finished and read == 20
    assert finished_unread and rest[-1].finished and sum(len(o.outputs[0].token_ids) for o in rest) == 59


def test_bad_request_raises_value_error_and_leaves_nothing():
    async def main():
        engine = make_engine()
        engine.start()
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("x", list(range(1, 300)), SamplingParams(), OutputSink())
        with pytest.raises(ValueError, match="already in use"):
            sink = OutputSink()
            await engine.add_request("dup", "a", SamplingParams(max_tokens=50), sink)
            await engine.add_request("dup", "b", SamplingParams(), sink)
        engine.abort("dup")
        await asyncio.sleep(0.2)
        await engine.shutdown()
        return engine

    run(main()).engine.check_idle()


def test_engine_thread_sleeps_when_idle():
    async def main():
        engine = make_engine()
        calls = {"n": 0}
        original = engine.engine.has_unfinished_requests

        def counted():
            calls["n"] += 1
            return original()

        engine.engine.has_unfinished_requests = counted
        engine.start()
        await _drain(engine.generate("a", "Hi", SamplingParams(max_tokens=3)))
        await asyncio.sleep(0.1)
        idle_from = calls["n"]
        await asyncio.sleep(0.5)
        idle_calls = calls["n"] - idle_from
        await engine.shutdown()
        return idle_calls, engine

    idle_calls, engine = run(main())
    assert idle_calls == 0  # waiting on the condition variable, not polling
    assert not engine._thread.is_alive()


def engine_failing_at_step(n: int):
    """An engine whose n-th step raises RuntimeError("boom")."""
    engine = make_engine()
    original, steps = engine.engine.step, {"n": 0}

    def failing():
        steps["n"] += 1
        if steps["n"] == n:
            raise RuntimeError("boom")
        return original()

    engine.engine.step = failing
    return engine


def test_a_failing_step_kills_the_engine_and_tells_every_consumer():
    async def main():
        engine = engine_failing_at_step(3)
        engine.start()
        with pytest.raises(EngineDeadError, match="restarting") as info:
            await _drain(engine.generate("a", "Hi", SamplingParams(max_tokens=50, ignore_eos=True)))
        assert "boom" not in str(info.value)  # clients never see internal exception text
        assert engine.errored and isinstance(engine.dead_error, RuntimeError) and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "Hi", SamplingParams(), OutputSink())
        await engine.shutdown()

    run(main())


def test_app_reports_a_dead_engine_as_503_and_in_stream():
    engine = engine_failing_at_step(3)
    with TestClient(build_app(engine, ServerArgs())) as client:
        assert client.get("/health").status_code == 200
        with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "ignore_eos": True,
                                                             "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and "boom" not in error["message"]
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "boom" not in r.text and "boom" not in client.get("/health").text
        assert client.get("/metrics").status_code == 200
    assert not any(t.name == "kimiserve-engine" and t.is_alive() for t in threading.enumerate())


def test_apps_have_their_own_registries():
    a, b = build_app(make_engine()), build_app(make_engine())
    assert a.state.metrics.registry is not b.state.metrics.registry
    with TestClient(a) as ca, TestClient(b) as cb:
        assert ca.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).status_code == 200
        text_a, text_b = ca.get("/metrics").text, cb.get("/metrics").text
    assert 'kimiserve:generation_tokens_total{model_name="tiny"} 3.0' in text_a
    assert 'kimiserve:generation_tokens_total{model_name="tiny"} 0.0' in text_b


def test_a_failing_request_fails_alone_and_the_engine_goes_on():
    """A step error traced to one request (here its detokenizer raises) reaches that request's
    consumer as RequestFailedError (no internal text); the other request finishes and the engine
    keeps serving."""
    from kimiserve.engine.async_engine import RequestFailedError

    async def main():
        engine = make_engine()
        original = engine.engine._attach_detokenizer

        def attach(request):
            original(request)
            if request.request_id == "bad":
                def add(token_id):
                    raise KeyError("detokenizer broke")
                request.detokenizer.add = add

        engine.engine._attach_detokenizer = attach
        engine.start()
        params = SamplingParams(max_tokens=8, ignore_eos=True)

        async def one(rid):
            tokens = 0
            async for out in engine.generate(rid, "Hello", params):
                tokens += len(out.outputs[0].token_ids)
            return tokens

        good, bad = await asyncio.gather(one("good"), one("bad"), return_exceptions=True)
        after = await one("after")
        stats = engine.stats()
        await engine.shutdown()
        return good, bad, after, stats, engine

    good, bad, after, stats, engine = run(main())
    assert good == 8 and after == 8
    assert isinstance(bad, RequestFailedError) and "detokenizer broke" not in str(bad) and "bad" in str(bad)
    assert stats["failed_requests"] == 1 and not engine.errored
    engine.engine.check_idle()


def test_a_fatal_step_error_runs_the_dead_callbacks():
    async def main():
        engine = engine_failing_at_step(2)
        called = asyncio.Event()
        engine.add_dead_callback(called.set)
        engine.start()
        with pytest.raises(EngineDeadError):
            await _drain(engine.generate("a", "Hi", SamplingParams(max_tokens=50, ignore_eos=True)))
        await asyncio.wait_for(called.wait(), 5)
        await engine.shutdown()

    run(main())


def test_a_sink_over_its_bound_aborts_its_request_and_frees_its_pages():
    """An unread sink holds at most max_bytes: past it the request is aborted (pages freed), what was
    queued is dropped, and the consumer's next read is an OutputOverflowError."""
    async def main():
        engine = make_engine()
        engine.start()
        aborted = []
        sink = OutputSink(max_bytes=4000, on_overflow=lambda: (aborted.append(1), engine.abort("unread")))
        await engine.add_request("unread", "Hello", SamplingParams(max_tokens=200, ignore_eos=True, logprobs=5), sink)
        for _ in range(200):
            if sink.overflowed and engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.02)
        stats, queued, pending = engine.stats(), sink.qsize(), sink.pending_bytes
        item = await sink.get()
        await engine.shutdown()
        return stats, queued, pending, aborted, item, engine

    stats, queued, pending, aborted, item, engine = run(main())
    assert isinstance(item, OutputOverflowError) and "did not read" in str(item)
    assert aborted == [1] and queued == 1 and pending == 0
    assert stats["running"] == 0 and stats["pages_used"] == stats["pages_cached"]
    engine.engine.check_idle()
