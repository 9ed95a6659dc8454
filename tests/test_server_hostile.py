"""Hostile input, generated: one real server (the random `tiny` model, --max-model-len 256,
--max-request-body-bytes 256 KiB, --body-read-timeout 1 s, an API key, the Kimi reasoning and
tool-call parsers, a chat template reading three chat_template_kwargs), 600 requests from
hypothesis strategies written per endpoint: a mix of valid requests that reach the engine and
generate (a few tokens each) and requests wrong in every way a client can be wrong.

For every request: never a 5xx; a non-2xx body is an OpenAI error `{"error": {"message", "type",
"param", "code"}}` (413, 408 and the 400 for unparsable HTTP included; a 3xx is a redirect with a
Location, not an error; a HEAD's answer has no body to check); a 200 stream ends with
`data: [DONE]` and an error event in it is OpenAI-shaped, last, and not an internal error; the
server logged no traceback and no ERROR meanwhile; afterwards `/health` is 200 and a one-token
completion still succeeds. At the end: no pages held by requests once idle, and a clean exit on
SIGTERM (`running_server`).

Strategies: the `*_FIELDS` tables give every field the request models declare (checked against
the models) a strategy of valid values, edges included (seeds -2**63 and 2**64-1, top_k 2**64,
temperature 5e-324 and 1e308, n = --max-num-seqs, max_tokens at the context's edge, 64 stop
strings of 256 characters, allowed_token_ids that make the model write tool-call markup, ...);
`request_bodies` draws a body valid, with one or several fields hostile (`hostile`: ints up to
2**100 and below -2**64, 1e308, -0.0, subnormals, NaN and Infinity literals, strings for
numbers, lists for objects, null, nested lists; `BAD_FIELD_VALUES`: wrong in the field's own
way), or with UNSUPPORTED_FIELDS and unknown fields added. Text everywhere comes from `texts`:
lone surrogates, NUL, RTL marks, emoji, Jinja syntax, long strings and the model's special-token
text. Bodies go out as JSON with NaN literals allowed and lone surrogates escaped or as raw
(invalid UTF-8) bytes; a few clients send a missing or wrong API key, or hang up early (after a
stream's first line, or before a non-stream answer). Raw bodies: malformed JSON bytes, other
encodings, deep nesting in every field; raw HTTP: odd request lines, headers and framing
(Content-Length, chunked), some pipelined after a good request; GETs: odd model ids, methods and
query strings; fixed cases: bodies just over and at --max-request-body-bytes, a stalled body.

Deterministic (derandomize: CI sets no seed) and about 25 s here. For exploring by hand:
KIMISERVE_HOSTILE_RANDOM=1 draws fresh examples, KIMISERVE_HOSTILE_SCALE=4 four times as many,
KIMISERVE_HOSTILE_LOG=FILE appends each request, its status, time and answer to FILE.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections import Counter

import h11
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kimiserve.entrypoints.openai.protocol import (
    UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest)
from kimiserve.tokenizer.tokenizer import PACKAGED_TEMPLATE, load_tokenizer
from server_utils import metrics, running_server, wait_until

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

BODY_LIMIT = 256 * 1024
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
VOCAB = 1024  # the tiny model's
ALIAS = "kimi/alias-\u00e9"  # a second served name: a slash and a non-ASCII letter
API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "3000", "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-request-body-bytes", str(BODY_LIMIT), "--body-read-timeout", "1",
               "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice",
               "--served-model-name", "tiny", ALIAS, "--api-key", API_KEY)
C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
TEMPLATE_SUFFIX = """
{%- if note is defined %}{{ '<note>' ~ (note | string) ~ '</note>' }}{% endif -%}
{%- if thinking is defined and thinking %}<think>{% endif -%}
{%- for tag in tags | default([]) %}{{ tag }}{% endfor -%}
"""
"""Appended to the model's chat template: variables that chat_template_kwargs can set, so that
hostile values (nested lists, huge ints, lone surrogates, an int to iterate) reach Jinja."""
GET_ROUTES = ("/v1/models", "/v1/models/{id}", "/health", "/version", "/metrics")

SCALE = float(os.environ.get("KIMISERVE_HOSTILE_SCALE", "1"))
RANDOM = bool(os.environ.get("KIMISERVE_HOSTILE_RANDOM"))
SENT: Counter = Counter()  # (endpoint, status) -> generated requests sent
REQUEST_TIMEOUT = 30.0  # a request that takes longer is a hang


def hostile_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=not RANDOM,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


# values ------------------------------------------------------------------------------------------
SPECIAL_TEXT = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "[EOS]", "[BOS]",
                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", "<|media_pad|>",
                "functions.get_weather:0", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                "<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|><|tool_calls_section_end|>"]
EDGE_TEXT = ["\ud800", "\udfff", "a\udc00b", "\udbff\udfff", "\x00", "nul\x00inside", "\u202eevil\u202c",
             "\u200f\u200e", "\ufeff", "\u2028\u2029", "😀", "👩‍👩‍👧‍👦", "\U0010ffff", "\ufffd", "\r\n\t", "\\", '"', "'",
             "{{ 7 * 7 }}", "{% for x in range(99999999) %}x{% endfor %}", "</s>", "\u0301\u0301\u0301", "ǅ", "İ", "ß", "한국어",
             "汉字", " ", "\x7f\x1b[31m"]
LONG_TEXT = ["a" * 300, "é" * 1000, "😀" * 500, "word " * 2000, "x" * 60000, "\ud800" * 200]
INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, 10**30, -1, -(2**31), -(2**63),
        -(2**63) - 1, -(2**64), -(10**30), 0]
FLOATS = [1e308, -1e308, 1.7976931348623157e308, -0.0, 0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1e-300,
          1e-5, 0.99999999999, 1.0000000001, 2.0000001, -2.0000001, 0.5, 3.0, float("nan"), float("inf"),
          float("-inf")]
NUMERIC_STRINGS = ["1", "1.5", "-1", "true", "null", "NaN", "1e999", "0x10", "", " 3 "]


def texts(max_size: int = 30, long: bool = True) -> st.SearchStrategy[str]:
    pieces = st.sampled_from(EDGE_TEXT + SPECIAL_TEXT)
    out = [st.text(max_size=max_size), pieces, st.lists(pieces | st.text(max_size=4), max_size=6).map("".join),
           st.text(st.characters(codec="utf-8", exclude_categories=()), max_size=max_size)]
    if long:
        out.append(st.sampled_from(LONG_TEXT))
    return st.one_of(*out)


def nonempty_texts(max_size: int = 30) -> st.SearchStrategy[str]:
    return texts(max_size, long=False).filter(bool)


json_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(INTS),
                        st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(FLOATS), texts(8, False))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(texts(6, False), inner, max_size=3), max_leaves=8)


def nested(depth: int, leaf=1, kind: str = "list"):
    out = leaf
    for _ in range(depth):
        out = [out] if kind == "list" else {"a": out}
    return out


wrong_types = st.one_of(
    st.none(), st.booleans(), st.sampled_from(NUMERIC_STRINGS), texts(12, False),
    st.lists(st.integers(-3, 3), max_size=3),
    st.just({}), st.just({"a": 1}), st.just([[1, [2, [3]]]]), st.just([None]), st.just([{}]),
    st.sampled_from([nested(40), nested(40, kind="dict")]), json_values)
hostile = st.one_of(st.sampled_from(INTS), st.sampled_from(FLOATS), st.integers(), st.floats(), wrong_types)
"""A value that is wrong for most fields (and may happen to be right for a few)."""



def ints_near(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi]))


# per-field valid values: small and cheap, edges included --------------------------------------
stops = st.one_of(nonempty_texts(8), st.lists(nonempty_texts(8), min_size=1, max_size=4),
                  st.sampled_from([["<|im_end|>"], "\n", ["\ud800"], ["\x00"], ["a" * 256], [" ", "e", "the"],
                                   ["</think>", "<|tool_call_end|>"], [f"s{i}" for i in range(64)]]))
words = st.one_of(st.lists(nonempty_texts(8), min_size=1, max_size=4),
                  st.sampled_from([["<|im_end|>"], ["\ud800"], [" "], ["a" * 256], ["the", "a", "e", "o"],
                                   ["w"] * 64, ["x" * 256] * 64, [f"{i} {i}" for i in range(64)]]))
token_ids = st.integers(0, VOCAB - 1) | st.sampled_from([0, 1, 2, VOCAB - 1, 768, 767])
_TOKENIZER = load_tokenizer("tiny")
MARKER_SOUP = sorted({_TOKENIZER.token_to_id(name) for name in SPECIAL_TEXT if _TOKENIZER.token_to_id(name) is not None}
                     | {t for word in ("functions", ".", "f", ":", "0", "{", "}", '"', "a", " ", "get_weather")
                        for t in _TOKENIZER.encode(word)})
"""allowed_token_ids that make the random model write tool-call and reasoning markup (and little
else): the tool-call and reasoning parsers get marker soup."""

SAMPLING_FIELDS = {
    "model": st.sampled_from([None, "tiny", ALIAS]),
    "n": st.one_of(st.just(1), st.integers(1, 3), st.integers(1, 3), st.just(MAX_NUM_SEQS)),
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0, 0.0, -0.0, 1, 5e-324, 1e-300, 1e-5, 1e308])),
    "top_p": st.one_of(st.floats(1e-9, 1), st.sampled_from([1, 5e-324, 1e-300, 0.999999])),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, 2, -0.0, 5e-324])),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, 2, -0.0, -5e-324])),
    "seed": st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, -(2**63), 2**63, 2**64 - 1])),
    "stop": stops,
    "stream": st.booleans(),
    "stream_options": st.sampled_from([None, {}, {"include_usage": True}, {"include_usage": False},
                                       {"include_usage": None}, {"continuous_usage_stats": False}]),
    "logit_bias": st.sampled_from([None, {}, {"1": 5}, {"3": -100, "7": 2.5}, {"5": 100}]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                                        {"type": "json_schema", "json_schema": {"schema": {
                                            "type": "object", "properties": {"a": {"type": "integer"}}}}}]),
    "structured_outputs": st.sampled_from([None, {"regex": "[a-z]{1,4}"}, {"choice": ["a", "b"]},
                                           {"json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}}},
                                           {"grammar": 'root ::= "x" [0-9]'}, {"json_object": True}]),
    "guided_json": st.sampled_from([None, {"type": "object"}, '{"type": "string", "maxLength": 3}']),
    "guided_regex": st.sampled_from([None, "[0-9]{2}"]),
    "guided_choice": st.sampled_from([None, ["x", "y"]]),
    "guided_grammar": st.sampled_from([None, 'root ::= "a" | "b"']),
    "thinking_token_budget": st.one_of(st.none(), st.integers(0, 4)),
    "max_thinking_tokens": st.one_of(st.none(), st.integers(0, 4)),
    "user": texts(),
    "top_k": st.one_of(st.integers(-1, 2 * VOCAB), st.sampled_from([-1, 0, 1, VOCAB, VOCAB + 1, 2**63, 2**64, 10**30])),
    "min_p": st.one_of(st.floats(0, 1), st.sampled_from([0, 1, 1.0, 5e-324, -0.0])),
    "repetition_penalty": st.one_of(st.floats(1e-3, 10), st.sampled_from([1, 5e-324, 1e-300, 1e308, 2.0])),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stop_token_ids": st.one_of(st.lists(token_ids, max_size=5), st.just(list(range(VOCAB)))),
    "include_stop_str_in_output": st.booleans(),
    "prompt_logprobs": st.one_of(st.none(), ints_near(0, 20)),
    "allowed_token_ids": st.one_of(st.lists(token_ids, min_size=1, max_size=20), st.just(list(range(VOCAB))),
                                   st.just(MARKER_SOUP), st.just(MARKER_SOUP),
                                   st.just([1, 2, 1, 2])),
    "bad_words": words,
}
prompt_texts = st.one_of(nonempty_texts(), st.sampled_from(["hello", "hi " * 40, "\ud800x", "<|im_end|>"]))
id_prompts = st.one_of(st.lists(token_ids, min_size=1, max_size=20),
                       st.integers(MAX_MODEL_LEN - 8, MAX_MODEL_LEN + 1).map(lambda k: [5] * k))
prompts = st.one_of(prompt_texts, st.lists(prompt_texts, min_size=1, max_size=3), id_prompts,
                    st.lists(id_prompts, min_size=1, max_size=3), st.just(["a"] * 64))
small_max_tokens = st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.just(1),
                             st.just(None), st.sampled_from([MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1]))
"""Mostly 1..8; None (the room left) and the context's edge now and then (see `affordable`)."""
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": prompts,
    "max_tokens": small_max_tokens,
    "logprobs": st.one_of(st.none(), ints_near(0, 20)),
    "echo": st.booleans(),
    "suffix": st.sampled_from([None, ""]),
    "best_of": st.one_of(st.none(), st.integers(1, 3)),
    "add_special_tokens": st.booleans(),
}

