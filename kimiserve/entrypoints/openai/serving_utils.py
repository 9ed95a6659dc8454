"""What the chat and completion handlers share: request checks, sampling parameters, logprobs,
usage, the engine round trip, and the streaming response that aborts when the client leaves."""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kimiserve.engine.async_engine import (
    AsyncLLMEngine, EngineDeadError, OutputOverflowError, OutputSink, RequestFailedError)
from kimiserve.engine.outputs import RequestOutput
from kimiserve.engine.sampler import TokenLogprobs
from kimiserve.entrypoints.openai.errors import OpenAIError, from_validation_error, from_value_error, to_json
from kimiserve.entrypoints.openai.protocol import SamplingRequest, unsupported_field
from kimiserve.sampling_params import SamplingParams

logger = logging.getLogger("kimiserve.server")
T = TypeVar("T")
M = TypeVar("M", bound=pydantic.BaseModel)
MIN_LOGPROB = -9999.0
"""-inf logprobs are sent as this (JSON has no -inf), as vLLM does."""
INLINE_BYTES = 16 * 1024
"""Bodies and texts up to this size are parsed / tokenised on the event loop (well under a
millisecond); larger ones in the worker threads, so a huge request never stalls other clients."""


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    enforce_tool_call_grammar: bool = False
    """Under tool_choice "auto", enforce the tool-call grammar once the model opens a tool-call section."""
    max_queued_output_bytes: int | None = None
    """Unread output one HTTP request may have waiting before its requests are aborted (None: no bound)."""
    stream_send_timeout: float | None = None
    """Seconds a stream may wait on a client that does not read before its connection is closed."""
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="kimiserve-cpu"))
    """Worker threads for CPU-bound request work (parsing, chat templates, tokenising, formatting)."""

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker thread, so the event loop keeps serving other clients."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def maybe_blocking(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn inline for small work (`size` in bytes or characters under INLINE_BYTES), else in a worker."""
        if size <= INLINE_BYTES:
            return fn(*args, **kwargs)
        return await self.run_blocking(fn, *args, **kwargs)

    async def parse(self, raw: Request, model: type[M]) -> M:
        """The request body validated as `model` (400 in the OpenAI shape when it is not)."""
        body = await raw.body()
        return await self.maybe_blocking(len(body), parse_body, model, body)

    async def encode(self, text: str, field: str = "prompt") -> list[int]:
        """Token ids of a prompt text; a text too long for the context whatever its tokens is refused
        without tokenising it (`check_fits`)."""
        self.check_fits(text, field)
        return await self.maybe_blocking(len(text), self.need_tokenizer("a text prompt").encode, text)

    def check_fits(self, text: str, field: str) -> None:
        """400 (context_length_exceeded) when `text` cannot fit max_model_len even if every token were
        the vocabulary's longest: a cheap bound that spares tokenising megabytes only to refuse them."""
        tokenizer = self.need_tokenizer("a text prompt")
        at_least = -(-len(text.encode("utf-8", "surrogatepass")) // tokenizer.max_token_bytes)
        limit = self.engine.max_model_len
        if at_least >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your request has at least "
                f"{at_least} input tokens; the {field} plus at least one generated token must fit. Please reduce "
                f"the length of the {field}.", 400, field, "context_length_exceeded")

    def new_sink(self, request_ids: list[str]) -> OutputSink:
        """Where the outputs of one HTTP request's engine requests go; overflowing aborts them all."""
        return OutputSink(self.max_queued_output_bytes, abort_all(self.engine, request_ids))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def lora_of(self, model: str) -> str | None:
        """The LoRA adapter a request's model name selects (None: the base model)."""
        return model if model not in self.served_model_names and model in self.engine.engine.lora_names() else None

    def check_model(self, model: str | None) -> str:
        """The model name to report (a served name or a loaded LoRA adapter's); 404 for any other."""
        if model is None or model in self.served_model_names or model in self.engine.engine.lora_names():
            return model or self.model_name
        raise OpenAIError(f"The model `{model}` does not exist (this server serves "
                          f"{', '.join(self.served_model_names)}).", 404, "model", "model_not_found")

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise OpenAIError(f"this model has no tokenizer, which {what} needs (start the server with "
                              f"--tokenizer)", 400)
        return self.tokenizer


def parse_body(model: type[M], body: bytes) -> M:
    """JSON (lone surrogates allowed, as Python's json reads them) validated as `model`."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}", 400) from None
    except UnicodeDecodeError:
        raise OpenAIError("the request body is not valid UTF-8 JSON", 400) from None
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply", 400) from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply", 400) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_common(req: SamplingRequest) -> None:
    """Request-level rules that are not a single field's type or range."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", 400, "stream_options")
    name = unsupported_field(req)
    if name is not None:
        raise OpenAIError(f"{name} is not supported by this server; leave it out", 400, name)
    if req.stream_options is not None and (req.stream_options.model_extra or {}).get("continuous_usage_stats"):
        raise OpenAIError("stream_options.continuous_usage_stats is not supported by this server; leave it out",
                          400, "stream_options.continuous_usage_stats")


