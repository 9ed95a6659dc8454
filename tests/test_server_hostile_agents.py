"""Hostile input to the agent APIs, generated: POST /v1/messages, /v1/messages/count_tokens and
/v1/responses (with GET /v1/responses/{id}) on one real server (the random `tiny` model, the Kimi
parsers, auto tool choice, an API key), from hypothesis strategies mixing valid requests with
ones wrong in every field (the value tables of test_server_hostile.py).

For every request: never a 5xx; an error body has the API's own shape (Anthropic's
`{"type": "error", "error": {"type", "message"}}` on /v1/messages, OpenAI's elsewhere); a 200
stream is well formed (Messages: event/data pairs from message_start to message_stop, or ending
in an `error` event; Responses: sequence numbers 0, 1, ... from response.created to
response.completed / incomplete / failed); the server logged no traceback or ERROR; afterwards it
answers a one-token completion. At the end: no pages held by requests once idle.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server_utils import metrics, running_server, wait_until
from hostile_requests import (
    SCHEMAS, TOOL_NAMES, encode_body, hostile, hostile_settings, json_values, nonempty_texts, texts)

pytestmark = pytest.mark.fixed_threads  # the server runs with one torch thread: OMP_NUM_THREADS changes nothing

API_KEY = "agents-key"
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"


@pytest.fixture(scope="module")
def server():
    with running_server("--max-model-len", "512", "--num-pages", "2000", "--max-num-seqs", "8",
                        "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice",
                        "--api-key", API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


# strategies ----------------------------------------------------------------------------------------
small = st.one_of(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.sampled_from([1, 511, 512, 10**6]))
schemas = st.sampled_from([s for s in SCHEMAS if s is not None] + [{"type": "object"}])
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": texts()})
anthropic_tool = st.fixed_dictionaries({"name": st.sampled_from(TOOL_NAMES), "input_schema": schemas},
                                       optional={"description": texts(), "type": st.sampled_from(["custom", "bash"])})
tool_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts(10, False),
                                  "name": st.sampled_from(TOOL_NAMES), "input": st.dictionaries(texts(5, False),
                                                                                               json_values, max_size=2)})
tool_result = st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts(10, False)},
                                    optional={"content": st.one_of(texts(), st.lists(text_block, max_size=2)),
                                              "is_error": st.booleans()})
thinking_block = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": texts()},
                                       optional={"signature": texts(8, False)})
odd_block = st.sampled_from([{"type": "image", "source": {}}, {"type": "document"}, {"type": "text"}, {},
                             {"type": "tool_use", "id": "x"}, {"type": "redacted_thinking", "data": "x"}])
user_message = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
    texts(), st.lists(st.one_of(text_block, tool_result), min_size=1, max_size=3))})
assistant_message = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(
    nonempty_texts(), st.lists(st.one_of(text_block, tool_use, thinking_block), min_size=1, max_size=3))})
anthropic_messages = st.one_of(
    st.lists(st.one_of(user_message, assistant_message), min_size=1, max_size=4),
    st.just([{"role": "user", "content": "hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                    "content": st.one_of(texts(), st.lists(odd_block, min_size=1, max_size=2))}),
             max_size=2))
MESSAGES_FIELDS = {
    "model": st.sampled_from([None, "tiny", "tiny", "tiny", "claude-x"]),
    "max_tokens": small,
    "messages": anthropic_messages,
    "system": st.one_of(texts(), st.lists(text_block, max_size=2)),
    "tools": st.lists(anthropic_tool, min_size=1, max_size=2),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool"},
                                    {"type": "tool", "name": "get_weather"}, {"type": "tool", "name": "nope"},
                                    {"type": "auto", "disable_parallel_tool_use": True}, {"type": "other"}]),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                 {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 0}, {"type": "on"}]),
    "stop_sequences": st.lists(nonempty_texts(8), max_size=3),
    "stream": st.booleans(),
    "temperature": st.one_of(st.floats(0, 1), st.just(0)),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.integers(0, 2000),
    "metadata": st.just({"user_id": "u"}),
    "mcp_servers": st.sampled_from([None, None, [{"url": "x"}]]),
}
response_items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                           "content": st.one_of(texts(), st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": texts()}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts(10, False),
                           "name": st.sampled_from(TOOL_NAMES), "arguments": texts()}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts(10, False),
                           "output": texts()}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.lists(st.fixed_dictionaries(
        {"type": st.just("summary_text"), "text": texts()}), max_size=2)}),
    st.sampled_from([{"type": "item_reference", "id": "x"}, {"type": "web_search_call"}, {}, {"type": "message"}]))
function_tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "web_search"]),
                                       "name": st.sampled_from(TOOL_NAMES)},
                                      optional={"parameters": st.sampled_from(SCHEMAS), "strict": st.booleans(),
                                                "description": texts()})
RESPONSES_FIELDS = {
    "model": st.sampled_from([None, "tiny", "tiny", "gpt-x"]),
    "input": st.one_of(texts(), st.lists(response_items, min_size=1, max_size=4)),
    "instructions": texts(),
    "tools": st.lists(function_tool, min_size=1, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "get_weather"},
                                    {"type": "function"}, {"type": "file_search"}, "any"]),
    "max_output_tokens": small,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(1e-6, 1),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": st.sampled_from(["resp_nope", ""]),
    "parallel_tool_calls": st.booleans(),
    "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                             {"format": {"type": "xml"}}]),
    "reasoning": st.sampled_from([{"effort": "none"}, {"effort": "high"}, {"effort": "max"}]),
    "include": st.just(["reasoning.encrypted_content"]),
    "background": st.sampled_from([False, False, None, True]),
    "truncation": st.sampled_from(["auto", "disabled", "middle"]),
}


@st.composite
def bodies(draw, table: dict, required: tuple[str, ...]):
    """A body with the required fields and a few others valid, or up to three fields hostile."""
    body = {name: draw(table[name]) for name in required}
    for name in draw(st.lists(st.sampled_from(sorted(table)), unique=True, max_size=4)):
        body[name] = draw(table[name])
    if draw(st.integers(0, 2)) == 0:
        for name in draw(st.lists(st.sampled_from(sorted(table)), unique=True, min_size=1, max_size=3)):
            body[name] = draw(hostile)
    return body


# checks --------------------------------------------------------------------------------------------
def check_error(path: str, data, where: str) -> None:
    if path.startswith(MESSAGES):
        assert isinstance(data, dict) and data.get("type") == "error" and set(data) == {"type", "error"}, where
        assert set(data["error"]) == {"type", "message"} and data["error"]["message"], where
    else:
        assert isinstance(data, dict) and set(data) == {"error"}, where
        assert set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["message"], where


def check_stream(path: str, text: str, where: str) -> None:
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), (where, block)
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:], (where, block)
        events.append(data)
    kinds = [e["type"] for e in events]
    if path == MESSAGES:
        assert kinds[0] == "message_start", (where, kinds)
        assert kinds[-1] == "message_stop" or kinds[-1] == "error", (where, kinds)
        if kinds[-1] == "error":
            assert events[-1]["error"]["type"] != "api_error", (where, events[-1])
    else:
        assert [e["sequence_number"] for e in events] == list(range(len(events))), where
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete",
                                                                "response.failed"), (where, kinds)


def send(server, http: httpx.Client, path: str, body, ascii_only: bool) -> httpx.Response:
    where = f"POST {path} {json.dumps(body, default=str)[:400]}"
    headers = {"Content-Type": "application/json", "x-api-key": API_KEY}
    r = http.post(path, content=encode_body(body, ascii_only), headers=headers)
    assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:1000]}"
    if r.status_code >= 400:
        check_error(path, r.json(), where)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(path, r.text, where)
    err = server.stderr()
    assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), err[-4000:]
    canary = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert canary.status_code == 200, canary.text
    return r


@hostile_settings(60)
@given(body=bodies(MESSAGES_FIELDS, ("model", "max_tokens", "messages")), ascii_only=st.booleans(),
       count=st.sampled_from([False, False, False, True]))
def test_messages(server, http, body, ascii_only, count):
    send(server, http, COUNT if count else MESSAGES, body, ascii_only)


@hostile_settings(60)
@given(body=bodies(RESPONSES_FIELDS, ("input", "max_output_tokens")), ascii_only=st.booleans())
def test_responses(server, http, body, ascii_only):
    r = send(server, http, RESPONSES, body, ascii_only)
    if r.status_code == 200 and not body.get("stream") and body.get("store") is not False:
        rid = r.json()["id"]
        got = http.get(f"{RESPONSES}/{rid}", headers={"x-api-key": API_KEY})
        assert got.status_code == 200 and got.json()["id"] == rid
        follow = http.post(RESPONSES, json={"model": "tiny", "input": "more", "previous_response_id": rid,
                                            "max_output_tokens": 1}, headers={"x-api-key": API_KEY})
        assert follow.status_code in (200, 400), follow.text  # 400: the conversation outgrew the context


def test_no_leaked_pages_once_idle(server, http):
    idle = wait_until(lambda: (lambda m: m if m["kimiserve:num_requests_running"] == 0
                               and m["kimiserve:num_requests_waiting"] == 0 else None)(metrics(server.url)), 10)
    assert idle and idle["kimiserve:cache_pages_used_by_requests"] == 0


# grammar-guided decoding through the agent APIs (chat's guided decoding) ------------------------------
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"],
                 "additionalProperties": False}


def test_forced_tool_calls_and_structured_output_validate_on_random_weights(http):
    """On the random model, tool_choice any / tool (Messages) and required / a function (Responses) give
    calls whose inputs validate against the tool's schema, and output_config.format / text.format give
    JSON that validates: the chat path's grammar enforces them (free text from these weights is noise)."""
    jsonschema = pytest.importorskip("jsonschema")
    key = {"x-api-key": API_KEY}
    tool = {"name": "forecast", "input_schema": CITY_SCHEMA}
    for i, choice in enumerate([{"type": "any"}, {"type": "tool", "name": "forecast"}] * 2):
        choice = {**choice, "disable_parallel_tool_use": True}  # one call: the grammar then ends the section
        r = http.post(MESSAGES, headers=key, json={"model": "tiny", "max_tokens": 150, "temperature": 0, "tools": [tool],
                                                   "tool_choice": choice, "messages": [{"role": "user",
                                                                                        "content": f"q{i}"}]})
        assert r.status_code == 200, r.text
        uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
        assert len(uses) == 1 and r.json()["stop_reason"] == "tool_use", r.text
        for use in uses:
            assert use["name"] == "forecast"
            jsonschema.validate(use["input"], CITY_SCHEMA)
    fn = {"type": "function", "name": "forecast", "parameters": CITY_SCHEMA}
    for i, choice in enumerate(["required", {"type": "function", "name": "forecast"}] * 2):
        r = http.post(RESPONSES, headers=key, json={"model": "tiny", "max_output_tokens": 150, "temperature": 0,
                                                    "tools": [fn], "tool_choice": choice, "input": f"r{i}",
                                                    "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        calls = [o for o in r.json()["output"] if o["type"] == "function_call"]
        assert len(calls) == 1 and r.json()["status"] == "completed", r.text
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), CITY_SCHEMA)
    for i in range(2):
        r = http.post(MESSAGES, headers=key, json={
            "model": "tiny", "max_tokens": 40, "temperature": 0, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": f"s{i}"}],
            "output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}})
        assert r.status_code == 200, r.text
        (text,) = [b["text"] for b in r.json()["content"] if b["type"] == "text"]
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
        r = http.post(RESPONSES, headers=key, json={
            "model": "tiny", "max_output_tokens": 40, "temperature": 0, "input": f"t{i}", "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["output"][-1]["content"][0]["text"]), ANSWER_SCHEMA)
