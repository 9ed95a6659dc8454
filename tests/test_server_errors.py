"""Malformed requests get a 4xx in the OpenAI error shape naming the field at fault; the server lives on."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from server_utils import LIGHT_SERVER, metrics, running_server

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

LONG = "word " * 300  # > 256 tokens
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
C, CHAT = "/v1/completions", "/v1/chat/completions"


def deep_tool(depth: int = 600) -> dict:
    """A tool whose schema nests deeper than the chat template's renderer recurses (JSON allows it)."""
    schema: dict = {}
    for _ in range(depth):
        schema = {"items": schema}
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": schema}}}}


def comp(**kw):
    return {"prompt": "hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"messages": MSG, "max_tokens": 4, **kw}


# (id, method, path, body (dict, or str sent raw), status, param)
CASES = [
    ("bad-json", "POST", C, '{"prompt": "x", ', 400, None),
    ("body-is-a-list", "POST", C, "[1, 2]", 400, None),
    ("empty-body", "POST", C, "", 400, None),
    ("nan-literal", "POST", C, '{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("prompt-missing", "POST", C, {"max_tokens": 3}, 400, "prompt"),
    ("prompt-int", "POST", C, {"prompt": 5}, 400, "prompt"),
    ("prompt-empty-str", "POST", C, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), 400, "prompt"),
    ("prompt-id-out-of-vocab", "POST", C, comp(prompt=[1, 10**9]), 400, "prompt"),
    ("prompt-over-context", "POST", C, comp(prompt=LONG), 400, "prompt"),
    ("prompt-plus-max-tokens-over-context", "POST", C, comp(max_tokens=254), 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", "POST", C, comp(max_tokens=10**12), 400, "max_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-1), 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), 400, "temperature"),
    ("top-p-over-1", "POST", C, comp(top_p=1.5), 400, "top_p"),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, "top_p"),
    ("n-zero", "POST", C, comp(n=0), 400, "n"),
    ("n-too-large", "POST", C, comp(n=1000), 400, "n"),
    ("n-float", "POST", C, comp(n=1.5), 400, "n"),
    ("logprobs-too-large", "POST", C, comp(logprobs=50), 400, "logprobs"),
    ("presence-penalty-range", "POST", C, comp(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty-range", "POST", C, comp(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("stream-string", "POST", C, comp(stream="yes"), 400, "stream"),
    ("stop-int", "POST", C, comp(stop=5), 400, "stop"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop"),
    ("seed-string", "POST", C, comp(seed="abc"), 400, "seed"),
    ("seed-huge", "POST", C, comp(seed=2**70), 400, "seed"),
    ("top-k-negative", "POST", C, comp(top_k=-5), 400, "top_k"),
    ("min-p-range", "POST", C, comp(min_p=2), 400, "min_p"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=10), 400, "min_tokens"),
    ("stop-token-ids-negative", "POST", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    ("stop-token-ids-out-of-vocab", "POST", C, comp(stop_token_ids=[10**9]), 400, "stop_token_ids[0]"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    ("logit-bias-not-a-token-id", "POST", C, comp(logit_bias={"a": 5}), 400, "logit_bias"),
    ("logit-bias-out-of-range", "POST", C, comp(logit_bias={"1": -101}), 400, "logit_bias"),
    ("suffix-unsupported", "POST", C, comp(suffix="end"), 400, "suffix"),
    ("unknown-model", "POST", C, comp(model="gpt-17"), 404, "model"),
    ("chat-messages-missing", "POST", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("chat-messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("chat-messages-string", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("chat-unknown-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("chat-role-missing", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("chat-content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content"),
    ("chat-content-part-type", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]), 400,
     "messages[0].content[0].type"),
    ("chat-user-missing-content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("chat-tool-calls-on-user", "POST", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages[0].tool_calls"),
    ("chat-top-logprobs-too-large", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-logprobs-int", "POST", CHAT, chat(logprobs=3), 400, "logprobs"),
    ("chat-max-completion-tokens-string", "POST", CHAT, chat(max_completion_tokens="x"), 400,
     "max_completion_tokens"),
    ("chat-over-context", "POST", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, "messages"),
    ("chat-max-completion-tokens-over-context", "POST", CHAT, chat(max_completion_tokens=255), 400,
     "max_completion_tokens"),
    ("tool-missing-name", "POST", CHAT, chat(tools=[{"type": "function", "function": {"parameters": {}}}],
                                             tool_choice="none"), 400, "tools[0].function.name"),
    ("tool-bad-name", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b:c"}}],
                                         tool_choice="none"), 400, "tools[0].function.name"),
    ("tool-parameters-string", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "object"}}], tool_choice="none"), 400, "tools[0].function.parameters"),
    ("tool-parameters-array-schema", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}], tool_choice="none"), 400, "tools[0].function.parameters"),
    ("tool-type-not-function", "POST", CHAT, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}],
                                                  tool_choice="none"), 400, "tools[0].type"),
    ("tool-schema-nested-too-deeply", "POST", CHAT, chat(tools=[deep_tool()], tool_choice="required"), 400, "tools"),
    ("tool-choice-unknown-function", "POST", CHAT, chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "nope"}}), 400, "tool_choice.function.name"),
    ("tool-choice-bad-string", "POST", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    ("tool-choice-required-without-tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-auto-without-server-flags", "POST", CHAT, chat(tools=[TOOL]), 400, "tool_choice"),
    ("response-format-json-schema-without-schema", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema.schema"),
    ("structured-outputs-two-kinds", "POST", CHAT, chat(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_outputs"),
    ("structured-outputs-unknown-key", "POST", C, comp(structured_outputs={"structural_tag": "x"}), 400,
     "structured_outputs.structural_tag"),
    ("guided-regex-does-not-compile", "POST", C, comp(guided_regex="(("), 400, "guided_regex"),
    ("chat-unknown-model", "POST", CHAT, chat(model="nope"), 404, "model"),
    ("wrong-method-completions", "GET", C, None, 405, None),
    ("wrong-method-models", "POST", "/v1/models", {}, 405, None),
    ("unknown-route", "GET", "/v1/nothing-here", None, 404, None),
    ("unknown-model-retrieve", "GET", "/v1/models/nope", None, 404, "model"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]"),
    ("detokenize-bad-type", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("tokenize-both-inputs", "POST", "/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt"),
    ("tokenize-tool-schema-nested-too-deeply", "POST", "/tokenize", {"messages": MSG, "tools": [deep_tool()]}, 400,
     "tools"),
    ("tokenize-unknown-role", "POST", "/tokenize", {"messages": [{"role": "x", "content": "y"}]}, 400,
     "messages[0].role"),
    # vLLM / OpenAI fields this server does not implement: a 400 naming them, never silently ignored
    ("guided-decoding-backend", "POST", C, comp(guided_decoding_backend="xgrammar"), 400, "guided_decoding_backend"),
    ("beam-search", "POST", C, comp(use_beam_search=True), 400, "use_beam_search"),
    ("chat-functions", "POST", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("chat-template-per-request", "POST", CHAT, chat(chat_template="{{ messages }}"), 400, "chat_template"),
    ("spaces-between-special-tokens", "POST", C, comp(spaces_between_special_tokens=False), 400,
     "spaces_between_special_tokens"),
    ("continuous-usage-stats", "POST", C, comp(stream=True, stream_options={"continuous_usage_stats": True}), 400,
     "stream_options.continuous_usage_stats"),
    ("chat-image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400, "messages[0].content[1].type"),
    ("chat-text-part-without-text", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     400, "messages[0].content[0].text"),
    ("tokenize-image-part", "POST", "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]}, 400, "messages[0].content[0].type"),
    ("template-kwargs-messages", "POST", CHAT, chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs.messages"),
    ("template-kwargs-tokenize", "POST", "/tokenize", {"messages": MSG, "chat_template_kwargs": {"tokenize": True}},
     400, "chat_template_kwargs.tokenize"),
    ("continue-and-generation-prompt", "POST", CHAT, chat(continue_final_message=True), 400, "continue_final_message"),
    ("continue-without-final-text", "POST", CHAT, chat(continue_final_message=True, add_generation_prompt=False,
                                                        messages=MSG + [{"role": "assistant", "content": ""}]), 400,
     "messages[1].content"),
    ("allowed-token-ids-out-of-vocab", "POST", C, comp(allowed_token_ids=[1, 10**9]), 400, "allowed_token_ids[1]"),
    ("allowed-token-ids-empty", "POST", C, comp(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("bad-words-too-many", "POST", C, comp(bad_words=["w"] * 65), 400, "bad_words"),
    ("stop-too-many", "POST", C, comp(stop=[f"s{i}" for i in range(65)]), 400, "stop"),
    ("stop-too-long", "POST", C, comp(stop=["x" * 257]), 400, "stop[0]"),
]

ACCEPTED = [  # requests that once broke the server (a 500, or a dead engine) and are valid
    ("top-k-over-int64", C, comp(top_k=9223372036854775808, temperature=1.0)),
    ("top-k-over-vocab", C, comp(top_k=10**6, temperature=1.0)),
    ("tiny-temperature", C, comp(temperature=1e-300)),
    ("huge-repetition-penalty", C, comp(repetition_penalty=1e308, temperature=1.0)),
    ("template-kwargs-self", CHAT, chat(chat_template_kwargs={"self": 1, "namespace": "x", "thinking": True})),
    ("tokenize-template-kwargs-namespace", "/tokenize", {"messages": MSG, "chat_template_kwargs": {"namespace": 1}}),
    ("unknown-fields", C, comp(user="u", metadata={"a": "b"}, some_future_field=[1, 2])),
    ("inert-unsupported-values", CHAT, chat(use_beam_search=False, guided_json=None, modalities=["text"])),
    ("allowed-token-ids", C, comp(allowed_token_ids=[5, 6, 7], temperature=1.0)),
    ("bad-words", C, comp(bad_words=["hello", "the"], temperature=1.0)),
]


@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_once_fatal_requests_are_served(http, case):
    _, path, body = case
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def server():
    with running_server(*LIGHT_SERVER) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def send(http, method, path, body):
    if isinstance(body, str):
        return http.request(method, path, content=body.encode(), headers={"Content-Type": "application/json"})
    return http.request(method, path, json=body) if body is not None else http.request(method, path)


def test_table_is_big_enough():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(http, case):
    _, method, path, body, status, param = case
    r = send(http, method, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    if status == 405:
        assert "allow" in r.headers


def test_context_length_errors_carry_the_numbers(http):
    prompt_tokens = http.post("/tokenize", json={"prompt": LONG}).json()["count"]
    error = http.post(C, json=comp(prompt=LONG, max_tokens=7)).json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert str(prompt_tokens) in error["message"] and "256" in error["message"] and "7" in error["message"]
    prompt_tokens = http.post("/tokenize", json={"prompt": "hello"}).json()["count"]
    error = http.post(C, json=comp(max_tokens=300)).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"{prompt_tokens + 300} tokens ({prompt_tokens} in the prompt, 300 in the completion)" in error["message"]


def test_auto_tool_choice_error_names_the_flags(http):
    message = http.post(CHAT, json=chat(tools=[TOOL])).json()["error"]["message"]
    assert "--enable-auto-tool-choice" in message and "--tool-call-parser" in message


def test_openai_client_raises_typed_errors(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hello", top_p=3)
    assert bad.value.param == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=MSG)


def test_still_healthy_after_all_of_them(server, http):
    assert http.get("/health").status_code == 200
    r = http.post(C, json=comp(max_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = metrics(server.url)
    assert stats["kimiserve:num_requests_running"] == 0 and stats["kimiserve:cache_pages_used_by_requests"] == 0


@pytest.mark.parametrize("argv, flag", [
    (["--port", "abc"], "--port"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser"),
    (["--reasoning-parser", "deepseek"], "--reasoning-parser"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--gpu-memory-utilization", "2"], "gpu_memory_utilization"),
    (["--kv-cache-dtype", "fp6"], "kv_cache_dtype"),
    (["--enable-auto-tool-choice"], "enable_auto_tool_choice"),
    (["--port", "70000"], "port"),
])
def test_serve_bad_flags_exit_2(capsys, argv, flag):
    from kimiserve.entrypoints.cli import main

    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert flag in capsys.readouterr().err


def test_bench_serve_subcommand_is_wired(capsys):
    from kimiserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0 and "--base-url" in capsys.readouterr().out


def test_lone_surrogates_in_input_never_break_a_response(http):
    """JSON may carry a lone surrogate ("\\ud800"), which cannot be sent as UTF-8: responses that
    echo it (an error message, an echoed prompt, streamed or not) escape it instead of failing."""
    def raw(path, text):
        return http.post(path, content=text.encode(), headers={"Content-Type": "application/json"})

    r = raw(C, '{"prompt": "x", "model": "\\ud800x"}')
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = raw(C, '{"prompt": "\\ud800x", "max_tokens": 2, "echo": true}')
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("\ud800x")
    r = raw(C, '{"prompt": "\\ud800x", "max_tokens": 2, "echo": true, "stream": true}')
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]" and "error" not in events[-2]
    assert json.loads(events[0])["choices"][0]["text"].startswith("\ud800x")


def test_client_gone_mid_body_is_not_an_error(server, http):
    """A client that leaves before its body is complete (or that --body-read-timeout cuts off with a
    408) once made the route's body read raise ClientDisconnect: an ERROR and a traceback in the
    server's log for the client's own failure (found by test_server_hostile.py's stalled body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)  # the route is reading the body when the client goes
    time.sleep(0.3)
    err = server.stderr()
    assert "ClientDisconnect" not in err and "Traceback" not in err, err[-3000:]
    assert http.get("/health").status_code == 200


def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection; the first response (status, headers, body), read to EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("data", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # no Host
    b"GET /v1/models/a b HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v1/models/\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 50,  # a TLS hello on the plain port
    b"HEAD /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
], ids=["content-length-abc", "two-content-lengths", "bad-chunk", "no-host", "space-in-target", "non-ascii-target",
        "tls-hello", "head-bad-chunk"])
def test_unparsable_http_is_an_openai_400(server, http, data):
    """Bytes h11 cannot parse as a request once got uvicorn's text/plain "Invalid HTTP request
    received." (found by test_server_hostile.py's raw HTTP requests)."""
    status, headers, body = raw_exchange(server.port, data)
    assert status == 400 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    if data.startswith(b"HEAD"):  # the head alone: a HEAD's answer has no body (uvicorn's own raised here)
        assert body == b"" and int(headers["content-length"]) > 0
    else:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert "invalid HTTP request" in error["message"]
    assert "Traceback" not in server.stderr()
    assert http.get("/health").status_code == 200
