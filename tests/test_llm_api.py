"""The offline API (kimiserve.LLM) on the tiny model: prompts in every form, stopping, sampling,
chat, streaming, logprobs, validation. After every test the engine must be idle with no pages held."""

import re

import pytest

from kimiserve import LLM, EngineArgs, SamplingParams
from kimiserve.utils.progress import ProgressBar

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_model_len=512, num_pages=96)


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        engine.check_idle()


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_top_level_exports():
    import kimiserve

    assert kimiserve.LLM is LLM and kimiserve.SamplingParams is SamplingParams and kimiserve.EngineArgs is EngineArgs
    with pytest.raises(AttributeError):
        kimiserve.nope


def test_generate_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["Hello, Kimi", "The quick brown fox", "x"]
    batch = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in batch] == prompts
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert texts(batch) == texts(singles) and all(texts(batch))
    assert all(o.finished and o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12
               for o in batch)
    ids = [tok.encode(p) for p in prompts]
    one = llm.generate(ids[1], GREEDY, use_tqdm=False)  # a list of ints is one tokenized prompt
    assert len(one) == 1 and one[0].prompt_token_ids == ids[1] and one[0].outputs[0].text == batch[1].outputs[0].text
    many = llm.generate(ids[::-1], GREEDY, use_tqdm=False)  # order follows the input
    assert [o.prompt_token_ids for o in many] == ids[::-1] and texts(many) == texts(batch)[::-1]
    assert len({o.request_id for o in batch + many}) == 6
    assert llm.generate([], GREEDY) == []


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=3),
                                     SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]


def ascii_stop(text: str) -> str:
    """A run of 2-3 ASCII letters in `text`, not at its start, so a stop on it must fire mid-way."""
    match = re.search(r"[A-Za-z]{2,3}", text[1:])
    assert match, f"no ASCII letters in {text!r}"
    return match.group()


