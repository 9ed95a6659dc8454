"""POST /v1/chat/completions: the chat template, tools, reasoning, stream or not (vLLM's shapes).

Output parsing (`ChatOutputParser`): reasoning when the server runs with `--reasoning-parser kimi`,
tool calls when the request has tools and `tool_choice` is not "none" (`auto` needs
`--enable-auto-tool-choice --tool-call-parser kimi_k2`, as in vLLM). `required` and a named
function force the start of a tool call by appending it to the prompt (the parser is fed that
forced text first), and the rest of the section is guided by the grammar of the declared tools'
schemas (`structured_output/tool_grammar.py`), so every call parses and its arguments validate;
`--enforce-tool-call-grammar` applies that grammar under `auto` from the moment the model opens a
section. Forced calls are parsed the same way streamed or not (a call cut by max_tokens keeps what
it has), and the forced markup never shows in `content`. `response_format` and vLLM's
`structured_outputs` go through `structured.py`; with a reasoning parser the grammar applies after
`</think>`. `chat_template_kwargs: {"thinking": false}` turns thinking off (the template closes an
empty `<think></think>`); `thinking_token_budget` (or `max_thinking_tokens`) bounds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kimiserve.engine.async_engine import OutputSink
from kimiserve.engine.outputs import RequestOutput
from kimiserve.entrypoints.openai.chat_output import THINK_DONE, ChatOutputParser, DeltaMessage
from kimiserve.entrypoints.openai.errors import JSONResponse, OpenAIError, from_value_error
from kimiserve.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatMessage, ChatTool, NamedToolChoice, check_text_only)
from kimiserve.entrypoints.openai.serving_utils import (
    ServingContext, SSEResponse, abort_all, chat_logprobs, check_common, final_outputs, max_tokens_for, new_id,
    now, outputs, prompt_logprobs, sampling_params, sse, stream_error, submit, thinking_budget, unless_disconnected,
    usage)
from kimiserve.entrypoints.openai.structured import check_compiles, requested_spec
from kimiserve.entrypoints.openai.tool_parser import ARG_BEGIN, CALL_BEGIN, SECTION_BEGIN, ToolCallDelta
from kimiserve.structured_output.params import StructuredOutputsParams
from kimiserve.structured_output.tool_grammar import functions_of_openai_tools, kimi_tool_call_params

TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "tokenize")
"""chat_template_kwargs keys that would replace what the server passes the template itself."""


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Request messages -> the dicts the chat template reads (OpenAI's `developer` role is a system turn)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if d.get("role") == "developer":
            d["role"] = "system"
        out.append(d)
    return out


def render_chat(ctx: ServingContext, messages: list[ChatMessage], tools: list[ChatTool] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
                continue_final_message: bool = False) -> str:
    """The prompt text (CPU-bound: call it off the event loop for big requests). chat_template_kwargs
    the template does not read are dropped (as vLLM drops them); ones that would replace the
    template's inputs are a 400. continue_final_message: the text ends right after the final
    message's content, with no end-of-turn, so the model continues that message."""
    tokenizer = ctx.need_tokenizer("chat")
    try:
        check_text_only(messages)
    except ValueError as exc:
        raise from_value_error(exc) from None
    kwargs = template_kwargs or {}
    reserved = sorted(k for k in kwargs if k in TEMPLATE_RESERVED)
    if reserved:
        raise OpenAIError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server sets "
                          f"{'it' if len(reserved) == 1 else 'them'}", 400, f"chat_template_kwargs.{reserved[0]}")
    used = tokenizer.chat_template_variables()
    kwargs = {k: v for k, v in kwargs.items() if k in used}
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        text = tokenizer.apply_chat_template(template_messages(messages), tools=tool_dicts,
                                             add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    except ValueError as exc:
        raise from_value_error(exc) from exc
    except RecursionError as exc:  # JSON nested deeper than the renderer recurses (tool schemas, arguments)
        raise OpenAIError("tools or messages are nested too deeply to render the chat template", 400,
                          "tools" if tools else "messages") from exc
    if continue_final_message:
        final = messages[-1].text()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise OpenAIError("continue_final_message needs a final message with text content to continue", 400,
                              f"messages[{len(messages) - 1}].content")
        text = text[: at + len(final)]
    return text


@dataclass
class ToolPlan:
    choice: str
    """"none", "auto", "required" or "named"."""
    name: str | None = None
    parse: bool = False
    forced: str = ""
    """Text appended to the prompt (and fed to the parser first)."""


def plan_tools(ctx: ServingContext, req: ChatCompletionRequest) -> ToolPlan:
    names = [t.function.name for t in req.tools or []]
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if names else "none"
    # the forced call starts after an empty reasoning part, unless the template's thinking switch is off
    # (then the prompt ends with one already)
    thinking_off = (req.chat_template_kwargs or {}).get("thinking") is False and ctx.tokenizer is not None \
        and "thinking" in ctx.tokenizer.chat_template_variables()
    think = "<think></think>" if ctx.reasoning_parser and not thinking_off else ""
    if isinstance(choice, NamedToolChoice):
        if not names:
            raise OpenAIError("tool_choice names a function but the request has no tools", 400, "tool_choice")
        name = choice.function.name
        if name not in names:
            raise OpenAIError(f"tool_choice names function {name!r}, which is not in tools (have: "
                              f"{', '.join(names)})", 400, "tool_choice.function.name")
        return ToolPlan("named", name, True, f"{think}{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:0{ARG_BEGIN}")
    if choice == "required":
        if not names:
            raise OpenAIError("tool_choice 'required' needs tools", 400, "tool_choice")
        return ToolPlan("required", None, True, f"{think}{SECTION_BEGIN}{CALL_BEGIN}functions.")
    if choice == "auto" and names:
        if not (ctx.enable_auto_tool_choice and ctx.tool_call_parser):
            raise OpenAIError('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                              '--tool-call-parser kimi_k2 (or send tool_choice "none", "required" or a named '
                              'function)', 400, "tool_choice")
        return ToolPlan("auto", None, True)
    return ToolPlan(choice)


def _tool_call_delta(d: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        out.update(id=d.id, type="function")
    fn: dict[str, Any] = {"arguments": d.arguments}
    if d.name is not None:
        fn = {"name": d.name, **fn}
    out["function"] = fn
    return out


def _merge(a: DeltaMessage, b: DeltaMessage) -> DeltaMessage:
    calls = list(a.tool_calls)
    for d in b.tool_calls:
        if calls and calls[-1].index == d.index and d.id is None:
            last = calls[-1]
            calls[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        else:
            calls.append(d)
    return DeltaMessage(a.reasoning_content + b.reasoning_content, a.content + b.content, calls)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    check_common(req)
    model = ctx.check_model(req.model)
    tokenizer = ctx.need_tokenizer("chat")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs to be true", 400, "top_logprobs")
    if req.continue_final_message and req.add_generation_prompt:
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true: set "
                          "add_generation_prompt to false to continue the final message", 400, "continue_final_message")
    plan = plan_tools(ctx, req)
    if req.continue_final_message and plan.forced:
        raise OpenAIError(f"continue_final_message cannot be used with tool_choice {plan.choice!r} (the reply must "
                          f"start a tool call)", 400, "continue_final_message")
    size = sum(len(m.text() or "") for m in req.messages)
    for m in req.messages:  # before rendering: a huge message is refused at once
        ctx.check_fits(m.text() or "", "messages")

    def prompt() -> list[int]:
        text = render_chat(ctx, req.messages, req.tools if plan.choice != "none" else None, req.add_generation_prompt,
                           req.chat_template_kwargs, req.continue_final_message) + plan.forced
        ctx.check_fits(text, "messages")
        return tokenizer.encode(text)

    spec, spec_param = guided_spec(ctx, req, plan)
    await check_compiles(ctx, spec, spec_param)
    budget = thinking_budget(req)
    prompt_ids = await ctx.maybe_blocking(size, prompt)
    engine = ctx.engine
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_for(len(prompt_ids), req.max_completion_tokens or req.max_tokens, engine.max_model_len,
                                "messages", max_field)
    rename = {"logprobs": "top_logprobs", "max_tokens": max_field}
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                             engine.engine.args.max_num_seqs, rename, structured_outputs=spec,
                             thinking_token_budget=budget)
    request_id = new_id("chatcmpl")
    sink = ctx.new_sink([request_id])
    await submit(engine, [(request_id, prompt_ids, params)], sink, rename, final_only=not req.stream,
                 lora_name=ctx.lora_of(model))
    job = _Chat(ctx, req, model, request_id, plan)
    if req.stream:
        return SSEResponse(job.stream(sink), abort_all(engine, [request_id]), ctx.stream_send_timeout)

    async def collect() -> Response:
        try:
            final = (await final_outputs(sink, [request_id]))[request_id]
            return JSONResponse(await ctx.run_blocking(job.response, final))
        finally:
            abort_all(engine, [request_id])()
    return await unless_disconnected(raw, collect())


def guided_spec(ctx: ServingContext, req: ChatCompletionRequest,
                plan: ToolPlan) -> tuple[StructuredOutputsParams | None, str]:
    """The request's guided decoding and the field it comes from: the tool-call grammar for
    required / named calls (continuing the forced start) and for `auto` under
    --enforce-tool-call-grammar (lazy), else response_format / structured_outputs."""
    spec, param = requested_spec(req, after_reasoning=ctx.reasoning_parser is not None)
    if plan.choice in ("required", "named"):
        if spec is not None:
            raise OpenAIError(f"{param} cannot be combined with tool_choice {plan.choice!r} (the reply is a tool call)",
                              400, param)
        functions = functions_of_openai_tools([t.model_dump() for t in req.tools])
        return kimi_tool_call_params(functions, plan.name, req.parallel_tool_calls is not False,
                                     prefix=plan.forced.removeprefix(THINK_DONE)), "tools"
    if plan.choice == "auto" and ctx.enforce_tool_call_grammar and spec is None:
        functions = functions_of_openai_tools([t.model_dump() for t in req.tools])
        return kimi_tool_call_params(functions, None, req.parallel_tool_calls is not False, lazy=True), "tools"
    return spec, param


def _echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message's content when it is the assistant's."""
    last = req.messages[-1]
    return (last.text() or "") if req.echo and last.role == "assistant" else ""


class _Chat:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, model: str, request_id: str,
                 plan: ToolPlan):
        self.ctx, self.req, self.model, self.id, self.plan = ctx, req, model, request_id, plan
        self.created = now()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.echo = _echo_prefix(req)

    def _parser(self) -> ChatOutputParser:
        return ChatOutputParser(self.ctx.reasoning_parser is not None, self.plan.parse, self.plan.forced)

    def _finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason not in (None, "length") else reason

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices, completion_tokens = [], 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            parsed = self._parser().parse(self.plan.forced + c.text)
            calls = parsed.tool_calls if self.req.parallel_tool_calls is not False else parsed.tool_calls[:1]
            content = parsed.content
            if self.echo:
                content = self.echo + (content or "")
            reasoning = parsed.reasoning_content if self.req.include_reasoning else None
            message = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                       "tool_calls": [{"id": t.id, "type": "function",
                                       "function": {"name": t.name, "arguments": t.arguments}} for t in calls]}
            logprobs = {"content": chat_logprobs(self.ctx.tokenizer, c.logprobs or [])} if self.req.logprobs else None
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": self._finish_reason(c.finish_reason, bool(calls)),
                            "stop_reason": c.stop_reason})
        response = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": choices,
                    "usage": usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens)}
        if self.req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs(self.ctx.tokenizer, out.prompt_logprobs)
        return response

    def _chunk(self, choice: dict[str, Any]) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _delta(self, dm: DeltaMessage) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if dm.reasoning_content and self.req.include_reasoning:
            delta["reasoning_content"] = dm.reasoning_content
        if dm.content:
            delta["content"] = dm.content
        calls = [d for d in dm.tool_calls if self.req.parallel_tool_calls is not False or d.index == 0]
        if calls:
            delta["tool_calls"] = [_tool_call_delta(d) for d in calls]
        return delta

    async def stream(self, sink: OutputSink) -> AsyncIterator[str]:
        n = self.req.n
        parsers = [self._parser() for _ in range(n)]
        has_calls = [False] * n
        done = [False] * n
        prompt_tokens = completion_tokens = cached_tokens = 0
        try:
            for i in range(n):
                yield self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
                if self.echo:
                    yield self._chunk({"index": i, "delta": {"content": self.echo}, "logprobs": None,
                                       "finish_reason": None})
                if self.plan.forced:
                    dm = parsers[i].feed(self.plan.forced)
                    has_calls[i] = bool(dm.tool_calls)
                    if not dm.empty:
                        yield self._chunk({"index": i, "delta": self._delta(dm), "logprobs": None,
                                           "finish_reason": None})
            async for out in outputs(sink, [self.id]):
                prompt_tokens, cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    if done[c.index]:
                        continue
                    i = c.index
                    completion_tokens += len(c.delta_token_ids)
                    dm = parsers[i].feed(c.delta_text) if c.delta_text else DeltaMessage()
                    if c.finished:
                        dm = _merge(dm, parsers[i].finish())
                        done[i] = True
                    has_calls[i] = has_calls[i] or bool(dm.tool_calls)
                    logprobs = None
                    if self.req.logprobs:
                        new = len(c.delta_token_ids)
                        entries = (c.logprobs or [])[len(c.logprobs or []) - new:] if new else []
                        logprobs = {"content": chat_logprobs(self.ctx.tokenizer, entries)}
                    delta = self._delta(dm)
                    if delta or c.finished or (logprobs and logprobs["content"]):
                        choice = {"index": i, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": self._finish_reason(c.finish_reason, has_calls[i])}
                        if c.finished:
                            choice["stop_reason"] = c.stop_reason
                        yield self._chunk(choice)
            if self.include_usage:
                yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.model, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
        except Exception as exc:  # noqa: BLE001 - reported in the stream, which still ends properly
            yield stream_error(exc, self.id)
        yield "data: [DONE]\n\n"
