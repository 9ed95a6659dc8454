"""`kimiserve serve` end to end: a real server process, the official openai client and raw httpx."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from server_utils import LIGHT_SERVER, metrics, running_server, wait_until

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello, Kimi"}]


@pytest.fixture(scope="module")
def server():
    with running_server(*LIGHT_SERVER, "--served-model-name", "kimi-tiny", "tiny-alias") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == 256
    return data["tokens"]


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of a stream, then the literal '[DONE]'."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# plain endpoints ----------------------------------------------------------------------------------
def test_health_version_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == ["kimi-tiny", "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, Kimi! 你好 🙂"
    tokens = tokenize(server, prompt=text)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    chat_tokens = tokenize(server, messages=MESSAGES)
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": chat_tokens}).json()["prompt"]
    assert rendered.endswith("<|im_user|>user<|im_middle|>Hello, Kimi<|im_end|><|im_assistant|>assistant<|im_middle|>")
    strs = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(tokens)


# completions --------------------------------------------------------------------------------------
def test_completion_usage_matches_tokenize_and_served_name(server, client):
    out = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "kimi-tiny"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    # the default model (no name given) is the first served name
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "kimi-tiny"


def test_completion_stream_equals_non_stream_and_include_usage(client):
    kwargs = dict(model="kimi-tiny", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_prompt_shapes_and_n(server, client):
    ids = tokenize(server, prompt=PROMPT)
    by_text = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model="kimi-tiny", prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    # two prompts (one as ids) x n=2: choices i*n + j, prompt tokens summed
    out = client.completions.create(model="kimi-tiny", prompt=[ids, ids[:2]], n=2, max_tokens=4, seed=3,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len(ids) + 2 and out.usage.completion_tokens == 16
    many = client.completions.create(model="kimi-tiny", prompt=["a b", "c d", "e f"], max_tokens=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    # streaming n=3: every choice index streams and finishes once
    finishes = {}
    for chunk in client.completions.create(model="kimi-tiny", prompt=PROMPT, n=3, max_tokens=4, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.finish_reason:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_seed_determinism(client):
    kwargs = dict(model="kimi-tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    c = client.completions.create(seed=99, **kwargs).choices[0].text
    assert a == b and a != c
    chat = dict(model="kimi-tiny", messages=MESSAGES, max_tokens=8, temperature=1.0)
    x = client.chat.completions.create(seed=7, **chat).choices[0].message.content
    assert x == client.chat.completions.create(seed=7, **chat).choices[0].message.content


def test_completion_logprobs(client):
    out = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    echo = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                     logprobs=1)
    assert echo.choices[0].text.startswith(PROMPT)
    assert echo.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has none


def test_prompt_logprobs(server, client):
    ids = tokenize(server, prompt=PROMPT)
    out = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:]):
        assert str(token) in entry and len(entry) in (2, 3)  # the prompt token plus the 2 best
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]


def test_stop_strings(client):
    base = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop
    cut = base.find(stop)
    out = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.text == base[:cut] and out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop
    kept = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == base[:cut + len(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="kimi-tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == base[:cut]


# chat ---------------------------------------------------------------------------------------------
def test_chat_non_stream_and_usage(server, client):
    out = client.chat.completions.create(model="tiny-alias", messages=MESSAGES, max_completion_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == "tiny-alias"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and choice.message.tool_calls in (None, [])
    assert out.usage.prompt_tokens == len(tokenize(server, messages=MESSAGES))
    assert out.usage.completion_tokens == 6


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model="kimi-tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(stream=True, n=2, **kwargs):  # greedy: both samples alike
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: full, 1: full} and finishes == {0: "length", 1: "length"}


def test_chat_logprobs_n_and_penalties(client):
    out = client.chat.completions.create(model="kimi-tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes is not None
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
    many = client.chat.completions.create(
        model="kimi-tiny", messages=MESSAGES, max_tokens=4, n=3, temperature=0.9, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=5, extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1,
                                                   "min_tokens": 2, "ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 12
    stream_lp = [c for c in client.chat.completions.create(
        model="kimi-tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
        stream=True, extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert sum(len(c.choices[0].logprobs.content) for c in stream_lp) == 4


def test_chat_stop_token_ids_and_special_tokens(server, client):
    eos = tokenize(server, prompt="<|im_end|>")
    assert len(eos) == 1
    out = client.chat.completions.create(model="kimi-tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                         extra_body={"skip_special_tokens": False, "ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    # a stop token id: the first generated token, found greedily
    first = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first_id = tokenize(server, prompt=first.choices[0].logprobs.tokens[0])
    if len(first_id) == 1:
        stopped = client.completions.create(model="kimi-tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                            extra_body={"stop_token_ids": first_id})
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
        assert stopped.choices[0].model_extra["stop_reason"] == first_id[0]


# metrics, disconnects -----------------------------------------------------------------------------
def test_metrics_count_what_clients_received(server, client):
    before = metrics(server.url)
    seen_prompt = seen_gen = 0
    for i in range(3):
        out = client.completions.create(model="kimi-tiny", prompt=f"{PROMPT} {i}", max_tokens=3 + i)
        seen_prompt += out.usage.prompt_tokens
        seen_gen += out.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="kimi-tiny", messages=MESSAGES, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    seen_prompt += chunks[-1].usage.prompt_tokens
    seen_gen += chunks[-1].usage.completion_tokens
    after = metrics(server.url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kimiserve:prompt_tokens_total") == seen_prompt
    assert delta("kimiserve:generation_tokens_total") == seen_gen
    assert delta("kimiserve:request_success_total{finished_reason=\"stop\"}") + \
        delta("kimiserve:request_success_total{finished_reason=\"length\"}") == 4
    assert delta("kimiserve:e2e_request_latency_seconds_count") == 4
    assert delta("kimiserve:time_to_first_token_seconds_count") == 4
    assert delta("kimiserve:inter_token_latency_seconds_count") == seen_gen - 4
    assert after["kimiserve:num_requests_running"] == 0 and after["kimiserve:cache_pages_used_by_requests"] == 0
    assert after["kimiserve:cache_pages_total"] == 3000
    assert 0 <= after["kimiserve:prefix_cache_hit_rate"] <= 1


def _idle(url):
    m = metrics(url)
    ok = (m["kimiserve:num_requests_running"] == 0 and m["kimiserve:num_requests_waiting"] == 0
          and m["kimiserve:cache_pages_used_by_requests"] == 0)
    return m if ok else None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disconnect_mid_stream_frees_pages(server, endpoint):
    before = metrics(server.url)
    body = {"model": "kimi-tiny", "max_tokens": 150, "ignore_eos": True, "stream": True}
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    else:
        path, body["prompt"] = "/v1/completions", PROMPT
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            while got < 3:
                if next(lines).startswith("data: "):
                    got += 1
            busy = metrics(server.url)
            assert busy["kimiserve:num_requests_running"] == 1 and busy["kimiserve:cache_pages_used_by_requests"] > 0
            closed_at = time.monotonic()
    idle = wait_until(lambda: _idle(server.url), timeout=5)
    assert idle, metrics(server.url)
    assert time.monotonic() - closed_at < 2.0
    key = "kimiserve:request_success_total{finished_reason=\"abort\"}"
    assert idle[key] == before[key] + 1
    assert idle["kimiserve:generation_tokens_total"] - before["kimiserve:generation_tokens_total"] < 150


def test_disconnect_non_stream_aborts(server):
    before = metrics(server.url)
    body = {"model": "kimi-tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    idle = wait_until(lambda: _idle(server.url), timeout=5)
    assert idle
    key = "kimiserve:request_success_total{finished_reason=\"abort\"}"
    assert idle[key] == before[key] + 1
    assert idle["kimiserve:generation_tokens_total"] - before["kimiserve:generation_tokens_total"] < 150


# API key, SIGTERM -----------------------------------------------------------------------------------
def _check_api_key(server, key: str) -> None:
    r = httpx.get(f"{server.base_url}/models")
    assert r.status_code == 401 and r.json()["error"]["message"] and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 200  # /v1 only, as vLLM
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_api_key_flag():
    with running_server(*LIGHT_SERVER, "--api-key", "sekret", "--allowed-origins", "https://app.example") as server:
        _check_api_key(server, "sekret")
        # a browser's preflight carries no key: CORS answers it, for the allowed origin only
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(f"{server.base_url}/models", headers={"Origin": "https://app.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(f"{server.base_url}/models", headers={"Origin": "https://evil.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_api_key_env_and_sigterm_with_in_flight_stream():
    with running_server(*LIGHT_SERVER, env={"KIMISERVE_API_KEY": "from-env"}, check_exit=False) as server:
        _check_api_key(server, "from-env")
        headers = {"Authorization": "Bearer from-env"}
        body = {"prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, headers=headers, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.proc.send_signal(__import__("signal").SIGTERM)
            rest = [first] + [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest[:-1]]
        assert finish[-1] == "length"  # the in-flight stream ran to its end
        code = server.proc.wait(60)
        server.check_clean_exit(code)
        assert "Application shutdown complete" in server.stderr()


def test_sigterm_past_shutdown_timeout_ends_requests_in_openai_shape():
    """Requests still running when --shutdown-timeout runs out end as the issue asks (a stream with
    an error event and [DONE], a non-streaming request with a 503 in the OpenAI shape), not as
    uvicorn's cancellation (a cut stream, a bare 500, tracebacks); the exit stays clean."""
    import signal
    import threading

    with running_server(*LIGHT_SERVER, "--shutdown-timeout", "0", check_exit=False) as server:
        body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        plain: dict = {}
        worker = threading.Thread(target=lambda: plain.update(
            r=httpx.post(f"{server.base_url}/completions", json=body, timeout=60)))
        worker.start()
        with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=60,
                          json={**body, "max_tokens": 150, "messages": MESSAGES, "stream": True}) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            events = [next(lines)]
            assert wait_until(lambda: metrics(server.url)["kimiserve:num_requests_running"] == 2, timeout=30)
            server.proc.send_signal(signal.SIGTERM)
            events += list(lines)
        worker.join(60)
        server.check_clean_exit(server.proc.wait(60))
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "engine_dead" and error["message"]
    assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "engine_dead"


def test_cors_preflight_is_answered(server):
    """Browsers' preflight (no API key) gets CORS headers; any origin by default, as in vLLM."""
    r = httpx.options(f"{server.base_url}/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")


def test_chat_template_flag(tmp_path):
    """--chat-template replaces the tokenizer's template (a file, or the text itself); a path that does not
    exist or a template that does not compile stops the server with a message."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    with running_server(*LIGHT_SERVER, "--chat-template", str(template)) as s:
        tokens = tokenize(s, messages=MESSAGES)
        r = httpx.post(f"{s.url}/detokenize", json={"tokens": tokens})
        assert r.json()["prompt"] == "[user] Hello, Kimi\n"
    import subprocess
    import sys

    for bad, message in ((str(tmp_path / "missing.jinja"), "neither a file nor"), ("{% for %}", "does not compile")):
        proc = subprocess.run([sys.executable, "-m", "kimiserve.entrypoints.cli", "serve", *LIGHT_SERVER,
                               "--port", "0", "--chat-template", bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