TOOL_NAMES = ["get_weather", "f", "a.b.c", "x" * 64, "_-_", "F00", "weather-2"]
BAD_TOOL_NAMES = ["x" * 65, "functions.f:0", "a b", "", "ünï", "<|tool_call_end|>", ".lead", "trail.", "a..b",
                  "\ud800", "f\x00"]
SCHEMAS = [None, {}, {"type": "object"}, {"type": "object", "properties": {}},
           {"type": "object", "properties": {"a": {"type": "string", "enum": ["<|im_end|>", "\ud800", ""]}},
            "required": ["a"]},
           {"type": "object", "properties": {"\ud800": {}, "a b": {"type": "weird"}, "": {"$ref": "#"}}},
           {"type": "object", "additionalProperties": {"anyOf": [{"type": "null"}, {"type": "array", "items": {}}]}},
           {"type": "object", "properties": {"a": nested(60, {}, "dict")}},
           {"type": "object", "properties": {"a": nested(700, {}, "dict")}},  # deeper than the renderer recurses
           {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**64, "default": 1e308}}},
           {"type": ["object", "null"]}, {"type": "array"}, {"type": None}, {"properties": []}, {"properties": "x"}]
tool_names = st.one_of(st.sampled_from(TOOL_NAMES), st.from_regex(r"[A-Za-z0-9_\-]{1,20}", fullmatch=True))
tool_strategy = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": tool_names},
                                       optional={"description": texts(), "parameters": st.sampled_from(SCHEMAS),
                                                 "strict": st.booleans()})})
