"""Guided decoding through a real server process on the random tiny model: the openai client's
`chat.completions.parse` with a pydantic model, response_format, vLLM's structured_outputs,
tool_choice required / named and --enforce-tool-call-grammar (every call parses and validates),
bad specs as 400s naming the problem, logit_bias, thinking on/off and its budget, and
usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest

from server_utils import running_server
from structured_utils import random_schemas, validates

pytest.importorskip("llguidance", reason="guided decoding needs llguidance (the guided / test extras)")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.fixed_threads

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query", "limit"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server():
    with running_server("--max-model-len", "1024", "--num-pages", "1200", "--max-num-seqs", "64",
                        "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice",
                        "--enforce-tool-call-grammar") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def post(server, path, **body):
    return httpx.post(f"{server.base_url}/{path}", json={"model": "tiny", **body}, timeout=120)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Literal["cute", "old", "new"]] = pydantic.Field(max_length=3)


def test_openai_parse_with_a_pydantic_model(client):
    for seed in range(2):
        completion = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Pet, max_tokens=200,
                                                   temperature=1.0, seed=seed, extra_body=NO_THINKING)
        message = completion.choices[0].message
        assert isinstance(message.parsed, Pet), message.content
        assert message.reasoning_content is None if hasattr(message, "reasoning_content") else True


def test_response_format_and_structured_outputs_streamed_or_not(server):
    schema = random_schemas(1, seed=11)[0]
    formats = [{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
               {"structured_outputs": {"json": schema}}, {"guided_json": schema}]
    for k, body in enumerate(formats):
        for stream in (False, True) if k == 0 else (False,):
            r = post(server, "chat/completions", messages=ASK, max_tokens=200, temperature=1.0, seed=1, stream=stream,
                     **body, **NO_THINKING)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
            else:
                text = r.json()["choices"][0]["message"]["content"]
            assert validates(text, schema), (body, text)
    r = post(server, "chat/completions", messages=ASK, max_tokens=300, temperature=1.0, seed=2,
             response_format={"type": "json_object"}, **NO_THINKING)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" or isinstance(json.loads(choice["message"]["content"]), dict)
    for body, check in [({"regex": "[a-c]{2}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{2}-[0-9]{2}", t)),
                        ({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
                        ({"grammar": 'root ::= "n=" [0-9]{1,3}'}, lambda t: re.fullmatch("n=[0-9]{1,3}", t))]:
        r = post(server, "completions", prompt="Answer:", max_tokens=40, temperature=1.0, seed=3, n=3,
                 structured_outputs=body)
        assert r.status_code == 200, r.text
        assert all(check(c["text"]) for c in r.json()["choices"]), r.json()["choices"]


def test_bad_specs_are_400s_naming_the_problem(server):
    cases = [
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "unclosed character class"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}},
         "response_format.json_schema.schema", "nosuchtype"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "needs json_schema.schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": {"type": "object"}}, "guided_regex": "a"}, "guided_regex", "combined"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids (non-negative integers)"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "[0, 1024)"),
        ({"thinking_token_budget": 3, "max_thinking_tokens": 4}, "max_thinking_tokens", "differ"),
    ]
    for body, param, needle in cases:
        r = post(server, "chat/completions", messages=ASK, max_tokens=8, **body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and needle in error["message"], (body, error)
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}]
    r = post(server, "chat/completions", messages=ASK, max_tokens=8, tools=bad_tool, tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = post(server, "completions", prompt="x", max_tokens=4, structured_outputs={"regex": "(("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def _check_calls(message) -> list:
    calls = message["tool_calls"]
    for call in calls:
        assert validates(call["function"]["arguments"], SCHEMAS[call["function"]["name"]]), call
    assert len({c["id"] for c in calls}) == len(calls)
    return calls


def test_tool_choice_required_and_named_always_give_valid_calls(server):
    def ask(seed):
        return post(server, "chat/completions", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=500,
                    temperature=1.0, seed=seed, parallel_tool_calls=seed % 2 == 0)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, range(32)))
    for r in replies:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and _check_calls(choice["message"]), choice
    assert any(len(r.json()["choices"][0]["message"]["tool_calls"]) > 1 for r in replies)  # parallel calls
    named = {"type": "function", "function": {"name": "search"}}
    for stream in (False, True):
        r = post(server, "chat/completions", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200,
                 temperature=1.0, seed=5, stream=stream, parallel_tool_calls=False)
        if stream:
            args = "".join(tc["function"].get("arguments") or "" for line in r.text.splitlines()
                           if line.startswith("data: {")
                           for ch in json.loads(line[6:])["choices"] for tc in ch["delta"].get("tool_calls") or [])
        else:
            args = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        assert validates(args, SCHEMAS["search"]), args


def test_enforced_tool_call_grammar_under_auto(server):
    tok_id = httpx.post(f"{server.url}/tokenize", json={"prompt": "<|tool_calls_section_begin|>",
                                                         "add_special_tokens": False}).json()["tokens"][0]
    opened = 0
    for seed in range(8):
        r = post(server, "chat/completions", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=120,
                 temperature=1.0, seed=seed, logit_bias={str(tok_id): 10}, **NO_THINKING)
        message = r.json()["choices"][0]["message"]
        if message["tool_calls"]:
            opened += 1
            _check_calls(message)
    assert opened >= 4


def test_logit_bias(server):
    r = post(server, "completions", prompt="Hello", max_tokens=5, temperature=1.0, seed=0, logit_bias={"77": 100},
             ignore_eos=True, logprobs=0)
    assert r.status_code == 200, r.text
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": r.json()["choices"][0]["text"],
                                                         "add_special_tokens": False}).json()["tokens"]
    assert set(tokens) == {77}


def test_thinking_off_and_budget(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, **NO_THINKING}).json()["tokens"]
    on = httpx.post(f"{server.url}/tokenize", json={"messages": ASK}).json()["tokens"]
    assert ids[: len(on)] == on and len(ids) == len(on) + 2  # <think></think> closed after the generation prompt
    schema = random_schemas(1, seed=4)[0]
    thought = 0
    for seed in range(12):
        r = post(server, "chat/completions", messages=ASK, max_tokens=300, temperature=1.0, seed=seed, logprobs=True,
                 thinking_token_budget=4, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        choice = r.json()["choices"][0]
        message = choice["message"]
        assert validates(message["content"], schema), message  # after any reasoning, the grammar holds
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        if message.get("reasoning_content") is not None:
            thought += 1
            assert tokens[0] == "<think>" and tokens.index("</think>") <= 5  # <think>, 4 tokens, </think>
    assert thought >= 1  # the random model opened <think> sometimes: the budget closed it
    prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": "<think>", "add_special_tokens": False}).json()
    think = prompt["tokens"]
    for name in ("max_thinking_tokens", "thinking_token_budget"):  # a prompt that ends inside <think>
        r = post(server, "completions", prompt=think * 2, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True,
                 skip_special_tokens=False, **{name: 3})
        assert r.status_code == 200, r.text
        assert "</think>" in r.json()["choices"][0]["text"], r.json()


def test_cached_tokens_in_usage(server, client):
    messages = [{"role": "user", "content": "a long question to cache " * 20}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    prompt = "completions cache " * 30
    a = client.completions.create(model="tiny", prompt=[prompt, prompt + "x"], max_tokens=2)
    b = client.completions.create(model="tiny", prompt=[prompt, prompt + "x"], max_tokens=2)
    assert a.usage.prompt_tokens_details is None or a.usage.prompt_tokens_details.cached_tokens < b.usage.prompt_tokens_details.cached_tokens
    assert b.usage.prompt_tokens_details.cached_tokens > 0
