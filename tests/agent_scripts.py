"""The scripted conversations of the agent-API tests (test_server_messages.py, test_server_responses.py):
chat prompts the scripted tiny model (tests/scripted_model.py) answers with Kimi-format text, and
the server that serves it (one per session: the `agent_server` fixture of conftest.py).

The Messages and Responses requests of the tests are translated by the server into these chat
conversations; a translation that renders anything else gets noise back, so the tests fail."""

from __future__ import annotations

import json

from scripted_model import chat_prompt_ids, tiny_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER]
FORCED = "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions."  # tool_choice required / any
NAMED = FORCED + "get_weather:0<|tool_call_argument_begin|>"  # tool_choice get_weather
PARIS_Q, MATH_Q, OSLO_Q, ROME_Q = ("What's the weather in Paris?", "What is 2 + 2?", "Weather in Oslo, please.",
                                   "And in Rome?")
LISBON_Q, SYSTEM = "Weather in Lisbon?", "You answer weather questions."
SUNNY = "Sunny, 21 C"
PARIS_ARGS = '{"city":"Paris"}'


def call(index: int, args: str, name: str = "get_weather") -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def prompt_ids(messages: list[dict], tools: list[dict] | None = None, forced: str = "", **template_kwargs) -> list[int]:
    tok = tiny_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **template_kwargs)
                      + forced)


def tool_turn(question: str, reasoning: str, args: str, result: str, system: str | None = None) -> list[dict]:
    """The chat form of: the question, the assistant's call of get_weather, its result."""
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + user(question) + [
        {"role": "assistant", "content": "", "reasoning_content": reasoning,
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": result}]


PARIS_REPLY = "<think>Check the weather.</think><|tool_calls_section_begin|>" + call(0, PARIS_ARGS) + \
    "<|tool_calls_section_end|>"
PARIS_ANSWER = "It is sunny in Paris, 21 C."
MATH_ANSWER = "2 + 2 = 4."
LISBON_ARGS = '{"city":"Lisbon"}'
LISBON_ANSWER = "Lisbon: sunny."

SCRIPTS = [
    (chat_prompt_ids(user(PARIS_Q), TOOLS), PARIS_REPLY),
    (chat_prompt_ids(tool_turn(PARIS_Q, "Check the weather.", PARIS_ARGS, SUNNY), TOOLS),
     "<think>Report it.</think>" + PARIS_ANSWER),
    (chat_prompt_ids(user(MATH_Q)), "<think>Add the numbers.</think>" + MATH_ANSWER),
    (prompt_ids(user(MATH_Q), thinking=False), "4."),
    (prompt_ids(user(OSLO_Q), TOOLS, FORCED), 'get_weather:0<|tool_call_argument_begin|>{"city":"Oslo"}'
     "<|tool_call_end|><|tool_calls_section_end|>"),
    (prompt_ids(user(ROME_Q), TOOLS, NAMED), '{"city":"Rome"}<|tool_call_end|><|tool_calls_section_end|>'),
    # Responses: instructions are the system turn
    (chat_prompt_ids([{"role": "system", "content": SYSTEM}] + user(LISBON_Q), TOOLS),
     "<think>Look it up.</think><|tool_calls_section_begin|>" + call(0, LISBON_ARGS) + "<|tool_calls_section_end|>"),
    (chat_prompt_ids(tool_turn(LISBON_Q, "Look it up.", LISBON_ARGS, SUNNY, SYSTEM), TOOLS),
     "<think>Say it.</think>" + LISBON_ANSWER),
]


def dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# the OpenAI Agents SDK's conversation (test_server_responses.py runs it against the server) ----------
SDK_INSTRUCTIONS, SDK_QUESTION, SDK_ANSWER = "You answer weather questions.", "Weather in Lisbon?", LISBON_ANSWER


def sdk_agent(client):
    """The Agents SDK agent of the tests: one function tool, greedy, on the Responses model."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return SUNNY if city == "Lisbon" else "Unknown city."

    return Agent(name="weather", instructions=SDK_INSTRUCTIONS, tools=[get_weather],
                 model=OpenAIResponsesModel(model="kimi-agent", openai_client=client),
                 model_settings=ModelSettings(temperature=0))


def sdk_request_bodies() -> list[dict]:
    """The Responses request bodies the SDK sends for SDK_QUESTION, captured by running the agent on a
    mock transport whose replies are the scripted ones (so the second body carries the first reply
    as input, as it will against the server)."""
    import asyncio

    import httpx
    from agents import Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    bodies: list[dict] = []
    replies = [[{"id": "rs_1", "type": "reasoning", "summary": [], "status": "completed",
                 "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                {"id": "fc_1", "type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
                 "arguments": LISBON_ARGS, "status": "completed"}],
               [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": SDK_ANSWER, "annotations": []}]}]]

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={
            "id": f"resp_{len(bodies)}", "object": "response", "created_at": 0, "status": "completed",
            "model": "kimi-agent", "output": replies[len(bodies) - 1], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "usage": {
                "input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}})

    client = AsyncOpenAI(base_url="http://mock/v1", api_key="k",
                         http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    result = asyncio.run(Runner.run(sdk_agent(client), SDK_QUESTION))
    assert result.final_output == SDK_ANSWER and len(bodies) == 2
    return bodies


def responses_prompt_ids(body: dict) -> list[int]:
    """The prompt the server renders for a Responses request body (its own translation, then the
    chat template as render_chat applies it)."""
    from kimiserve.entrypoints.openai.chat_bridge import chat_request
    from kimiserve.entrypoints.openai.protocol_responses import ResponsesRequest
    from kimiserve.entrypoints.openai.serving_chat import template_messages
    from kimiserve.entrypoints.openai.serving_responses import chat_body

    chat = chat_request(chat_body(ResponsesRequest.model_validate(body), []))
    tok = tiny_tokenizer()
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []] or None
    return tok.encode(tok.apply_chat_template(template_messages(chat.messages), tools=tools,
                                              add_generation_prompt=True))


def sdk_scripts() -> list[tuple[list[int], str]]:
    """The two turns of the SDK's conversation, or none when openai-agents is not installed."""
    try:
        import agents  # noqa: F401
    except ImportError:
        return []
    first, second = sdk_request_bodies()
    return [(responses_prompt_ids(first), "<think>Look it up.</think><|tool_calls_section_begin|>"
             + call(0, LISBON_ARGS) + "<|tool_calls_section_end|>"),
            (responses_prompt_ids(second), "<think>Say it.</think>" + SDK_ANSWER)]