tool_lists = st.lists(tool_strategy, min_size=1, max_size=3)
TOOL_CHOICES = ["none", "auto", "required", None, "AUTO", "", {}, {"type": "function"},
                {"type": "function", "function": {"name": "get_weather"}},
                {"type": "function", "function": {"name": 5}},
                {"type": "function", "function": {}}, {"type": "retrieval", "function": {"name": "f"}}, ["auto"], 1]


def tool_choices(tools) -> st.SearchStrategy:
    names = [t["function"]["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
             and isinstance(t["function"].get("name"), str)] if isinstance(tools, list) else []
    named = [{"type": "function", "function": {"name": n}} for n in names]
    return st.sampled_from(TOOL_CHOICES + named + named)


arguments = st.sampled_from(['{"a": 1}', '{"broken', "", "null", '{"\\ud800": "<|tool_call_end|>"}', None,
                             {"a": [1, {"b": None}]}, {"deep": nested(50, kind="dict")}])
tool_calls = st.lists(st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": st.sampled_from(TOOL_NAMES + BAD_TOOL_NAMES)},
                                       optional={"arguments": arguments})},
    optional={"id": texts(12, False), "type": st.just("function")}), max_size=2)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts()}), min_size=1, max_size=3)
contents = st.one_of(texts(), text_parts, st.none())


@st.composite
def message(draw) -> dict:
    """A message the chat template takes: content None and tool calls for the assistant only."""
    role = draw(st.sampled_from(["system", "user", "user", "assistant", "tool", "developer"]))
    msg = {"role": role, "content": draw(st.one_of(texts(), text_parts) | (st.none() if role == "assistant" else
                                                                            st.nothing()))}
    optional = {"name": texts(12, False), "reasoning_content": texts()}
    if role == "tool":
        optional["tool_call_id"] = texts(12, False)
    if role == "assistant":
        optional["tool_calls"] = tool_calls
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=2)):
        msg[name] = draw(optional[name])
    return msg