def max_tokens_for(num_prompt: int, max_tokens: int | None, max_model_len: int, prompt_field: str,
                   max_tokens_field: str) -> int:
    """The request's max_tokens checked against the context (vLLM's rules); None -> the room left."""
    if num_prompt >= max_model_len:
        asked = f" and asks for {max_tokens} output tokens" if max_tokens is not None else ""
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt} input tokens{asked}; the {prompt_field} plus at least one generated token must fit. "
            f"Please reduce the length of the {prompt_field}.", 400, prompt_field, "context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_field}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_field} or completion.", 400, max_tokens_field,
            "context_length_exceeded")
    return max_tokens


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None, max_num_seqs: int,
                    rename: dict[str, str], **extra: Any) -> SamplingParams:
    """The engine's parameters of a request; `extra`: SamplingParams fields the handler worked out
    (structured_outputs, thinking_token_budget)."""

    if req.n > max_num_seqs:
        raise OpenAIError(f"n must be <= {max_num_seqs} (the server's --max-num-seqs), got {req.n}", 400, "n")
    opt = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                 "frequency_penalty", "repetition_penalty")
           if getattr(req, name) is not None}
    try:
        return SamplingParams(
            n=req.n, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words, logit_bias=logit_bias_ids(req.logit_bias), **opt, **extra)
    except ValueError as exc:
        raise from_value_error(exc, rename) from exc


def thinking_budget(req: SamplingRequest) -> int | None:
    """thinking_token_budget, or its other name max_thinking_tokens (a 400 when both differ)."""
    a, b = req.thinking_token_budget, req.max_thinking_tokens
    if a is not None and b is not None and a != b:
        raise OpenAIError(f"thinking_token_budget ({a}) and max_thinking_tokens ({b}) differ: give one", 400,
                          "max_thinking_tokens")
    return a if a is not None else b


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) with int keys; a key that is not a token id is a 400."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip():
            raise OpenAIError(f"logit_bias must have token ids (non-negative integers) as keys, got {key!r}", 400,
                              "logit_bias")
        out[token] = value
    return out


# logprobs ----------------------------------------------------------------------------------------
def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else MIN_LOGPROB


def token_bytes(tokenizer, token_id: int) -> bytes:
    return tokenizer.decode_token_bytes(token_id) if tokenizer is not None else str(token_id).encode()


def token_str(tokenizer, token_id: int) -> str:
    """A token as text; a token that is not whole UTF-8 (part of a character) is written
    `bytes:\\xNN...`, as OpenAI does, so distinct tokens never share a string."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    raw = tokenizer.decode_token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat format: [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]."""
    def item(token_id: int, lp: float) -> dict[str, Any]:
        return {"token": token_str(tokenizer, token_id), "logprob": _finite(lp),
                "bytes": list(token_bytes(tokenizer, token_id))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(tokenizer, entries: list[TokenLogprobs | None], token_ids: list[int], text_offset: int,
                        skip_special_tokens: bool = True, num_prompt: int = 0) -> dict[str, list]:
    """Completions format: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}. The first
    `num_prompt` entries are echoed prompt tokens (None: the first one, which has no logprob);
    text_offset advances by each token's share of the text (0 for a skipped special token)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, (token_id, e) in enumerate(zip(token_ids, entries)):
        text = token_str(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        raw = token_bytes(tokenizer, token_id)
        if skip_special_tokens and i >= num_prompt and tokenizer is not None \
                and not tokenizer.decode([token_id], skip_special_tokens=True):
            raw = b""  # a skipped special token adds nothing to the text
        text_offset += len(decoder.decode(raw))
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(e.logprob))
        top = {token_str(tokenizer, t): _finite(lp) for t, lp in e.top}
        top.setdefault(text, _finite(e.logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(tokenizer, entries: list[TokenLogprobs | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token_id: {"logprob", "rank",
    "decoded_token"}} for the prompt token and its top alternatives."""
    if entries is None:
        return None
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": token_str(tokenizer, t)}
             for rank, (t, lp) in enumerate(e.top, 1)}
        d.setdefault(str(e.token_id), {"logprob": _finite(e.logprob), "rank": e.rank,
                                       "decoded_token": token_str(tokenizer, e.token_id)})
        out.append(d)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# the engine round trip ---------------------------------------------------------------------------