def test_stop_strings(llm):
    free = llm.generate("Hello, Kimi", SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    stop = ascii_stop(free.text)
    cut = free.text.index(stop)
    out = llm.generate("Hello, Kimi", SamplingParams(temperature=0, max_tokens=32, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == free.text[:cut]
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < 32
    kept = llm.generate("Hello, Kimi", SamplingParams(temperature=0, max_tokens=32, stop=stop,
                                                      include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == free.text[: cut + len(stop)]


def test_stop_token_ids(llm):
    free = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[k]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == ids[k] and out.token_ids == ids[: k + 1]


def test_n_samples_are_seeded(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    a = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert sorted(c.index for c in a.outputs) == [0, 1, 2]
    by_index = lambda out: {c.index: c.token_ids for c in out.outputs}  # noqa: E731
    assert by_index(a) == by_index(b)
    assert len({tuple(t) for t in by_index(a).values()}) > 1


def test_seed_reproducible_and_distinct(llm):
    def run(seed):
        return llm.generate("x", SamplingParams(temperature=1.0, seed=seed, max_tokens=8), use_tqdm=False)[0]

    assert run(3).outputs[0].token_ids == run(3).outputs[0].token_ids
    assert len({tuple(run(s).outputs[0].token_ids) for s in (1, 2, 3)}) > 1


def test_chat_one_and_many_conversations(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    one = llm.chat(conv, GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == tok.apply_chat_template(conv, tokenize=True)
    assert one[0].outputs[0].finish_reason in ("length", "stop")
    convs = [conv, [{"role": "user", "content": "What is 2+2?"}]]
    two = llm.chat(convs, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in two] == [tok.apply_chat_template(c, tokenize=True) for c in convs]
    assert two[0].outputs[0].text == one[0].outputs[0].text
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = llm.chat(conv, GREEDY, tools=tools, use_tqdm=False)
    assert "get_weather" in with_tools[0].prompt
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        llm.chat([{"content": "no role"}], GREEDY)


def test_stream_deltas_add_up(llm):
    prompts = ["Hello, Kimi", "x"]
    params = SamplingParams(temperature=0, max_tokens=10, n=2)
    final = {o.request_id: o for o in llm.generate(prompts, params, use_tqdm=False)}
    text: dict = {}
    ids: dict = {}
    last = {}
    for out in llm.stream(prompts, params):
        for c in out.outputs:
            key = (out.prompt, c.index)
            text[key] = text.get(key, "") + c.delta_text
            ids[key] = ids.get(key, []) + c.delta_token_ids
        last[out.prompt] = out
    assert all(o.finished for o in last.values())
    for prompt, out in last.items():
        for c in out.outputs:
            assert text[prompt, c.index] == c.text and ids[prompt, c.index] == c.token_ids
    assert sorted(texts(final.values())) == sorted(o.outputs[0].text for o in last.values())


def test_generate_with_async_scheduling_ends_as_a_stream_does():
    """generate() asks for one output a request, at its end. With async scheduling, a step that reads a launched
    step's tokens and cannot launch the next (here: no page for it without preempting) reports nothing and
    schedules nothing, and must not read as a stalled engine."""
    llm = LLM("tiny", max_model_len=512, num_pages=30, async_scheduling=True)
    prompts = [[1 + i] * (60 + 30 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    generated = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["preemptions"] >= 1 and llm.engine.stats()["overlapped_steps"] >= 20
    streamed = {}
    for out in llm.stream(prompts, params):
        streamed[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in generated] == [streamed[tuple(p)] for p in prompts]
    assert all(len(o.outputs[0].token_ids) == 60 and o.outputs[0].text for o in generated)
    llm.engine.check_idle()


def test_closing_a_stream_early_aborts(llm):
    stream = llm.stream(["Hello", "again"], SamplingParams(temperature=0, max_tokens=200))
    first = next(stream)
    assert not first.finished and llm.engine.has_unfinished_requests()
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_idle()
    for out in llm.stream("Hello", SamplingParams(temperature=0, max_tokens=200)):
        break  # a for loop left early: the generator is closed when dropped
    assert not llm.engine.has_unfinished_requests()


def test_open_stream_blocks_another_call(llm):
    stream = llm.stream("Hello", SamplingParams(max_tokens=50))
    next(stream)
    with pytest.raises(RuntimeError, match="earlier call"):
        llm.generate("x", GREEDY)
    stream.close()


def test_logprobs(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and len(lp.top) == 3 and lp.logprob <= 0
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])  # greedy takes the best
        assert lp.rank == 1 and [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)
    plain = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def test_prompt_logprobs(llm):
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for token, lp in zip(ids[1:], out.prompt_logprobs[1:]):
        assert lp.token_id == token and len(lp.top) == 2 and lp.logprob <= 0


def test_progress_bar(llm, capsys):
    llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=4))
    err = capsys.readouterr().err
    assert "generate: 3/3 requests" in err and "tok/s out" in err and err.endswith("\n") and "\r" in err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    llm.generate(["a"], GREEDY)
    assert capsys.readouterr().err == ""


def test_progress_bar_throttles(capsys):
    bar = ProgressBar(100, min_interval=60)
    for _ in range(100):
        bar.update(done=1, tokens=3)
    bar.close()
    bar.close()
    err = capsys.readouterr().err
    assert err.count("\r") == 2 and err.count("\n") == 1 and err.endswith("\n")  # first and last state only
    assert re.fullmatch(r"generate: 100/100 requests, \d+ tok/s out", err.split("\r")[-1].rstrip())
    ProgressBar(1).update(done=1)
    ProgressBar(5, enabled=False).close()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("prompt, params, match", [
    ([5] * 600, GREEDY, "max_model_len"),
    ("", GREEDY, "prompt is empty"),
    ([1024], GREEDY, "token ids"),
    ([3, -1], GREEDY, "token ids"),
    (["ok", 7], GREEDY, r"prompts\[1\]"),
    (["ok", "ok"], [GREEDY], "sampling_params"),
    ("ok", {"temperature": 0}, "sampling_params"),
    ("ok", SamplingParams(n=1000, max_tokens=2), "max_num_seqs"),
    ("ok", SamplingParams(stop_token_ids=[5000]), "stop_token_ids"),
])
def test_bad_requests_raise_and_leave_nothing(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)
    with pytest.raises(ValueError, match=match):
        list(llm.stream(prompt, params))


def test_a_bad_prompt_late_in_a_batch_aborts_the_earlier_ones(llm):
    with pytest.raises(ValueError, match="prompt 2: .*max_model_len"):
        llm.generate(["fine", "also fine", [5] * 600], GREEDY)
    assert not llm.engine.groups  # the first two were added, then aborted


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n must"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=5), "stop"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate("ok", SamplingParams(**kwargs))  # refused when built, before the engine sees it


def test_unknown_llm_argument():
    with pytest.raises(ValueError, match=r"max_model_length.*max_model_len"):
        LLM("tiny", max_model_length=512)


def test_chat_needs_a_tokenizer(llm, monkeypatch):
    monkeypatch.setattr(llm.engine, "tokenizer", None)  # as for the presets other than tiny
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