BAD_MESSAGES = [{"role": "wizard", "content": "hi"}, {"role": "", "content": "x"}, {"role": "USER", "content": "x"},
                {"role": "\ud800", "content": "x"}, {"role": None, "content": "x"}, {"role": 5}, {"content": "x"},
                {"role": "user"}, {"role": "user", "content": 7}, {"role": "user", "content": {"text": "x"}},
                {"role": "user", "content": [["nested"]]}, {"role": "user", "content": [{"type": "text"}]},
                {"role": "user", "content": [{"type": "text", "text": 5}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
                {"role": "user", "content": [{"type": "text", "text": "x", "extra": nested(80, kind="dict")}]},
                {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
                {"role": "assistant", "tool_calls": "f"}, "just a string", None, [], 1]
messages = st.one_of(st.lists(message(), min_size=1, max_size=4),
                     st.lists(message(), min_size=0, max_size=2).flatmap(
                         lambda ms: st.fixed_dictionaries({"role": st.just("assistant"), "content": nonempty_texts()})
                         .map(lambda last: ms + [last])),  # ends with the assistant's text: echo, continue
                     st.just([{"role": "user", "content": "hi"}]))
TEMPLATE_KEYS = ["note", "note", "thinking", "tags", "tags", "self", "namespace", "messages", "tokenize", "tools",
                 "add_generation_prompt", "__class__", "__init__", "a b", "", "raise_exception", "enable_thinking",
                 "\ud800", "loop", "range", "cycler", "joiner", "lipsum", "dict", "__builtins__", "_", "0", "state",
                 "body", "header"]
"""note, thinking and tags are read by TEMPLATE_SUFFIX; the rest are the template's own names,
Python's, reserved ones (a 400) and odd ones (dropped, as the template does not read them)."""
template_kwargs = st.dictionaries(st.sampled_from(TEMPLATE_KEYS) | texts(8, False), json_values, max_size=4)

CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": messages,
    "max_tokens": small_max_tokens,
    "max_completion_tokens": small_max_tokens,
    "logprobs": st.booleans(),
    "top_logprobs": st.one_of(st.none(), ints_near(0, 20)),
    "tools": tool_lists,
    "tool_choice": st.sampled_from(TOOL_CHOICES),  # replaced by tool_choices(tools) when tools are drawn
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": template_kwargs,
    "echo": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "include_reasoning": st.booleans(),
}
TOKENIZE_FIELDS = {
    "model": SAMPLING_FIELDS["model"],
    "prompt": st.one_of(texts(), st.sampled_from(["x" * 200_000, "<|im_end|>" * 1000])),
    "messages": messages,
    "tools": tool_lists,
    "add_generation_prompt": st.booleans(),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.one_of(st.booleans(), st.none()),
    "chat_template_kwargs": template_kwargs,
}
DETOKENIZE_FIELDS = {
    "model": SAMPLING_FIELDS["model"],
    "tokens": st.one_of(st.lists(token_ids, max_size=30), st.just(list(range(VOCAB)) * 20), st.just([])),
}
BAD_FIELD_VALUES = {  # hostile values that are wrong in a way specific to the field, besides `hostile`
    "messages": st.one_of(st.lists(st.sampled_from(BAD_MESSAGES), min_size=1, max_size=3), st.just([])),
    "tools": st.sampled_from([[{"type": "function", "function": {"name": n}}] for n in BAD_TOOL_NAMES]
                             + [[{"type": "function", "function": {"parameters": s}}] for s in SCHEMAS[-4:]]
                             + [[None], [[]], {"type": "function"}, "f", [{"type": "function"}]]),
    "prompt": st.sampled_from(["", [], [[]], [""], ["a", 1], [True, False], [1, [2]], [-1], [VOCAB], [2**64],
                               [1.0], {"text": "x"}, [None], "x" * (BODY_LIMIT // 2)]),
    "tokens": st.sampled_from([[VOCAB], [2**64], [-1], [True], ["1"], [1.0], [[1]], None, "abc"]),
    "chat_template_kwargs": st.sampled_from([[], "x", 1, {"messages": []}, {"tokenize": True}, {"tools": None}]),
    "stop": st.sampled_from([[""], ["x" * 257], [f"s{i}" for i in range(65)], 5, [5], [None]]),
    "bad_words": st.sampled_from([[""], ["x" * 257], ["w"] * 65, "w", [5]]),
    "stop_token_ids": st.sampled_from([[-1], [VOCAB], [2**64], [10**9], [1.5], ["1"], 3]),
    "allowed_token_ids": st.sampled_from([[], [-1], [VOCAB], [2**64], [1, 10**9], [True], 3]),
    "n": st.sampled_from([0, -1, MAX_NUM_SEQS + 1, 1000, 2**64, 1.5, "2"]),
    "max_tokens": st.sampled_from([0, -1, MAX_MODEL_LEN + 1, 10**12, 2**64, 1.0, "ten"]),
    "max_completion_tokens": st.sampled_from([0, -1, MAX_MODEL_LEN + 1, 2**64, "x"]),
    "logprobs": st.sampled_from([21, -1, 2**64, 1.5, True, "3"]),
    "top_logprobs": st.sampled_from([21, -1, 2**64, 3.0]),
    "prompt_logprobs": st.sampled_from([21, -1, 2**64]),
    "tool_choice": st.sampled_from(TOOL_CHOICES),
    "stream_options": st.sampled_from([[], "yes", {"include_usage": "yes"}, {"continuous_usage_stats": True}]),
    "logit_bias": st.sampled_from([{"x": None}, [], "x", {"1": 1000}, {"-3": 1}, {"1.5": 1}, {str(10**9): 1},
                                   {"1": float("nan")}]),
    "response_format": st.sampled_from([{"type": "bogus"}, "text", {}, {"type": None}, {"type": "json_schema"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "nosuch"}}},
                                        {"type": "json_schema", "json_schema": {"schema": []}}]),
    "structured_outputs": st.sampled_from([{}, {"regex": "[0-"}, {"json": "{"}, {"choice": []}, "x", {"bogus": 1},
                                           {"regex": "a", "choice": ["b"]}, {"grammar": "root ::= ("},
                                           {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
                                           {"regex": "(a|b)*" * 200}, {"choice": [""]}]),
    "guided_regex": st.sampled_from(["((", "[z-a]"]),
    "guided_json": st.sampled_from(["not json", 5, {"type": 7}]),
    "thinking_token_budget": st.sampled_from([-1, "x", 2**64, 1.5]),
    "seed": st.sampled_from([2**64, -(2**63) - 1, 2**100, 1.0, "1"]),
    "top_k": st.sampled_from([-2, -(2**63), 1.5, "5"]),
    "temperature": st.sampled_from([-5e-324, -1e308, float("inf"), float("nan"), "hot"]),
}


def check_fields_cover(table: dict, model) -> None:
    missing = set(model.model_fields) - set(table)
    assert not missing, f"no strategy for the {model.__name__} fields {sorted(missing)}"


MAX_STEPS = 128
"""Engine steps a generated request may cost (one reply of 128 tokens, or 8 replies of 16)."""


def affordable(body: dict) -> None:
    """Keep valid requests cheap: a request that could cost more than MAX_STEPS engine steps
    (max_tokens None with 64 prompts, n = 8 with max_tokens 255) gets a smaller max_tokens."""
    prompt = body.get("prompt")
    k = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    n = body.get("n")
    rows = k * (n if isinstance(n, int) and 1 <= n <= MAX_NUM_SEQS else 1)
    batches = -(-rows // MAX_NUM_SEQS)
    names = [name for name in ("max_tokens", "max_completion_tokens") if name in body] or ["max_tokens"]
    for name in names:
        value = body.get(name)
        tokens = value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else MAX_MODEL_LEN
        if batches * tokens > MAX_STEPS and (value is None or tokens < MAX_MODEL_LEN or batches > 1):
            body[name] = max(1, min(8, MAX_STEPS // batches))


def consistent(body: dict) -> None:
    """Mend the combinations of valid values that are refused together (most of the time, so
    that most "valid" requests reach the engine)."""
    if body.get("stream_options") is not None:
        body["stream"] = True
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
    guided = [k for k in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar") if body.get(k) not in (None, {"type": "text"})]
    for k in guided[1:]:  # one kind of guided decoding per request
        body.pop(k)
    if guided and (body.get("tool_choice") not in (None, "none", "auto") and body.get("tools")):
        body.pop(guided[0])  # the reply of a forced tool call follows the tools' grammar
    if "max_thinking_tokens" in body and "thinking_token_budget" in body:
        body.pop("max_thinking_tokens")
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n") or 1
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if "min_tokens" in body and isinstance(limit, int) and limit < body["min_tokens"]:
        body["min_tokens"] = limit


@st.composite
def request_bodies(draw, table: dict, required: tuple[str, ...]):
    """A request body for one endpoint (`table`: its fields' valid strategies). Modes: valid (a few
    fields from their valid strategies, combinations that are refused together mostly mended),
    one_bad (one field hostile), many_bad (up to four), extras (UNSUPPORTED_FIELDS with inert or
    other values, and unknown fields, added). `required` fields are always drawn (and now and then
    left out when a field is bad)."""
    mode = draw(st.sampled_from(["valid", "valid", "valid", "valid", "one_bad", "many_bad", "extras"]))
    body = {}
    for name in required:
        body[name] = draw(table[name])
    for name in draw(st.lists(st.sampled_from(sorted(table)), unique=True, max_size=3 if mode == "valid" else 6)):
        body[name] = draw(table[name])
    if "tools" in body and "tool_choice" in table and draw(st.booleans()):
        body["tool_choice"] = draw(tool_choices(body["tools"]))
    if mode == "valid" and draw(st.integers(0, 3)):
        consistent(body)
    if mode in ("one_bad", "many_bad"):
        for name in draw(st.lists(st.sampled_from(sorted(table)), unique=True, min_size=1,
                                  max_size=1 if mode == "one_bad" else 4)):
            body[name] = draw(BAD_FIELD_VALUES[name] | hostile if name in BAD_FIELD_VALUES else hostile)
        if draw(st.integers(0, 4)) == 0 and required:
            body.pop(draw(st.sampled_from(required)), None)
    affordable(body)
    if mode == "extras" or (mode != "valid" and draw(st.booleans())):
        for name in draw(st.lists(st.sampled_from(sorted(UNSUPPORTED_FIELDS)), unique=True, min_size=1, max_size=3)):
            inert = list(UNSUPPORTED_FIELDS[name])
            body[name] = draw(st.sampled_from(inert) | hostile | st.just({"type": "object"}))
        body.update(draw(st.dictionaries(st.sampled_from(["metadata", "user_id", "store", "__proto__", "\ud800",
                                                          "service_tier", "x" * 300, ""]) | texts(10, False),
                                         json_values, max_size=3)))
    return body


# sending and checking ----------------------------------------------------------------------------
def encode_body(body, ascii_only: bool) -> bytes:
    """JSON as a client may send it: NaN/Infinity literals allowed; lone surrogates either escaped
    (ascii_only) or written as the invalid UTF-8 of a surrogate."""
    return json.dumps(body, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


def check_error(error_body, where: str) -> dict:
    assert isinstance(error_body, dict) and set(error_body) == {"error"}, \
        f"{where}: not an OpenAI error: {error_body!r}"
    error = error_body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, f"{where}: {error!r}"
    assert isinstance(error["message"], str) and error["message"].strip(), f"{where}: {error!r}"
    assert isinstance(error["type"], str) and error["type"], f"{where}: {error!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{where}: {error!r}"
    assert error["code"] is None or isinstance(error["code"], (str, int)), f"{where}: {error!r}"
    return error


def check_stream(text: str, where: str) -> None:
    lines = [line for line in text.split("\n") if line]
    assert lines, f"{where}: an empty stream"
    for line in lines:
        assert line.startswith("data: "), f"{where}: not an SSE data line: {line[:200]!r}"
    events = [line[len("data: "):] for line in lines]
    assert events[-1] == "[DONE]", f"{where}: the stream does not end with [DONE]: {text[-500:]!r}"
    assert "[DONE]" not in events[:-1], f"{where}: [DONE] before the end"
    for i, event in enumerate(events[:-1]):
        data = json.loads(event)
        if "error" in data:
            error = check_error(data, where)
            assert i == len(events) - 2, f"{where}: events after the error event: {events[i + 1:]}"
            assert error["type"] != "server_error" and error["code"] != "internal_error", \
                f"{where}: an internal error inside a 200 stream: {error}"


class Hostile:
    """The server under test, its client and its stderr read position (new ERROR lines or a
    traceback are pinned on the request that caused them)."""

    def __init__(self, server):
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT, follow_redirects=False)
        self.auth: dict = dict(AUTH)  # the next request's Authorization header (None: none sent)
        self.err_pos = 0

    def new_stderr(self) -> str:
        err = self.server.stderr()
        new, self.err_pos = err[self.err_pos:], len(err)
        return new

    def send(self, label: str, method: str, path: str, content: bytes | None = None,
             headers: dict | None = None, expect_stream: bool = False) -> httpx.Response:
        shown = content if isinstance(content, bytes) else b"<streamed>" if content is not None else b""
        where = f"{method} {path} {shown[:300]!r}{'...' if len(shown) > 300 else ''}"
        headers = {k: v for k, v in {**self.auth, **(headers or {})}.items() if v is not None}
        self.auth = dict(AUTH)
        t0 = time.monotonic()
        try:
            r = self.http.request(method, path, content=content, headers=headers)
        except httpx.TimeoutException:
            raise AssertionError(f"{where}: no answer in {REQUEST_TIMEOUT} s (a hang)") from None
        SENT[(label, r.status_code)] += 1
        if os.environ.get("KIMISERVE_HOSTILE_LOG"):
            with open(os.environ["KIMISERVE_HOSTILE_LOG"], "a") as f:
                f.write(f"{r.status_code} {time.monotonic() - t0:.3f} {where[:300]!r} {r.text[:300]!r}\n")
        self.check(r, where, method, expect_stream)
        return r

    def check(self, r: httpx.Response, where: str, method: str, expect_stream: bool) -> None:
        assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:1000]}"
        if method == "HEAD":
            pass  # no body to check
        elif 300 <= r.status_code < 400:
            assert r.headers.get("location"), f"{where}: a {r.status_code} without a Location"
        elif r.status_code >= 400:
            assert r.headers.get("content-type", "").startswith("application/json"), f"{where}: {r.headers}"
            try:
                body = r.json()
            except ValueError:
                raise AssertionError(f"{where}: a {r.status_code} whose body is not JSON: {r.text[:500]!r}") from None
            check_error(body, where)
        elif r.status_code < 300 and r.headers.get("content-type", "").startswith("text/event-stream"):
            check_stream(r.text, where)
        elif r.status_code < 300 and r.headers.get("content-type", "").startswith("application/json"):
            body = r.json()
            assert "error" not in body, f"{where}: {body}"
        if expect_stream and r.status_code == 200:
            assert r.headers["content-type"].startswith("text/event-stream"), f"{where}: {r.headers}"
        err = self.new_stderr()
        assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), \
            f"{where}: the server logged\n{err[-5000:]}"

    def alive(self) -> None:
        """/health is 200 and a one-token completion still succeeds."""
        r = self.http.get("/health")
        assert r.status_code == 200, f"/health after the request: {r.status_code} {r.text}"
        r = self.http.post(C, json={"prompt": "hi", "max_tokens": 1}, headers=AUTH)
        assert r.status_code == 200, f"the canary completion after the request: {r.status_code} {r.text}"
        assert r.json()["usage"]["completion_tokens"] == 1, r.text

    def post_json(self, path: str, body, ascii_only: bool, hang_up: bool = False) -> None:
        stream = isinstance(body, dict) and body.get("stream") is True
        content = encode_body(body, ascii_only)
        if hang_up:
            self.hang_up(path, content)
        else:
            self.send(f"POST {path}", "POST", path, content, {"Content-Type": "application/json"},
                      expect_stream=stream)
        self.alive()

    def hang_up(self, path: str, content: bytes) -> None:
        """Send the request and leave early: after the first line of a stream, or before the answer
        (a 50 ms read timeout); the server must abort what it started and free its pages."""
        label, where = f"POST {path} (hung up)", f"POST {path} {content[:300]!r} (hung up)"
        timeout = httpx.Timeout(REQUEST_TIMEOUT, read=0.05)
        with httpx.Client(base_url=self.server.url, timeout=timeout) as client:
            try:
                with client.stream("POST", path, content=content,
                                   headers={"Content-Type": "application/json", **AUTH}) as r:
                    SENT[(label, r.status_code)] += 1
                    assert r.status_code < 500, f"{where}: {r.status_code} {r.read()[:1000]!r}"
                    if r.status_code >= 400:
                        check_error(json.loads(r.read()), where)
                    else:
                        next(r.iter_lines(), None)  # the first line, then the connection closes
            except httpx.ReadTimeout:
                SENT[(label, "left")] += 1
        err = self.new_stderr()
        assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), \
            f"{where}: the server logged\n{err[-5000:]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = time.monotonic()
    template = tmp_path_factory.mktemp("hostile") / "chat_template.jinja"
    template.write_text(PACKAGED_TEMPLATE.read_text(encoding="utf-8") + TEMPLATE_SUFFIX, encoding="utf-8")
    with running_server(*SERVER_ARGS, "--chat-template", str(template)) as s:
        yield s
    summary = ", ".join(f"{label} {status}x{n}" for (label, status), n in sorted(SENT.items(), key=str))
    print(f"\nhostile: {sum(SENT.values())} generated requests in {time.monotonic() - started:.1f} s: {summary}")


@pytest.fixture(scope="module")
def h(server):
    hostile_client = Hostile(server)
    yield hostile_client
    hostile_client.http.close()


def test_strategies_cover_every_declared_field():
    check_fields_cover(COMPLETION_FIELDS, CompletionRequest)
    check_fields_cover(CHAT_FIELDS, ChatCompletionRequest)
    check_fields_cover(TOKENIZE_FIELDS, TokenizeRequest)
    check_fields_cover(DETOKENIZE_FIELDS, DetokenizeRequest)


hang_ups = st.sampled_from([False] * 7 + [True])
"""Now and then the client leaves early (see Hostile.hang_up)."""
auths = st.sampled_from([AUTH] * 60 + [{"Authorization": None}, {"Authorization": "Bearer wrong"},
                                       {"Authorization": f"bearer {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
                                       {"Authorization": "Basic aG9zdGlsZS1rZXk="}, {"Authorization": "Bearer"},
                                       {"Authorization": "Bearer " + "k" * 10000}])
"""The API key (--api-key: /v1 routes need it), now and then missing or wrong."""


@hostile_settings(140)
@given(body=request_bodies(COMPLETION_FIELDS, ("prompt", "max_tokens")), ascii_only=st.booleans(), hang_up=hang_ups,
       auth=auths)
def test_completions(h, body, ascii_only, hang_up, auth):
    h.auth = auth
    h.post_json(C, body, ascii_only, hang_up)


@hostile_settings(160)
@given(body=request_bodies(CHAT_FIELDS, ("messages", "max_tokens")), ascii_only=st.booleans(), hang_up=hang_ups,
       auth=auths)
def test_chat_completions(h, body, ascii_only, hang_up, auth):
    h.auth = auth
    h.post_json(CHAT, body, ascii_only, hang_up)


@hostile_settings(50)
@given(body=st.one_of(request_bodies(TOKENIZE_FIELDS, ("prompt",)), request_bodies(TOKENIZE_FIELDS, ("messages",))),
       ascii_only=st.booleans())
def test_tokenize(h, body, ascii_only):
    h.post_json(TOK, body, ascii_only)


@hostile_settings(40)
@given(body=request_bodies(DETOKENIZE_FIELDS, ("tokens",)), ascii_only=st.booleans())
def test_detokenize(h, body, ascii_only):
    h.post_json(DETOK, body, ascii_only)


MODEL_IDS = ["tiny", ALIAS, "kimi/alias-%C3%A9", "", "nope", "%00", "%ff", "%ed%a0%80", "..%2F..%2Fetc%2Fpasswd",
             "a/b/c", "tiny/", "x" * 3000, "%F0%9F%98%80", "tiny%20", "tiny?x=1", "%7B%7B7*7%7D%7D", "%3Cscript%3E"]
QUERIES = ["", "?", "?a=b&a=c", "?model=\u00e9", "?%ff=%00", "?x=" + "y" * 2000]


@hostile_settings(50)
@given(route=st.one_of(st.sampled_from(GET_ROUTES), st.just("/v1/models/{id}"),
                       st.sampled_from((C, CHAT, TOK, DETOK, "/", "/v1", "/v1/", "/health/", "/nope",
                                        "/openapi.json"))),
       model_id=st.sampled_from(MODEL_IDS), query=st.sampled_from(QUERIES),
       method=st.one_of(st.just("GET"), st.sampled_from(["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS",
                                                          "PREFLIGHT"])))
@example(route="/health", model_id="tiny", query="", method="GET")
@example(route="/version", model_id="tiny", query="", method="GET")
@example(route="/metrics", model_id="tiny", query="", method="GET")
@example(route="/v1/models", model_id="tiny", query="", method="GET")
@example(route="/v1/models/{id}", model_id=ALIAS, query="", method="GET")
def test_get_routes_and_methods(h, route, model_id, query, method):
    path = route.replace("{id}", model_id) + query
    headers = {}
    if method == "PREFLIGHT":  # CORS preflight: no API key, any origin
        method, headers = "OPTIONS", {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                                      "Authorization": None}
    label = f"{method} {route if route in GET_ROUTES + (C, CHAT, TOK, DETOK) else 'other'}"
    h.send(label, method, path, b"{}" if method in ("POST", "PUT", "PATCH") else None, headers)
    h.alive()


def deep_body(path: str, depth: int, where: str) -> bytes:
    """A body with a list or object nested `depth` deep at `where`, written as text (json.dumps
    itself refuses to go that deep)."""
    open_, close = ("[" * depth, "]" * depth) if where != "object" else ('{"a":' * depth, "}" * depth)
    inner = open_ + "1" + close
    base = {C: '"prompt": "x", "max_tokens": 1',
            CHAT: '"messages": [{"role": "user", "content": "x"}], "max_tokens": 1',
            TOK: '"prompt": "x"', DETOK: '"tokens": [1]'}[path]
    field = {C: "prompt", CHAT: "chat_template_kwargs", TOK: "prompt", DETOK: "tokens"}[path]
    if where == "tools" and path == CHAT:
        return (f'{{{base}, "tool_choice": "required", "tools": [{{"type": "function", "function": {{"name": "f", '
                f'"parameters": {{"type": "object", "properties": {{"a": {inner}}}}}}}}}]}}').encode()
    if where == "content" and path in (CHAT, TOK):
        return (f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "x", "x": {inner}}}]}}], '
                f'"max_tokens": 1}}').encode()
    if where == "arguments" and path in (CHAT, TOK):
        return (f'{{"messages": [{{"role": "user", "content": "x"}}, {{"role": "assistant", "tool_calls": '
                f'[{{"id": "a", "function": {{"name": "f", "arguments": {{"a": {inner}}}}}}}]}}, '
                f'{{"role": "user", "content": "y"}}], "max_tokens": 1}}').encode()
    if where == "template" and path in (CHAT, TOK):
        return (f'{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": 1, '
                f'"chat_template_kwargs": {{"note": {inner}, "tags": {inner}}}}}').encode()
    if where == "unknown":
        return f'{{{base}, "metadata": {inner}}}'.encode()
    if where == "top":
        return inner.encode()
    return f'{{{base}, "{field}": {{"x": {inner}}}}}'.encode() if where == "object" else \
        f'{{{base}, "{field}": {inner}}}'.encode()


