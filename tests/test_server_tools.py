"""Tool calls and reasoning through the server, on the scripted tiny model (tests/scripted_model.py):
greedy decoding answers the chat prompts below with the scripted Kimi-format text."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from scripted_model import chat_prompt_ids, make_scripted_checkpoint, tiny_tokenizer  # noqa: E402
from server_utils import running_server  # noqa: E402

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER]
FORCED = "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions."  # tool_choice required
NAMED = FORCED + "get_weather:0<|tool_call_argument_begin|>"  # tool_choice get_weather


def call(index: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.get_weather:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PARIS, BOTH, MATH = user("What's the weather in Paris?"), user("Compare the weather in Paris and Tokyo."), \
    user("What is 2 + 2?")
OSLO, ROME = user("Weather in Oslo, please."), user("And in Rome?")


def forced_prompt(messages: list[dict], forced: str) -> list[int]:
    tok = tiny_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True) + forced)


SCRIPTS = [
    (chat_prompt_ids(PARIS, TOOLS), "<think>Check the weather.</think><|tool_calls_section_begin|>"
     + call(0, '{"city":"Paris"}') + "<|tool_calls_section_end|>"),
    (chat_prompt_ids(BOTH, TOOLS), "<think>Two cities.</think><|tool_calls_section_begin|>"
     + call(0, '{"city":"Paris"}') + call(1, '{"city":"Tokyo"}') + "<|tool_calls_section_end|>"),
    (chat_prompt_ids(MATH), "<think>Add the numbers.</think>2 + 2 = 4."),
    (forced_prompt(OSLO, FORCED), 'get_weather:0<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
     "<|tool_calls_section_end|>"),
    (forced_prompt(ROME, NAMED), '{"city":"Rome"}<|tool_call_end|><|tool_calls_section_end|>'),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), SCRIPTS)
    with running_server("--model", str(path), "--dtype", "float32", "--max-model-len", "512", "--num-pages", "400",
                        "--reasoning-parser", "kimi", "--tool-call-parser", "kimi_k2",
                        "--enable-auto-tool-choice") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def ask(client, messages, **kw):
    kw.setdefault("max_tokens", 100)
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          temperature=0, **kw)


def collect_stream(client, messages, **kw):
    """(reasoning, content, {index: {"id", "name", "arguments", "headers"}}, finish_reason) of a stream."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in ask(client, messages, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": "", "headers": 0})
                if tc.id is not None or (tc.function and tc.function.name is not None):
                    entry["headers"] += 1
                    entry["id"], entry["name"] = tc.id, tc.function.name
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_auto_single_call(client):
    choice = ask(client, PARIS, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Check the weather."
    assert choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.id == "functions.get_weather:0" and tc.type == "function"
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


def test_auto_single_call_streamed(client):
    reasoning, content, calls, finish = collect_stream(client, PARIS, tools=TOOLS)
    assert reasoning == "Check the weather." and content == "" and finish == "tool_calls"
    assert calls == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city":"Paris"}',
                         "headers": 1}}  # id and name once, then argument deltas


def test_parallel_calls(client):
    message = ask(client, BOTH, tools=TOOLS).choices[0].message
    assert [(t.id, json.loads(t.function.arguments)) for t in message.tool_calls] == [
        ("functions.get_weather:0", {"city": "Paris"}), ("functions.get_weather:1", {"city": "Tokyo"})]
    _, _, calls, finish = collect_stream(client, BOTH, tools=TOOLS)
    assert finish == "tool_calls" and [c["arguments"] for c in calls.values()] == ['{"city":"Paris"}',
                                                                                  '{"city":"Tokyo"}']
    assert all(c["headers"] == 1 for c in calls.values())
    only_first = ask(client, BOTH, tools=TOOLS, parallel_tool_calls=False).choices[0].message.tool_calls
    assert [t.id for t in only_first] == ["functions.get_weather:0"]


def test_reasoning_and_content_without_tools(client):
    choice = ask(client, MATH).choices[0]
    assert choice.message.content == "2 + 2 = 4." and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == "Add the numbers."
    assert not choice.message.tool_calls
    reasoning, content, calls, finish = collect_stream(client, MATH)
    assert (reasoning, content, calls, finish) == ("Add the numbers.", "2 + 2 = 4.", {}, "stop")


def test_tool_choice_required(client):
    choice = ask(client, OSLO, tools=TOOLS, tool_choice="required").choices[0]
    (tc,) = choice.message.tool_calls
    assert (tc.id, tc.function.name, json.loads(tc.function.arguments)) == (
        "functions.get_weather:0", "get_weather", {"city": "Oslo"})
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] is None
    _, content, calls, finish = collect_stream(client, OSLO, tools=TOOLS, tool_choice="required")
    assert content == "" and finish == "tool_calls"
    assert calls == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city":"Oslo"}',
                         "headers": 1}}