async def submit(engine: AsyncLLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
                 sink: OutputSink, rename: dict[str, str], final_only: bool, lora_name: str | None = None) -> None:
    """Add every request to the engine (with the LoRA adapter `lora_name`, or the base model), or none (a
    refused one aborts those already added)."""
    added: list[str] = []
    try:
        for request_id, prompt_ids, params in requests:
            await engine.add_request(request_id, prompt_ids, params, sink, final_only=final_only, lora_name=lora_name)
            added.append(request_id)
    except BaseException as exc:
        for request_id in added:
            engine.abort(request_id)
        if isinstance(exc, ValueError):
            raise from_value_error(exc, rename) from exc
        if isinstance(exc, EngineDeadError):
            raise OpenAIError(str(exc), 503, None, "engine_dead") from exc
        raise


def engine_error(exc: BaseException) -> OpenAIError:
    """What the client is told about an exception from the engine side (never internal details)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), 503, None, "engine_dead")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(str(exc), 500, None, "request_failed")
    if isinstance(exc, OutputOverflowError):
        return OpenAIError(str(exc), 408, None, "output_not_read")
    return internal_error()


def internal_error() -> OpenAIError:
    return OpenAIError("internal server error (logged by the server); the request can be retried", 500, None,
                       "internal_error")


async def outputs(sink: OutputSink, request_ids: list[str]) -> AsyncIterator[RequestOutput]:
    """Yield the outputs of the given requests (all going to `sink`) until every one has finished;
    an error from the engine side is raised as the OpenAIError its client should see."""
    pending = set(request_ids)
    while pending:
        item = await sink.get()
        if isinstance(item, BaseException):
            raise engine_error(item) from item
        if item.finished:
            pending.discard(item.request_id)
        yield item


async def final_outputs(sink: OutputSink, request_ids: list[str]) -> dict[str, RequestOutput]:
    final = {}
    async for out in outputs(sink, request_ids):
        if out.finished:
            final[out.request_id] = out
    return final


def sse(data: dict[str, Any]) -> str:
    return f"data: {to_json(data)}\n\n"


def stream_error(exc: BaseException, request_id: str) -> str:
    """An error raised after the stream started, as an SSE event in the OpenAI shape. Errors the
    engine side already logged (a dead engine, a failed request) or that are the client's (400s,
    an unread stream) get one line; anything else is logged with its traceback, and the client
    sees no internal details."""
    if isinstance(exc, OpenAIError) and exc.status < 500 or isinstance(exc.__cause__, (EngineDeadError,
                                                                                       RequestFailedError)):
        logger.warning("stream %s ended: %s", request_id, exc)
    else:
        logger.error("error while streaming %s", request_id, exc_info=exc)
    return engine_error(exc).sse()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` when it ends for any reason (finished,
    client disconnected, cancelled at shutdown): the handler passes the abort of its requests.
    A send that waits longer than `send_timeout` on a client that does not read ends the
    response and so the connection (its requests are aborted by `on_close`)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], send_timeout: float | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._send_timeout = send_timeout

    @property
    def on_close(self) -> Callable[[], None]:
        """What runs when the response ends (the abort of its requests)."""
        return self._on_close

    async def __call__(self, scope, receive, send) -> None:
        timeout = self._send_timeout

        async def bounded_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise _ClientNotReading() from None

        try:
            await super().__call__(scope, receive, bounded_send if timeout is not None else send)
        except _ClientNotReading:
            logger.warning("closed a stream whose client read nothing for %.0f s", timeout)
            _STREAM_CUT.set(True)  # read by CutStreamLogFilter in this task once the app has returned
        finally:
            self._on_close()


class _ClientNotReading(Exception):
    pass


_STREAM_CUT: contextvars.ContextVar[bool] = contextvars.ContextVar("kimiserve_stream_cut", default=False)


class CutStreamLogFilter(logging.Filter):
    """For uvicorn's "uvicorn.error" logger. A stream cut by the send timeout ends without its last body
    message (the client reads nothing, so no send can complete), and uvicorn then closes the
    connection, which is the point, and logs "ASGI callable returned without completing response" as
    an error. This filter drops that one record for responses SSEResponse cut on purpose (it logged
    its own warning); the same record from any other response still gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_STREAM_CUT.get() and record.getMessage().startswith("ASGI callable returned without completing"))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work` unless the client disconnects first; then `work` is cancelled (its cleanup
    aborts its engine requests) and an empty 499 response is returned to nobody."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.cancelled() or not watcher.done():
            raise  # we were cancelled ourselves, not by the client leaving
        return Response(status_code=499)


def abort_all(engine: AsyncLLMEngine, request_ids: list[str]) -> Callable[[], None]:
    def close() -> None:
        for request_id in request_ids:
            engine.abort(request_id)
    return close