VALID_C = b'{"prompt": "hi", "max_tokens": 2}'
RAW_BODIES = [
    b"", b"{", b"}", b"[", b"null", b"true", b"1", b'"str"', b"[]", b"{}", b'{"prompt": "x",}', b"{'prompt': 'x'}",
    b'{"prompt": "x"} trailing', b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}', b"\xff\xfe\x00",
    b'{"prompt": "\xff"}',
    b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}', b'{"prompt": "\\ud800", "max_tokens": 1, "echo": true}',
    b'{"prompt": "x", "prompt": [1, 2], "max_tokens": 1}', b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "x", "seed": -' + b"9" * 4300 + b"}",
    b'{"prompt": "x", "temperature": -Infinity}', b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "n": 1.0}',
    b'{"prompt": "x", "max_tokens": 1, "stream": true, "stream_options": {"include_usage": true}}',
    b"\x00" * 10, '{"prompt": "x", "max_tokens": 1}'.encode("utf-16"), '{"prompt": "x"}'.encode("utf-32"),
    b'{"prompt": "x", "max_tokens": 1}\x00', b'{"prompt": "\x00\x01\x1f", "max_tokens": 1}',
    b'{"prompt": "x", "max_tokens": 1, "stop": "\\u0000"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"tokens": [1, 2, 3]}', b'{"tokens": [1e2]}', b'{"tokens": [01]}', b'{"prompt": "x", "max_tokens": +1}',
    b'{"prompt": "x", "max_tokens": 0x10}', b'{"prompt": "x", "max_tokens": 1, "user": "' + b"\\" * 5 + b'"}',
]


