"""POST /v1/responses (the OpenAI Responses API) with the official `openai` client and the OpenAI Agents
SDK, unmodified, against a real server on the scripted tiny model (tests/agent_scripts.py): function
tools, reasoning items, a multi-turn tool loop through previous_response_id and
function_call_output, streaming events in order, the store, errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from agent_scripts import (  # noqa: E402
    FORCED, LISBON_ANSWER, LISBON_ARGS, LISBON_Q, MATH_ANSWER, MATH_Q, OSLO_Q, PARIS_ANSWER, PARIS_ARGS, PARIS_Q,
    ROME_Q, SDK_ANSWER, SDK_QUESTION, SUNNY, SYSTEM, WEATHER, sdk_agent)
from conftest import API_KEY  # noqa: E402

pytestmark = pytest.mark.fixed_threads  # the server runs with one torch thread: OMP_NUM_THREADS changes nothing

TOOL = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def client(agent_server):
    return openai.OpenAI(base_url=agent_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def create(client, input, **kw):
    kw.setdefault("max_output_tokens", 100)
    return client.responses.create(model="kimi-agent", input=input, temperature=0, **kw)


def test_function_call_then_output_via_previous_response_id(client):
    first = create(client, PARIS_Q, tools=[TOOL])
    assert first.object == "response" and first.status == "completed" and first.model == "kimi-agent"
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["Check the weather."]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert call.call_id == "functions.get_weather:0" and call.id.startswith("fc_")
    assert first.usage.input_tokens > 0 and first.usage.total_tokens == first.usage.input_tokens + \
        first.usage.output_tokens and 0 < first.usage.output_tokens_details.reasoning_tokens < first.usage.output_tokens
    second = create(client, [{"type": "function_call_output", "call_id": call.call_id, "output": SUNNY}],
                    tools=[TOOL], previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.status == "completed"
    assert second.output_text == PARIS_ANSWER and second.output[0].type == "reasoning"
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt came from the prefix cache
    assert client.responses.retrieve(second.id).output_text == PARIS_ANSWER
    # the same conversation sent whole, as items (the client's own output items passed back)
    whole = create(client, [{"role": "user", "content": PARIS_Q}] + [o.model_dump(exclude_none=True)
                                                                     for o in first.output]
                   + [{"type": "function_call_output", "call_id": call.call_id, "output": SUNNY}], tools=[TOOL])
    assert whole.output_text == PARIS_ANSWER


def test_instructions_and_message_items(client):
    first = create(client, [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": LISBON_Q}]}],
                   instructions=SYSTEM, tools=[TOOL])
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.arguments == LISBON_ARGS
    second = create(client, [{"type": "function_call_output", "call_id": call.call_id, "output": SUNNY}],
                    instructions=SYSTEM, tools=[TOOL], previous_response_id=first.id)
    assert second.output_text == LISBON_ANSWER and second.instructions == SYSTEM
    # foreign call ids (call_...) are mapped onto Kimi ids
    foreign = create(client, [{"role": "user", "content": PARIS_Q},
                              {"type": "reasoning", "id": "rs_x", "summary": [{"type": "summary_text",
                                                                             "text": "Check the weather."}]},
                              {"type": "function_call", "call_id": "call_abc", "name": "get_weather",
                               "arguments": PARIS_ARGS},
                              {"type": "function_call_output", "call_id": "call_abc", "output": SUNNY}], tools=[TOOL])
    assert foreign.output_text == PARIS_ANSWER
    plain = create(client, MATH_Q)
    assert plain.output_text == MATH_ANSWER and [o.type for o in plain.output] == ["reasoning", "message"]
    off = create(client, MATH_Q, reasoning={"effort": "none"})
    assert off.output_text == "4." and [o.type for o in off.output] == ["message"]
    cut = create(client, MATH_Q, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_tool_choice_required_and_named(client):
    required = create(client, OSLO_Q, tools=[TOOL], tool_choice="required")
    assert [json.loads(o.arguments) for o in required.output if o.type == "function_call"] == [{"city": "Oslo"}]
    named = create(client, ROME_Q, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert [json.loads(o.arguments) for o in named.output if o.type == "function_call"] == [{"city": "Rome"}]
    assert FORCED  # the scripts answer the forced prompts (agent_scripts.py)


def test_stream_events_in_documented_order(client):
    with client.responses.stream(model="kimi-agent", input=PARIS_Q, tools=[TOOL], temperature=0,
                                 max_output_tokens=100) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    reasoning_events = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or not k.endswith(".delta")]
    assert squeezed == kinds[:2] + reasoning_events + call_events + ["response.completed"], squeezed
    assert final.status == "completed" and [o.type for o in final.output] == ["reasoning", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    # the tool loop's second turn streamed: output_text events, stored for the next turn
    with client.responses.stream(model="kimi-agent", temperature=0, tools=[TOOL], previous_response_id=final.id,
                                 input=[{"type": "function_call_output", "call_id": final.output[1].call_id,
                                         "output": SUNNY}]) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        second = stream.get_final_response()
    assert text == PARIS_ANSWER == second.output_text
    assert client.responses.retrieve(second.id).previous_response_id == final.id


def test_agents_sdk_runs_unmodified(agent_server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    async def run():
        client = openai.AsyncOpenAI(base_url=agent_server.base_url, api_key=API_KEY, max_retries=0)
        result = await agents.Runner.run(sdk_agent(client), SDK_QUESTION)
        streamed = agents.Runner.run_streamed(sdk_agent(client), SDK_QUESTION)
        kinds = [event.type async for event in streamed.stream_events()]
        await client.close()
        return result, streamed, kinds

    result, streamed, kinds = asyncio.run(run())
    assert result.final_output == SDK_ANSWER
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == 1 and json.loads(calls[0].raw_item.arguments) == {"city": "Lisbon"}
    assert [o.output for o in outputs] == [SUNNY]
    assert streamed.final_output == SDK_ANSWER and "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_store_and_errors(agent_server, client):
    unstored = create(client, MATH_Q, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, "hi", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id" and info.value.body["code"] == "response_not_found"
    kept = create(client, MATH_Q, max_output_tokens=2)
    assert httpx.delete(f"{agent_server.base_url}/responses/{kept.id}",
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    url, auth = f"{agent_server.base_url}/responses", {"Authorization": f"Bearer {API_KEY}"}
    for body, param in [({}, "input"), ({"input": []}, "input"), ({"input": "x", "max_output_tokens": 0},
                                                                   "max_output_tokens"),
                        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
                        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
                        ({"input": "x", "background": True}, "background"),
                        ({"input": "x", "max_output_tokens": 10**6}, "max_tokens"),
                        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
                        ({"input": "x", "temperature": "hot"}, "temperature")]:
        r = httpx.post(url, json={"model": "kimi-agent", **body}, headers=auth, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert (error["param"] or "").startswith(param), (body, error)
    assert httpx.post(url, json={"input": "x"}).status_code == 401
    assert httpx.post(url, json={"model": "gpt-nope", "input": "x"}, headers=auth).status_code == 404
