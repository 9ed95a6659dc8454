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