@st.composite
def raw_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["fixed", "fixed", "binary", "truncated", "flipped", "deep"]))
    if kind == "fixed":
        return draw(st.sampled_from(RAW_BODIES))
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        return VALID_C[:draw(st.integers(0, len(VALID_C) - 1))]
    if kind == "flipped":
        i = draw(st.integers(0, len(VALID_C) - 1))
        return VALID_C[:i] + bytes([draw(st.integers(0, 255))]) + VALID_C[i + 1:]
    return b"deep"  # replaced in the test, which knows the path


@hostile_settings(70)
@given(path=st.sampled_from([C, CHAT, TOK, DETOK]), body=raw_bodies(),
       depth=st.sampled_from([50, 500, 900, 990, 1100, 5000, 100_000]),
       where=st.sampled_from(["list", "object", "tools", "content", "arguments", "template", "unknown", "top"]),
       content_type=st.sampled_from(["application/json", "application/json", "text/plain", None,
                                     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                     "application/json; charset=latin-1"]))
def test_raw_bodies(h, path, body, depth, where, content_type):
    if body == b"deep":
        body = deep_body(path, depth, where)
    headers = {"Content-Type": content_type} if content_type else {}
    h.send(f"POST {path}", "POST", path, body, headers)
    h.alive()


RAW_METHODS = [b"GET", b"POST", b"POST", b"HEAD", b"OPTIONS", b"DELETE", b"G\xc3\xa9T", b"PRI", b"", b"get", b"GET /x"]
RAW_TARGETS = [b"/health", b"/version", b"/metrics", b"/v1/models", b"/v1/models/tiny", C.encode(), CHAT.encode(),
               TOK.encode(), DETOK.encode(), b"*", b"http://evil/v1/models", b"/v1/models/a b", b"/v1/models/\xc3\xa9",
               b"/%", b"/%zz", b"//v1//models", b"/v1/models/..", b"/v1/models/%2e%2e", b"/" + b"a" * 20000, b"",
               b"/\x00", b"/\x7f", b"/v1/completions?%ff=%00", b"/v1/completions#frag"]
