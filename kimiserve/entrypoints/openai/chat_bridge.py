"""The agent APIs (/v1/messages, /v1/responses) run as chat completions in-process, as vLLM's
Anthropic endpoint does: each translates its request into a `ChatCompletionRequest` body, runs
`create_chat_completion` (the chat template, tool planning, sampling, the reasoning and tool
parsers: one code path, so what chat completions gains, e.g. grammar-enforced tool calls, the
agent APIs gain too) and translates the chat result or chunk stream into its own shapes.

Also here: Kimi tool-call ids for conversations whose ids came from elsewhere (`CallIds`), and
the arguments text of a call as a JSON object (`parse_arguments`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response

from kimiserve.engine.async_engine import OutputSink
from kimiserve.engine.outputs import RequestOutput
from kimiserve.entrypoints.openai.errors import OpenAIError, from_validation_error
from kimiserve.entrypoints.openai.protocol import ChatCompletionRequest
from kimiserve.entrypoints.openai.serving_chat import create_chat_completion
from kimiserve.entrypoints.openai.serving_utils import ServingContext, SSEResponse, abort_all

KIMI_CALL_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*):([0-9]+)")
"""The Kimi tool-call id the model writes in a call's header: functions.NAME:INDEX."""


class CallIds:
    """Tool-call ids as the chat template needs them. The model writes (and this server returns) ids
    `functions.NAME:INDEX`; a conversation built elsewhere may carry other ids (`toolu_...`,
    `call_...`): each is mapped, the first time it is seen, to `functions.NAME:N` with N counting
    the conversation's calls, and its results are rendered under the same id."""

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}
        self._count = 0

    def call(self, call_id: str | None, name: str) -> str:
        if call_id is not None and call_id in self._ids:
            return self._ids[call_id]
        match = KIMI_CALL_ID.fullmatch(call_id or "")
        kimi = call_id if match is not None and match.group(1) == name else f"functions.{name}:{self._count}"
        self._count += 1
        if call_id is not None:
            self._ids[call_id] = kimi
        return kimi

    def result(self, call_id: str) -> str:
        """The id a tool result is rendered under (its call's, when the call was seen)."""
        return self._ids.get(call_id, call_id)


def parse_arguments(text: str) -> dict[str, Any] | None:
    """A call's arguments as a JSON object, or None when they are not one (an empty text is {})."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of a translated body; a value the chat API refuses is a 400 naming its field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise OpenAIError("the request is nested too deeply", 400) from None


class _CountingSink(OutputSink):
    """An OutputSink that keeps the first output's prompt size (a stream's token counts come only at
    its end; the Messages API reports the input tokens in its first event)."""

    def __init__(self, *args: Any, on_first: Callable[[RequestOutput], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_first = on_first

    def put_nowait(self, item: Any) -> None:
        if self._on_first is not None and isinstance(item, RequestOutput):
            self._on_first(item)
            self._on_first = None
        super().put_nowait(item)


@dataclass
class PromptInfo:
    """What the engine reported about the prompt, once its first output came (None before)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class ChatStream:
    """A running streamed chat completion: its chunks as dicts (the last may be {"error": ...})."""

    chunks: AsyncIterator[dict[str, Any]]
    close: Callable[[], None]
    """Aborts its engine request (idempotent): pass it as the on_close of the translated response."""
    prompt: PromptInfo = field(default_factory=PromptInfo)


def _counting_ctx(ctx: ServingContext, prompt: PromptInfo) -> ServingContext:
    def first(out: RequestOutput) -> None:
        prompt.prompt_tokens = len(out.prompt_token_ids)
        prompt.cached_tokens = out.num_cached_tokens

    def new_sink(request_ids: list[str]) -> OutputSink:
        return _CountingSink(ctx.max_queued_output_bytes, abort_all(ctx.engine, request_ids), on_first=first)

    counted = copy.copy(ctx)
    counted.new_sink = new_sink  # type: ignore[method-assign]
    return counted


async def run_chat(ctx: ServingContext, req: ChatCompletionRequest,
                   raw: Request) -> tuple[dict[str, Any] | Response, PromptInfo]:
    """A non-streaming chat completion: its response body (or the Response to return as it is: the
    client left, 499) and what the engine said about the prompt."""
    prompt = PromptInfo()
    response = await create_chat_completion(_counting_ctx(ctx, prompt), req, raw)
    if response.status_code != 200:
        return response, prompt
    return json.loads(response.body), prompt


async def stream_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> ChatStream:
    """A streamed chat completion (req.stream must be true)."""
    prompt = PromptInfo()
    response = await create_chat_completion(_counting_ctx(ctx, prompt), req, raw)
    if not isinstance(response, SSEResponse):
        raise OpenAIError("internal error: the chat stream did not start", 500)

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        async for event in response.body_iterator:
            text = event if isinstance(event, str) else event.decode("utf-8")
            for line in text.split("\n"):
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: "):])

    return ChatStream(chunks(), response.on_close, prompt)
