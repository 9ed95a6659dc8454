"""POST /v1/responses, GET / DELETE /v1/responses/{id}: the OpenAI Responses API, run as a chat
completion (`chat_bridge`).

Request -> chat: `instructions` is the system turn (not carried over by previous_response_id, as
OpenAI does); the stored conversation of `previous_response_id` comes first, then `input` (a
string is one user message). Items become chat turns: messages by role (developer: system), a
reasoning item the reasoning of the assistant turn it starts, function_call items that turn's
tool calls (call ids not in the Kimi form are mapped: `chat_bridge.CallIds`), function_call_output
items tool turns. Function tools and `tool_choice` are chat's; `max_output_tokens`,
`temperature`, `top_p`, `parallel_tool_calls` likewise; `text.format` json_object/json_schema is
chat's `response_format`; `reasoning.effort` "none" sets the chat template's thinking switch off.

Chat -> response: reasoning (with `--reasoning-parser kimi`) is a `reasoning` item (its text as
one reasoning_text part, no summary), content an assistant `message` item with one output_text
part, each tool call a `function_call` item (call_id: the Kimi call id); status "incomplete"
(incomplete_details.reason max_output_tokens) when the output was cut by the token limit.
Usage: input_tokens (cached_tokens: read from the prefix cache), output_tokens (reasoning_tokens:
the reasoning text's token count), total_tokens. `store` (default true) keeps the response in the
server's memory (`response_store`). A stream sends response.created, response.in_progress, per
item output_item.added, content_part.added, the deltas (reasoning_text / output_text /
function_call_arguments), their .done, content_part.done, output_item.done, then
response.completed (or response.incomplete), every event with its sequence_number; an error
after the start is an `error` event then response.failed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kimiserve.entrypoints.openai.chat_bridge import CallIds, ChatStream, PromptInfo, chat_request, run_chat, stream_chat
from kimiserve.entrypoints.openai.errors import JSONResponse, OpenAIError, to_json
from kimiserve.entrypoints.openai.protocol_responses import (
    FunctionCallItem, FunctionCallOutputItem, MessageItem, NamedFunction, ReasoningItem, ResponsesRequest,
    unsupported_responses_field)
from kimiserve.entrypoints.openai.response_store import ResponseStore
from kimiserve.entrypoints.openai.serving_utils import ServingContext, SSEResponse


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# request -> chat ------------------------------------------------------------------------------------
def items_to_messages(items: list[Any], ids: CallIds) -> list[dict[str, Any]]:
    """Responses input items (validated models) -> chat messages."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being built

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for item in items:
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn["content"] or turn.get("tool_calls") or "reasoning_content" in turn):
                flush()
            turn = turn or {"role": "assistant", "content": ""}
            turn["reasoning_content"] = item.text()
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                flush()
            turn = turn or {"role": "assistant", "content": ""}
            turn["content"] = item.text()
        elif isinstance(item, FunctionCallItem):
            turn = turn or {"role": "assistant", "content": ""}
            turn.setdefault("tool_calls", []).append(
                {"id": ids.call(item.call_id, item.name), "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            messages.append({"role": "tool", "tool_call_id": ids.result(item.call_id), "content": item.text()})
        else:
            flush()
            messages.append({"role": item.role, "content": item.text()})
    flush()
    return messages


def input_items(req: ResponsesRequest) -> list[Any]:
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request body of a Responses request continuing `history` (item dicts)."""
    name = unsupported_responses_field(req)
    if name is not None:
        raise OpenAIError(f"{name} is not supported by this server; leave it out", 400, name)
    past = ResponsesRequest.model_validate({"input": history}).input if history else []
    messages = items_to_messages(list(past) + input_items(req), CallIds())
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if messages[-1]["role"] == "assistant":
        raise OpenAIError("the input ends with an assistant turn: end it with a user message or a "
                          "function_call_output", 400, "input")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_none=True)} for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    for field, chat_field in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_tokens"),
                              ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, field) is not None:
            body[chat_field] = getattr(req, field)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict,
                              "description": fmt.description}.items() if v is not None}}
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"thinking": False}
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# chat -> response -----------------------------------------------------------------------------------
def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class _Job:
    """One Responses request: the response object's fields and, once done, the stored entry."""

    def __init__(self, ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, model: str):
        self.ctx, self.store, self.req, self.model = ctx, store, req, model
        self.id = item_id("resp")
        self.created = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) \
            else req.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": tool_choice, "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}

    def usage(self, prompt_tokens: int, output_tokens: int, reasoning: str, prompt: PromptInfo) -> dict[str, Any]:
        tokenizer = self.ctx.tokenizer
        reasoning_tokens = len(tokenizer.encode(reasoning)) if reasoning and tokenizer is not None else 0
        return {"input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": prompt.cached_tokens or 0, "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
                "total_tokens": prompt_tokens + output_tokens}

    def keep(self, response: dict[str, Any]) -> None:
        """Store the finished response (event loop only: the store is not locked)."""
        if self.req.store is not False:
            turn = [item.model_dump(exclude_none=True) for item in input_items(self.req)]
            self.store.put(response, turn + response["output"], self.req.previous_response_id)

    def from_chat(self, chat: dict[str, Any], prompt: PromptInfo) -> dict[str, Any]:
        choice = chat["choices"][0]
        m = choice["message"]
        output = []
        if m.get("reasoning_content"):
            output.append(reasoning_item(m["reasoning_content"]))
        if m.get("content"):
            output.append(message_item(m["content"]))
        for call in m.get("tool_calls") or []:
            output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        if status == "incomplete" and output:
            output[-1]["status"] = "incomplete"  # the item the token limit cut
        u = chat["usage"]
        return self.response(status, output, self.usage(u["prompt_tokens"], u["completion_tokens"],
                                                        m.get("reasoning_content") or "", prompt))