RAW_VERSIONS = [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9",
                b"HTTP/1.1 x", b"", b"http/1.1"]
RAW_HOSTS = [b"Host: 127.0.0.1", b"Host: 127.0.0.1", None, b"Host: ", b"Host: \xff", b"Host: a\r\nHost: b"]
RAW_HEADERS = [b"X-A: " + b"a" * 20000, b"X-\xff: y", b"X-A: \x00", b"no colon", b" folded: x", b"Content-Type: \xff",
               b"Content-Type: application/json", b"Expect: 100-continue", b"Expect: teapot",
               b"Upgrade: h2c\r\nConnection: Upgrade", b"Authorization: Bearer \xc3\xa9", b"Origin: null",
               b"Accept-Encoding: gzip, br", b"Content-Encoding: gzip", b"Transfer-Encoding: chunked, chunked",
               b": empty-name", b"X-A:" + b" " * 5000, b"Origin: http://\xc3\xa9", b"Authorization: Bearer \xff",
               b"Access-Control-Request-Method: POST\r\nOrigin: http://x", b"Access-Control-Request-Headers: \xff"]
RAW_REQUEST_BODIES = [b"", VALID_C, b'{"prompt": "hi", "max_tokens": 2, "stream": true}', b"{", b"\xff" * 10,
                      b'{"tokens": [1, 2]}', b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}']


