"""A step that raises fails only the request it comes from; the engine goes on, the other requests
get exactly the tokens they get without the failing one, and no page leaks. Errors that leave the
engine unusable propagate out of `step()`."""

from __future__ import annotations

import pytest

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.engine.errors import EngineFatalError, is_fatal_error
from kimiserve.sampling_params import SamplingParams

PROMPTS = random_prompts([5, 90, 33, 70], seed=11)
PARAMS = [SamplingParams(max_tokens=10, **GREEDY), SamplingParams(max_tokens=12, temperature=0.9, seed=7),
          SamplingParams(max_tokens=8, **GREEDY), SamplingParams(max_tokens=9, temperature=1.0, seed=3, top_p=0.9)]


@pytest.fixture
def engines():
    made = []

    def factory(**kwargs):
        made.append(make_engine("float32", "fp8", **kwargs))
        return made[-1]

    yield factory
    for engine in made:
        engine.check_idle()


def clean_tokens(engines, **kwargs) -> dict[str, list[int]]:
    outs = run(engines(**kwargs), PROMPTS, PARAMS)
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def fail_forward_when(engine, predicate, error=RuntimeError("kernel failed")):
    """Make the runner raise `error` (before the model writes anything) for steps where predicate(chunks)."""
    execute, calls = engine.runner.execute, {"failed": 0}

    def failing(sched):
        if predicate(sched.chunks):
            calls["failed"] += 1
            raise error
        return execute(sched)

    engine.runner.execute = failing
    return calls


def run_with_bad(engine, bad_prompt, bad_params, bad_id="bad"):
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    return run(engine, [*PROMPTS[:2], bad_prompt, *PROMPTS[2:]], [*PARAMS[:2], bad_params, *PARAMS[2:]],
               ids=[*ids[:2], bad_id, *ids[2:]])


@pytest.mark.parametrize("chunked", [False, True])
def test_a_forward_failing_on_one_request_fails_it_alone(engines, chunked):
    """The failure comes from one request's tokens (a kernel that fails on some input): the batch's
    forward fails, the requests are recomputed one at a time, the culprit fails alone and every
    other request gets the same tokens as in a run without it."""
    kwargs = {"max_num_batched_tokens": 40} if chunked else {}
    expected = clean_tokens(engines, **kwargs)
    engine = engines(**kwargs)
    poison = 1000
    calls = fail_forward_when(engine, lambda chunks: any(
        poison in c.request.all_ids[c.request.num_computed:c.request.num_computed + c.num_tokens] for c in chunks))
    outs = run_with_bad(engine, [3, 4, poison, 5], SamplingParams(max_tokens=5))
    bad = outs.pop("bad")
    assert bad.finished and bad.error is not None and "bad" in bad.error and "kernel failed" not in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert {rid: out.outputs[0].token_ids for rid, out in outs.items()} == expected
    assert calls["failed"] >= 2 and engine.stats()["failed_requests"] == 1
    # nothing of the failed request is in the prefix cache: the same prompt fails again, alone
    again = run(engine, [[3, 4, poison, 5]], SamplingParams(max_tokens=2), ids=["again"])["again"]
    assert again.error is not None and engine.stats()["failed_requests"] == 2


def test_a_failure_in_the_middle_of_decoding(engines):
    """The culprit fails only once its sequence reaches 40 tokens, while all four others are decoding:
    they are recomputed (pages freed, prefix recomputed) and finish with unchanged tokens."""
    expected = clean_tokens(engines)
    engine = engines()
    fail_forward_when(engine, lambda chunks: any(
        c.request.request_id == "bad" and c.request.num_computed + c.num_tokens > 40 for c in chunks))
    outs = run_with_bad(engine, list(range(30)), SamplingParams(max_tokens=20, **GREEDY))
    bad = outs.pop("bad")
    assert bad.error is not None and len(bad.outputs[0].token_ids) == 0
    assert {rid: out.outputs[0].token_ids for rid, out in outs.items()} == expected


def test_a_sampler_failure_is_traced_to_its_row(engines):
    """Sampling runs once per batch; when it raises, the rows are sampled one at a time, so only the
    row that fails loses its request and no forward is repeated."""
    expected = clean_tokens(engines)
    engine = engines()
    sampler = engine.runner.sampler

    def picky(logits, requests):
        if any(r.params.seed == 666 for r in requests):
            raise ValueError("cannot sample this row")
        return sampler(logits, requests)

    engine.runner.sampler = picky
    outs = run_with_bad(engine, [1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, seed=666))
    assert outs.pop("bad").error is not None
    assert {rid: out.outputs[0].token_ids for rid, out in outs.items()} == expected
    assert engine.stats()["preemptions"] == 0


def test_a_failing_sample_of_n_fails_its_whole_request(engines):
    expected = clean_tokens(engines)
    engine = engines()
    fail_forward_when(engine, lambda chunks: any(c.request.request_id == "bad" and c.request.sample_index == 2
                                                 and len(c.request.output_ids) >= 3 for c in chunks))
    outs = run_with_bad(engine, [7, 8, 9], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5))
    bad = outs.pop("bad")
    assert bad.error is not None and {c.finish_reason for c in bad.outputs} == {"error"}
    assert {rid: out.outputs[0].token_ids for rid, out in outs.items()} == expected


def test_abort_while_isolating(engines):
    """Aborting requests that are waiting to be recomputed alone frees everything."""
    engine = engines()
    fail_forward_when(engine, lambda chunks: len(chunks) > 1 and engine.num_steps < 4)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # admits all four: the batch fails, they wait to run one at a time
    engine.step()
    for i in range(len(PROMPTS)):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()


def test_errors_that_break_the_engine_are_fatal():
    engine = make_engine("float32", "fp8")  # not checked for leaks: a fatal error ends the engine
    fail_forward_when(engine, lambda chunks: True,
                      RuntimeError("CUDA error: an illegal memory access was encountered"))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()
    assert is_fatal_error(MemoryError()) and is_fatal_error(KeyboardInterrupt())
    assert not is_fatal_error(ValueError("x")) and not is_fatal_error(IndexError("y"))


def test_an_engine_that_fails_every_request_gives_up(engines):
    """Single-request steps that fail three times in a row mean the engine itself is broken."""
    engine = engines()
    fail_forward_when(engine, lambda chunks: True)
    for i in range(5):
        engine.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=3))
    failed = []
    with pytest.raises(EngineFatalError):
        for _ in range(20):
            failed += [o.request_id for o in engine.step() if o.error is not None]
    assert len(failed) == 2  # the first two alone, then the third single failure is fatal
    for i in range(5):
        engine.abort_request(f"r{i}")
