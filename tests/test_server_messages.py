"""POST /v1/messages (the Anthropic Messages API) with the official `anthropic` client against a real
server on the scripted tiny model (tests/agent_scripts.py): tools, a tool_result turn, thinking
blocks, streaming, stop sequences, tool_choice any / tool, count_tokens, error shapes, x-api-key."""

from __future__ import annotations

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from agent_scripts import (  # noqa: E402
    FORCED, MATH_ANSWER, MATH_Q, OSLO_Q, PARIS_ANSWER, PARIS_Q, ROME_Q, SUNNY, TOOLS, WEATHER, prompt_ids, user)
from scripted_model import tiny_tokenizer  # noqa: E402
from conftest import API_KEY  # noqa: E402

pytestmark = pytest.mark.fixed_threads  # the server runs with one torch thread: OMP_NUM_THREADS changes nothing

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(agent_server):
    return anthropic.Anthropic(base_url=agent_server.url, api_key=API_KEY, max_retries=0, timeout=60)


def create(client, messages, **kw):
    kw.setdefault("max_tokens", 100)
    return client.messages.create(model="kimi-agent", messages=messages, extra_body=GREEDY, **kw)


PARIS = [{"role": "user", "content": PARIS_Q}]


def tool_result_turn(first) -> list[dict]:
    """The conversation after the first reply (passed back as the client got it) and the tool's result."""
    call = next(b for b in first.content if b.type == "tool_use")
    return PARIS + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": SUNNY}]}]


def test_tool_use_then_tool_result_turn(client):
    first = create(client, PARIS, tools=[TOOL])
    assert first.type == "message" and first.role == "assistant" and first.model == "kimi-agent"
    assert first.id.startswith("msg_") and first.stop_reason == "tool_use" and first.stop_sequence is None
    thinking, use = first.content
    assert thinking.type == "thinking" and thinking.thinking == "Check the weather."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id == "functions.get_weather:0"
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens > 0 and first.usage.output_tokens > 5
    second = create(client, tool_result_turn(first), tools=[TOOL])
    assert second.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("thinking", None), ("text", PARIS_ANSWER)]
    assert second.content[0].thinking == "Report it."


def test_foreign_tool_use_ids_are_mapped(client):
    """A conversation whose tool_use ids came from elsewhere (toolu_...) renders like the server's own."""
    history = PARIS + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Check the weather.", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_01ABC", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01ABC",
                                      "content": [{"type": "text", "text": SUNNY}]}]}]
    reply = create(client, history, tools=[TOOL])
    assert reply.content[-1].text == PARIS_ANSWER and reply.stop_reason == "end_turn"