@st.composite
def raw_http_requests(draw) -> tuple[list[bytes], bytes]:
    """(the methods, the bytes): a request line, headers and a body framed right or wrong (never a
    body shorter than its Content-Length: that is the stalled-body case, 1 s each), now and then
    after a good request on the same connection."""
    method = draw(st.sampled_from(RAW_METHODS))
    line = b" ".join(x for x in (method, draw(st.sampled_from(RAW_TARGETS)), draw(st.sampled_from(RAW_VERSIONS))) if x)
    headers = [h for h in [draw(st.sampled_from(RAW_HOSTS))] if h is not None]
    if draw(st.integers(0, 3)):
        headers.append(b"Authorization: " + AUTH["Authorization"].encode())
    headers += draw(st.lists(st.sampled_from(RAW_HEADERS), unique=True, max_size=3))
    body = draw(st.sampled_from(RAW_REQUEST_BODIES))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "bad-length", "negative-length",
                                    "two-lengths", "bad-chunk", "te-gzip", "length-short", "te-and-length"]))
    if framing in ("length", "te-and-length"):
        headers.append(b"Content-Length: %d" % len(body))
    if framing in ("chunked", "te-and-length"):
        headers.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif framing == "bad-length":
        bad = [b"abc", b"1e3", b"0x10", b"", b"+5", b"99999999999999999999"]
        headers.append(b"Content-Length: " + draw(st.sampled_from(bad)))
    elif framing == "negative-length":
        headers.append(b"Content-Length: -1")
    elif framing == "two-lengths":
        headers += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif framing == "bad-chunk":
        headers.append(b"Transfer-Encoding: chunked")
        body = draw(st.sampled_from([b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabcdef\r\n0\r\n\r\n", b"-1\r\n\r\n",
                                     b"ffffffffffffffffffff\r\nab\r\n", b"0\r\nX-Trailer: \xff\r\n\r\n"]))
    elif framing == "te-gzip":
        headers.append(b"Transfer-Encoding: gzip")
    elif framing == "length-short" and body:
        headers.append(b"Content-Length: %d" % draw(st.integers(0, len(body) - 1)))  # the rest: a next "request"
    headers.append(b"Connection: close")
    data = line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body
    if draw(st.integers(0, 3)) == 0:  # pipelined after a good request on the same connection
        return [b"GET", method], b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + data
    return [method], data


def raw_exchange(port: int, data: bytes, methods: list[bytes]) -> tuple[list[tuple[int, dict, bytes]], bytes]:
    """Send bytes on a fresh connection and read to EOF; the (status, headers, body) of each final
    response, in order (one per request in `methods`, fewer if the server closed before), and the
    bytes received."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server answered and closed before reading it all
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"{data[:300]!r}: no answer and no close in {REQUEST_TIMEOUT} s") from None
    conn = h11.Connection(h11.CLIENT)
    responses: list[tuple[int, dict, bytes]] = []
    for i, method in enumerate(methods):
        if i:
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                break  # the server closed after the previous response
            conn.start_next_cycle()
        conn.send(h11.Request(method=b"HEAD" if method == b"HEAD" else b"GET", target=b"/", headers=[(b"host", b"x")]))
        conn.send(h11.EndOfMessage())
        if i == 0:
            conn.receive_data(got)
            conn.receive_data(b"")
        status, headers, body = None, {}, b""
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)) or event is h11.NEED_DATA:
                break
        if status is None:
            break
        responses.append((status, headers, body))
    return responses, got


@hostile_settings(80)
@given(request=raw_http_requests())
def test_raw_http(h, server, request):
    methods, data = request
    where = f"raw {data[:300]!r}"
    responses, got = raw_exchange(server.port, data, methods)
    assert len(responses) == len(methods), \
        f"{where}: {len(responses)} responses to {len(methods)} requests: {got[:500]!r}"
    for method, (status, headers, body) in zip(methods, responses):
        assert status < 500, f"{where}: {got[:1000]!r}"
        if status >= 400 and method != b"HEAD":
            assert headers.get("content-type", "").startswith("application/json"), f"{where}: {got[:1000]!r}"
            check_error(json.loads(body), where)
        elif 200 <= status < 300 and headers.get("content-type", "").startswith("text/event-stream"):
            check_stream(body.decode(), where)
    SENT[("RAW http", responses[-1][0])] += 1
    err = h.new_stderr()
    assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), \
        f"{where}: the server logged\n{err[-5000:]}"
    h.alive()


# fixed cases: the body limit, a stalled body -----------------------------------------------------
def test_bodies_over_the_limit_are_413(h):
    over = b'{"prompt": "' + b"x" * (BODY_LIMIT - 13) + b'"}'
    assert len(over) == BODY_LIMIT + 1
    r = h.send(f"POST {C}", "POST", C, over, {"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    h.alive()

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 4096 + 1):
            yield b"y" * 4096
        yield b'"}]}'
    r = h.send(f"POST {CHAT}", "POST", CHAT, chunks(), {"Content-Type": "application/json"})
    assert r.status_code == 413
    h.alive()
    at_limit = b'{"prompt": "' + b"z" * (BODY_LIMIT - 14) + b'"}'  # exactly the limit: read, then too long a prompt
    r = h.send(f"POST {TOK}", "POST", TOK, at_limit, {"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] > MAX_MODEL_LEN
    r = h.send(f"POST {C}", "POST", C, at_limit, {"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    h.alive()


def test_stalled_body_is_408(h, server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        data = b""
        while chunk := s.recv(65536):  # --body-read-timeout 1: a 408, then the server closes
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    SENT[(f"POST {C} (stalled)", status)] += 1
    assert status == 408, data
    error = check_error(json.loads(body), "a stalled body")
    assert "--body-read-timeout" in error["message"]
    h.new_stderr()  # the server logs a WARNING for it
    h.alive()


def test_no_leaked_pages_once_idle(server, h):
    assert sum(SENT.values()) >= 200, SENT
    assert {label.split()[1] for label, _ in SENT} >= {C, CHAT, TOK, DETOK, *GET_ROUTES, "http"}, SENT
    assert any(label == f"POST {C}" and status == 200 for label, status in SENT)
    assert any(label == f"POST {CHAT}" and status == 200 for label, status in SENT)

    def idle():
        m = metrics(server.url)
        return m["kimiserve:num_requests_running"] == 0 and m["kimiserve:num_requests_waiting"] == 0 \
            and m["kimiserve:cache_pages_used_by_requests"] == 0
    assert wait_until(idle, timeout=10), metrics(server.url)
    h.alive()