def test_tool_choice_named(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = ask(client, ROME, tools=TOOLS, tool_choice=named).choices[0]
    (tc,) = choice.message.tool_calls
    assert (tc.id, tc.function.name, json.loads(tc.function.arguments)) == (
        "functions.get_weather:0", "get_weather", {"city": "Rome"})
    assert choice.finish_reason == "tool_calls"
    _, _, calls, finish = collect_stream(client, ROME, tools=TOOLS, tool_choice=named)
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["headers"] == 1
    assert calls[0]["arguments"] == '{"city":"Rome"}'


def test_tool_choice_none_does_not_render_or_parse_tools(server, client):
    out = ask(client, PARIS, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert out.usage.prompt_tokens == len(chat_prompt_ids(PARIS)) < len(chat_prompt_ids(PARIS, TOOLS))
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason != "tool_calls"


def test_agent_loop_messages_are_accepted(server, client):
    """The assistant turn with tool calls and the tool result go back in, as agent frameworks send them."""
    first = ask(client, PARIS, tools=TOOLS).choices[0].message
    history = PARIS + [first.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temp_c": 21}'}]
    out = ask(client, history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("max_tokens", [1, 2, 4, 6])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_cut_short_parse_the_same_streamed_or_not(client, choice, max_tokens):
    """A forced call that max_tokens cuts is the same tool call streamed and not streamed (what it
    has so far), and the markup the server appended to force it never shows as content."""
    messages, tool_choice = (OSLO, "required") if choice == "required" else (
        ROME, {"type": "function", "function": {"name": "get_weather"}})
    choice_ = ask(client, messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens).choices[0]
    whole = {i: {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments, "headers": 1}
             for i, tc in enumerate(choice_.message.tool_calls or [])}
    _, content, calls, finish = collect_stream(client, messages, tools=TOOLS, tool_choice=tool_choice,
                                               max_tokens=max_tokens)
    assert calls == whole and finish == choice_.finish_reason
    assert (choice_.message.content or "") == content
    assert "<|" not in content and "functions." not in content
    if choice == "named":  # the header is forced: a call exists however short the reply
        assert whole[0]["name"] == "get_weather" and '{"city":"Rome"}'.startswith(whole[0]["arguments"])


def test_forced_call_on_a_random_model_is_completed_by_the_grammar():
    """On a random model, `required` forcing "...functions." alone would rarely get a valid header; the
    tool-call grammar completes it (a call to a declared function), and no markup reaches content
    even when max_tokens cuts the call short."""
    with running_server("--max-model-len", "512", "--num-pages", "400") as s:
        for stream in (False, True):
            r = httpx.post(f"{s.base_url}/chat/completions", timeout=60, json={
                "messages": OSLO, "tools": TOOLS, "tool_choice": "required", "max_tokens": 12, "temperature": 0,
                "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
                names = [tc["function"].get("name") for e in events if e["choices"]
                         for tc in e["choices"][0]["delta"].get("tool_calls") or []]
            else:
                message = r.json()["choices"][0]["message"]
                content = message["content"] or ""
                names = [tc["function"]["name"] for tc in message["tool_calls"]]
            assert "<|tool_call" not in content and not content.startswith("functions.")
            assert "get_weather" in names


def test_chat_echo_include_reasoning_and_prompt_controls(server, client):
    tok = tiny_tokenizer()
    # include_reasoning=false drops the <think> part from the reply
    out = ask(client, MATH, extra_body={"include_reasoning": False}).choices[0].message
    assert out.content == "2 + 2 = 4." and out.model_extra.get("reasoning_content") is None
    reasoning, content, _, _ = collect_stream(client, MATH, extra_body={"include_reasoning": False})
    assert (reasoning, content) == ("", "2 + 2 = 4.")
    # continue_final_message: the prompt ends inside the final (assistant) message, with no end of turn
    partial = MATH + [{"role": "assistant", "content": "The sum is"}]
    body = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    full = tok.apply_chat_template(partial, add_generation_prompt=False)
    expected = full[: full.rfind("The sum is") + len("The sum is")]
    r = ask(client, partial, max_tokens=3, extra_body=body)
    assert r.usage.prompt_tokens == len(tok.encode(expected)) < len(tok.encode(full))
    assert r.choices[0].message.content.startswith("The sum is")  # echo: the reply starts with it
    _, streamed, _, _ = collect_stream(client, partial, max_tokens=3, extra_body=body)
    assert streamed.startswith("The sum is")
    # add_generation_prompt=false: no assistant header after the conversation
    r = ask(client, MATH, max_tokens=2, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(MATH, add_generation_prompt=False)))