def test_stream_with_tools(client):
    with client.messages.stream(model="kimi-agent", max_tokens=100, messages=PARIS, tools=[TOOL],
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert events[0].message.usage.input_tokens + (events[0].message.usage.cache_read_input_tokens or 0) > 0
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert {"thinking_delta", "signature_delta", "input_json_delta"} <= deltas
    assert kinds.count("content_block_stop") == 2
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris"}
    assert final.content[0].thinking == "Check the weather."
    # the same conversation's tool_result turn, streamed: text deltas
    first = create(client, PARIS, tools=[TOOL])
    with client.messages.stream(model="kimi-agent", max_tokens=100, messages=tool_result_turn(first),
                                tools=[TOOL], extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == PARIS_ANSWER and final.stop_reason == "end_turn" and final.usage.output_tokens > 5
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count(client, tool_result_turn(first))


def count(client, messages, **kw) -> int:
    return client.messages.count_tokens(model="kimi-agent", messages=messages, tools=[TOOL], **kw).input_tokens


def test_count_tokens_matches_usage(client):
    reply = create(client, PARIS, tools=[TOOL])
    assert count(client, PARIS) == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model="kimi-agent", messages=PARIS).input_tokens < count(client, PARIS)


def test_thinking_switch_stop_sequences_and_max_tokens(client):
    math = [{"role": "user", "content": MATH_Q}]
    on = create(client, math, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in on.content] == ["thinking", "text"] and on.content[1].text == MATH_ANSWER
    off = create(client, math, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "4."
    stopped = create(client, math, stop_sequences=["= "])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "= "
    assert stopped.content[-1].text == "2 + 2 "
    cut = create(client, math, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    system = create(client, math, system=[{"type": "text", "text": "Be brief."}])  # off script, but served
    assert system.stop_reason in ("end_turn", "max_tokens")


def test_thinking_budget_and_thinking_off_with_a_forced_call(client):
    """budget_tokens is the engine's thinking budget: after 2 tokens of the scripted reasoning `</think>`
    is forced. With thinking disabled a forced call starts right after the template's empty
    `<think></think>` (one, not two: the prompt counted is exactly that)."""
    tok = tiny_tokenizer()
    two = tok.decode(tok.encode("Add the numbers.")[:2])
    cut = create(client, [{"role": "user", "content": MATH_Q}], max_tokens=8,
                 thinking={"type": "enabled", "budget_tokens": 2})
    assert cut.content[0].type == "thinking" and cut.content[0].thinking == two
    off = {"thinking": {"type": "disabled"}, "tool_choice": {"type": "any"}}
    expected = prompt_ids(user(OSLO_Q), TOOLS, FORCED.removeprefix("<think></think>"), thinking=False)
    assert count(client, [{"role": "user", "content": OSLO_Q}], **off) == len(expected)
    reply = create(client, [{"role": "user", "content": OSLO_Q}], tools=[TOOL], max_tokens=30, **off)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(expected)
    assert [b.type for b in reply.content][-1] == "tool_use"  # the grammar completes the call off script


def test_tool_choice_any_and_named(client):
    any_ = create(client, [{"role": "user", "content": OSLO_Q}], tools=[TOOL], tool_choice={"type": "any"})
    assert any_.stop_reason == "tool_use" and [b.input for b in any_.content if b.type == "tool_use"] == [
        {"city": "Oslo"}]
    named = create(client, [{"role": "user", "content": ROME_Q}], tools=[TOOL],
                   tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in named.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Rome"} and named.stop_reason == "tool_use"
    with client.messages.stream(model="kimi-agent", max_tokens=100, messages=[{"role": "user", "content": ROME_Q}],
                                tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Rome"}]
    none = create(client, PARIS, tools=[TOOL], tool_choice={"type": "none"}, max_tokens=5)
    assert all(b.type != "tool_use" for b in none.content)


def test_error_shapes_and_auth(agent_server, client):
    url = f"{agent_server.url}/v1/messages"
    ok = {"model": "kimi-agent", "max_tokens": 4, "messages": PARIS}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, {"x-api-key": API_KEY}, 400, "invalid_request_error"),
        ({**ok, "model": "claude-nope"}, {"x-api-key": API_KEY}, 404, "not_found_error"),
        (ok, {"x-api-key": "wrong"}, 401, "authentication_error"),
        (ok, {}, 401, "authentication_error"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         {"x-api-key": API_KEY}, 400, "invalid_request_error"),
        ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, {"x-api-key": API_KEY}, 400,
         "invalid_request_error"),
        ({**ok, "tool_choice": {"type": "tool"}, "tools": [TOOL]}, {"x-api-key": API_KEY}, 400,
         "invalid_request_error"),
        ({**ok, "max_tokens": 100000}, {"x-api-key": API_KEY}, 400, "invalid_request_error"),
        ({**ok, "messages": [{"role": "system", "content": "x"}]}, {"x-api-key": API_KEY}, 400,
         "invalid_request_error"),
        ({**ok, "temperature": 1.5}, {"x-api-key": API_KEY}, 400, "invalid_request_error"),
        ({**ok, "mcp_servers": [{"url": "x"}]}, {"x-api-key": API_KEY}, 400, "invalid_request_error"),
    ]
    for body, headers, status, kind in cases:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == status, (body, r.text)
        data = r.json()
        assert data["type"] == "error" and data["error"]["type"] == kind and data["error"]["message"], data
    for r, status in ((httpx.get(url, headers={"x-api-key": API_KEY}), 405),
                      (httpx.post(url + "/nope", json=ok, headers={"x-api-key": API_KEY}), 404)):
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["message"], r.text
    bad_json = httpx.post(url, content=b"{", headers={"x-api-key": API_KEY, "content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"
    assert httpx.post(url, json=ok, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=agent_server.url, api_key="wrong", max_retries=0).messages.create(
            model="kimi-agent", max_tokens=4, messages=PARIS)
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", max_tokens=4, messages=PARIS)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="kimi-agent", messages=[])
