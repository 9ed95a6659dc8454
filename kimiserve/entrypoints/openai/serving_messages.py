"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API, run as a chat
completion (`chat_bridge`).

Request -> chat: `system` is the system turn; a user message's `tool_result` blocks become tool
turns (in order, text blocks between them user turns); an assistant message's `thinking` blocks
are its reasoning, `tool_use` blocks its tool calls (ids not in the Kimi form are mapped:
`chat_bridge.CallIds`); a final assistant message is continued (prefill). `tool_choice` auto /
any / tool / none is chat's auto / required / the named function / none (`disable_parallel_tool_use`:
one call); `thinking` disabled / enabled sets the chat template's `thinking` switch
(`chat_template_kwargs`) and `budget_tokens` is chat's `thinking_token_budget` (then `</think>` is
forced); `output_config.format` (or `output_format`) json_schema is chat's `response_format`
(grammar-guided); `stop_sequences` are stop strings.

Chat -> response: reasoning is a `thinking` block (with `--reasoning-parser kimi`; its signature
is empty), content a `text` block, each tool call a `tool_use` block whose id is the Kimi call id
and whose input is the arguments as a JSON object (arguments that are not one are returned as
{"_raw_arguments": TEXT}); stop_reason: tool_use when there are calls, max_tokens, stop_sequence
(with the stop string) or end_turn. Usage: input_tokens are the prompt tokens not read from the
prefix cache, cache_read_input_tokens those that were. A stream sends message_start (once the
engine took the prompt, so its usage has the input tokens), ping, then per block
content_block_start / content_block_delta (text_delta, thinking_delta then a signature_delta,
input_json_delta) / content_block_stop, then message_delta (stop_reason, usage) and message_stop;
an error after the start is an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kimiserve.entrypoints.openai.chat_bridge import (
    CallIds, ChatStream, PromptInfo, chat_request, parse_arguments, run_chat, stream_chat)
from kimiserve.entrypoints.openai.errors import ANTHROPIC_TYPES, JSONResponse, OpenAIError, to_json
from kimiserve.entrypoints.openai.protocol_messages import (
    UNSUPPORTED_MESSAGES_FIELDS, CountTokensRequest, Message, MessagesRequest, TextBlock, ThinkingBlock,
    ToolResultBlock, ToolUseBlock)
from kimiserve.entrypoints.openai.serving_chat import plan_tools, render_chat
from kimiserve.entrypoints.openai.serving_utils import ServingContext, SSEResponse

OPENAI_TO_ANTHROPIC_TYPE = {"server_error": "api_error", "service_unavailable": "overloaded_error",
                            "invalid_request_error": "invalid_request_error"}


# request -> chat ------------------------------------------------------------------------------------
def _assistant(message: Message, ids: CallIds) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    text, reasoning, calls = [], [], []
    for block in message.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": ids.call(block.id, block.name), "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False,
                                                                          separators=(",", ":"))}})
        elif isinstance(block, ToolResultBlock):
            raise OpenAIError("tool_result blocks belong in user messages", 400, "messages")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _user(message: Message, ids: CallIds) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = block.text()
            out.append({"role": "tool", "tool_call_id": ids.result(block.tool_use_id),
                        "content": f"Error: {result}" if block.is_error else result})
        else:
            raise OpenAIError(f"{block.type} blocks belong in assistant messages", 400, "messages")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool | None]:
    choice = req.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError("tool_choice of type 'tool' needs the tool's name", 400, "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat completion request body of a Messages (or count_tokens) request."""
    extra = req.model_extra or {}
    for name in UNSUPPORTED_MESSAGES_FIELDS:
        if extra.get(name) is not None:
            raise OpenAIError(f"{name} is not supported by this server; leave it out", 400, name)
    ids = CallIds()
    messages: list[dict[str, Any]] = []
    system = req.system_text()
    if system is not None:
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        messages += [_assistant(m, ids)] if m.role == "assistant" else _user(m, ids)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    last = req.messages[-1]
    if last.role == "assistant":  # prefill: the reply continues the final assistant message
        if messages[-1].get("tool_calls") or not messages[-1]["content"]:
            raise OpenAIError("a final assistant message is continued, so it must be text (send the tool_result "
                              "in a user message to answer a tool_use)", 400, f"messages[{len(req.messages) - 1}]")
        body.update(continue_final_message=True, add_generation_prompt=False)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice, parallel = _tool_choice(req)
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if req.thinking is not None and req.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"thinking": req.thinking.type == "enabled"}
    fmt = req.output_config.format if req.output_config is not None and req.output_config.format else \
        req.output_format
    if fmt is not None:
        if req.output_config is not None and req.output_config.format and req.output_format:
            raise OpenAIError("give output_config.format or output_format, not both", 400, "output_format")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        if req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
            body["thinking_token_budget"] = req.thinking.budget_tokens
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        if req.stream:
            body.update(stream=True, stream_options={"include_usage": True})
    return body


