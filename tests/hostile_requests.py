"""Request generators and answer checks for tests/test_server_hostile.py (which describes them): the
server's configuration, the per-endpoint field tables of hypothesis strategies, `request_bodies`,
and the checks of error bodies and streams."""

from __future__ import annotations

import json
import os
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kimiserve.entrypoints.openai.protocol import UNSUPPORTED_FIELDS
from kimiserve.tokenizer.tokenizer import load_tokenizer

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