class _ResponseStream:
    """Chat chunks -> Responses stream events."""

    def __init__(self, job: _Job, stream: ChatStream):
        self.job, self.stream = job, stream
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # the kind of the last item while it is open
        self.text = ""  # the open item's text (or arguments) so far
        self.reasoning = ""
        self.finish: str | None = None
        self.prompt_tokens = self.output_tokens = 0

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {to_json(payload)}\n\n"

    def _item_ref(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.output.append(item)
        self.open, self.text = kind, ""
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item={**item, "status": "in_progress"}))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}.get(kind)
        if part is not None:
            out.append(self._event("response.content_part.added", **self._item_ref(), content_index=0, part=part))
        return out

    def _close(self) -> list[str]:
        kind, text = self.open, self.text
        if kind is None:
            return []
        item, ref = self.output[-1], self._item_ref()
        out = []
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            out.append(self._event("response.reasoning_text.done", **ref, content_index=0, text=text))
            out.append(self._event("response.content_part.done", **ref, content_index=0, part=part))
        elif kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self._event("response.output_text.done", **ref, content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", **ref, content_index=0, part=part))
        else:
            item["arguments"] = text
            out.append(self._event("response.function_call_arguments.done", **ref, name=item["name"],
                                   arguments=text))
        item["status"] = "incomplete" if self.finish == "length" else "completed"  # the last item, when cut
        out.append(self._event("response.output_item.done", output_index=ref["output_index"], item=item))
        self.open = None
        return out

    def translate(self, chunk: dict[str, Any]) -> list[str]:
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens, self.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "reasoning":
                    out += self._open("reasoning", {**reasoning_item(""), "content": []})
                self.text += delta["reasoning_content"]
                self.reasoning += delta["reasoning_content"]
                out.append(self._event("response.reasoning_text.delta", **self._item_ref(), content_index=0,
                                       delta=delta["reasoning_content"]))
            if delta.get("content"):
                if self.open != "message":
                    out += self._open("message", {**message_item(""), "content": []})
                self.text += delta["content"]
                out.append(self._event("response.output_text.delta", **self._item_ref(), content_index=0,
                                       delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id") is not None:
                    out += self._open("function_call", call_item(call["id"], fn.get("name") or "", ""))
                if fn.get("arguments") and self.open == "function_call":
                    self.text += fn["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", **self._item_ref(),
                                           delta=fn["arguments"]))
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return out

    async def events(self) -> AsyncIterator[str]:
        job = self.job
        try:
            skeleton = job.response("in_progress", [], None)
            yield self._event("response.created", response=skeleton)
            yield self._event("response.in_progress", response=skeleton)
            async for chunk in self.stream.chunks:
                if "error" in chunk:
                    error = chunk["error"]
                    for text in self._close():
                        yield text
                    yield self._event("error", code=str(error.get("code")), message=error.get("message", "error"),
                                      param=error.get("param"))
                    yield self._event("response.failed", response=job.response(
                        "failed", self.output, None, {"code": str(error.get("code")), "message": error.get("message")}))
                    return
                for text in self.translate(chunk):
                    yield text
            for text in self._close():
                yield text
            status = "incomplete" if self.finish == "length" else "completed"
            usage = job.usage(self.prompt_tokens, self.output_tokens, self.reasoning, self.stream.prompt)
            response = job.response(status, self.output, usage)
            job.keep(response)
            yield self._event(f"response.{status}", response=response)
        finally:
            self.stream.close()


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    history = store.history(req.previous_response_id) if req.previous_response_id is not None else []
    chat = chat_request(chat_body(req, history))
    job = _Job(ctx, store, req, model)
    if req.stream:
        stream = await stream_chat(ctx, chat, raw)
        return SSEResponse(_ResponseStream(job, stream).events(), stream.close, ctx.stream_send_timeout)
    result, prompt = await run_chat(ctx, chat, raw)
    if isinstance(result, Response):
        return result
    response = await ctx.run_blocking(job.from_chat, result, prompt)
    job.keep(response)
    return JSONResponse(response)