# chat -> response -----------------------------------------------------------------------------------
def _stop_reason(finish: str | None, stop: Any) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(prompt_tokens: int, output_tokens: int, cached: int | None) -> dict[str, Any]:
    cached = cached or 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_input(arguments: str) -> dict[str, Any]:
    parsed = parse_arguments(arguments)
    return parsed if parsed is not None else {"_raw_arguments": arguments}


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def message_response(chat: dict[str, Any], prompt: PromptInfo) -> dict[str, Any]:
    choice = chat["choices"][0]
    m = choice["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for call in m.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    usage = chat["usage"]
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(usage["prompt_tokens"], usage["completion_tokens"], prompt.cached_tokens)}


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {to_json({'type': kind, **data})}\n\n"


def error_event(error: dict[str, Any]) -> str:
    kind = OPENAI_TO_ANTHROPIC_TYPE.get(error.get("type"), ANTHROPIC_TYPES.get(error.get("code"), "api_error"))
    return event("error", {"error": {"type": kind, "message": error.get("message", "error")}})


class _MessageStream:
    """Chat chunks -> Messages stream events."""

    def __init__(self, stream: ChatStream, model: str):
        self.stream, self.model = stream, model
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.output_tokens = 0
        self.prompt_tokens: int | None = None

    def _close(self) -> list[str]:
        out = []
        if self.open == "thinking":
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        if self.open is not None:
            out.append(event("content_block_stop", {"index": self.index}))
        self.open = None
        return out

    def _block(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        out = []
        if self.open != kind:
            start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}[kind]
            out = self._block(kind, start)
        return out + [event("content_block_delta", {"index": self.index, "delta": delta})]

    def translate(self, chunk: dict[str, Any]) -> list[str]:
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage["prompt_tokens"]
            self.output_tokens = usage["completion_tokens"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                out += self._delta("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id") is not None:
                    out += self._block("tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name"),
                                                    "input": {}})
                if fn.get("arguments") and self.open == "tool_use":
                    out.append(event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}}))
            if choice.get("finish_reason") is not None:
                self.stop = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))
        return out

    def start(self, chat_id: str) -> str:
        prompt = self.stream.prompt
        message = {"id": message_id(chat_id), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(prompt.prompt_tokens or 0, 0, prompt.cached_tokens)}
        return event("message_start", {"message": message}) + event("ping", {})

    async def events(self) -> AsyncIterator[str]:
        pending: list[dict[str, Any]] = []
        started = False
        chat_id = ""
        try:
            async for chunk in self.stream.chunks:
                if "error" in chunk:
                    if not started:
                        yield self.start(chat_id)
                    yield error_event(chunk["error"])
                    return
                chat_id = chunk.get("id", chat_id)
                if not started:
                    # message_start reports the input tokens: wait until the engine has taken the prompt
                    pending.append(chunk)
                    if self.stream.prompt.prompt_tokens is None and not chunk.get("usage"):
                        continue
                    started = True
                    yield self.start(chat_id)
                    chunks, pending = pending, []
                else:
                    chunks = [chunk]
                for c in chunks:
                    for text in self.translate(c):
                        yield text
            if not started:
                yield self.start(chat_id)
                for c in pending:
                    for text in self.translate(c):
                        yield text
            for text in self._close():
                yield text
            prompt = self.stream.prompt
            prompt_tokens = self.prompt_tokens if self.prompt_tokens is not None else prompt.prompt_tokens or 0
            yield event("message_delta", {"delta": {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]},
                                          "usage": _usage(prompt_tokens, self.output_tokens, prompt.cached_tokens)})
            yield event("message_stop", {})
        finally:
            self.stream.close()


async def create_message(ctx: ServingContext, req: MessagesRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    chat = chat_request(chat_body(req))
    if req.stream:
        stream = await stream_chat(ctx, chat, raw)
        return SSEResponse(_MessageStream(stream, model).events(), stream.close, ctx.stream_send_timeout)
    result, prompt = await run_chat(ctx, chat, raw)
    if isinstance(result, Response):
        return result
    result["model"] = model
    return JSONResponse(message_response(result, prompt))


async def count_tokens(ctx: ServingContext, req: CountTokensRequest) -> Response:
    ctx.check_model(req.model)
    chat = chat_request(chat_body(req))
    plan = plan_tools(ctx, chat)
    size = sum(len(m.text() or "") for m in chat.messages)

    def count() -> int:
        text = render_chat(ctx, chat.messages, chat.tools if plan.choice != "none" else None,
                           chat.add_generation_prompt, chat.chat_template_kwargs, chat.continue_final_message)
        return len(ctx.need_tokenizer("count_tokens").encode(text + plan.forced))

    return JSONResponse({"input_tokens": await ctx.maybe_blocking(size, count)})
