"""POST /v1/completions: prompts as text or token ids, n samples each, stream or not (vLLM's shapes).

Prompt i of k with n samples is engine request `{id}-{i}`; its samples are choices
i * n .. i * n + n - 1, as vLLM numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kimiserve.engine.async_engine import OutputSink
from kimiserve.engine.outputs import CompletionOutput, RequestOutput
from kimiserve.entrypoints.openai.errors import JSONResponse, OpenAIError
from kimiserve.entrypoints.openai.protocol import CompletionRequest
from kimiserve.entrypoints.openai.structured import check_compiles, requested_spec
from kimiserve.entrypoints.openai.serving_utils import (
    ServingContext, SSEResponse, abort_all, check_common, completion_logprobs, final_outputs, max_tokens_for,
    new_id, now, outputs, prompt_logprobs, sampling_params, sse, stream_error, submit, thinking_budget,
    unless_disconnected, usage)


async def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt; the shapes were checked by the request model."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    vocab = ctx.engine.engine.config.vocab_size
    out = []
    for i, p in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids = await ctx.encode(p)
            text = p
        else:
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise OpenAIError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", 400, where)
            ids, text = list(p), None
        if not ids:
            raise OpenAIError(f"{where} is empty: give at least one token", 400, where)
        out.append((text, ids))
    return out


def _prompt_text(ctx: ServingContext, text: str | None, ids: list[int]) -> str:
    if text is not None:
        return text
    return ctx.tokenizer.decode(ids) if ctx.tokenizer is not None else ""


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    check_common(req)
    model = ctx.check_model(req.model)
    if req.suffix:
        raise OpenAIError("suffix is not supported by this model", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError("best_of is not supported (it must equal n when given)", 400, "best_of")
    spec, spec_param = requested_spec(req)
    await check_compiles(ctx, spec, spec_param)
    budget = thinking_budget(req)
    prompts = await _prompts(ctx, req)
    engine = ctx.engine
    request_id = new_id("cmpl")
    requests = []
    for i, (_, ids) in enumerate(prompts):
        max_tokens = max_tokens_for(len(ids), req.max_tokens, engine.max_model_len, "prompt", "max_tokens")
        params = sampling_params(req, max_tokens, req.logprobs, engine.engine.args.max_num_seqs, {},
                                 structured_outputs=spec, thinking_token_budget=budget)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
        requests.append((f"{request_id}-{i}", ids, params))
    ids = [r[0] for r in requests]
    sink = ctx.new_sink(ids)
    await submit(engine, requests, sink, {}, final_only=not req.stream, lora_name=ctx.lora_of(model))
    job = _Completion(ctx, req, model, request_id, prompts, ids)
    if req.stream:
        return SSEResponse(job.stream(sink), abort_all(engine, ids), ctx.stream_send_timeout)

    async def collect() -> Response:
        try:
            return JSONResponse(await ctx.run_blocking(job.response, await final_outputs(sink, ids)))
        finally:
            abort_all(engine, ids)()  # no-op for finished requests; frees the rest on cancellation
    return await unless_disconnected(raw, collect())


class _Completion:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, model: str, request_id: str,
                 prompts: list[tuple[str | None, list[int]]], ids: list[str]):
        self.ctx, self.req, self.model, self.id = ctx, req, model, request_id
        self.prompts = prompts
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.created = now()

    def _echo_logprobs(self, out: RequestOutput) -> tuple[list, list[int]]:
        return list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)), list(out.prompt_token_ids)

    def response(self, final: dict[str, RequestOutput]) -> dict[str, Any]:
        req, tok = self.req, self.ctx.tokenizer
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        for rid, p in self.index.items():
            out = final[rid]
            prompt_tokens += len(out.prompt_token_ids)
            cached_tokens += out.num_cached_tokens
            prefix = _prompt_text(self.ctx, self.prompts[p][0], out.prompt_token_ids) if req.echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    entries, token_ids = self._echo_logprobs(out) if req.echo else ([], [])
                    logprobs = completion_logprobs(tok, entries + list(c.logprobs or []), token_ids + c.token_ids, 0,
                                                   req.skip_special_tokens, len(token_ids))
                choice = {"index": p * req.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(tok, out.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self, sink: OutputSink) -> AsyncIterator[str]:
        req, tok = self.req, self.ctx.tokenizer
        offsets: dict[int, int] = {}  # choice -> characters sent (text_offset of the next token)
        done: set[int] = set()
        prompt_tokens = completion_tokens = cached_tokens = 0
        try:
            async for out in outputs(sink, list(self.index)):
                p = self.index[out.request_id]
                for c in out.outputs:
                    index = p * req.n + c.index
                    if index in done:
                        continue
                    first = index not in offsets
                    if first:
                        offsets[index] = 0
                        if c.index == 0:
                            prompt_tokens += len(out.prompt_token_ids)
                            cached_tokens += out.num_cached_tokens
                    text, entries, token_ids = self._delta(out, c, first, p)
                    completion_tokens += len(c.delta_token_ids)
                    logprobs = None
                    if req.logprobs is not None:
                        num_prompt = len(token_ids) - len(c.delta_token_ids)
                        logprobs = completion_logprobs(tok, entries, token_ids, offsets[index],
                                                       req.skip_special_tokens, num_prompt)
                    offsets[index] += len(text)
                    if c.finished:
                        done.add(index)
                    if text or token_ids or c.finished:
                        yield sse(self._chunk([{"index": index, "text": text, "logprobs": logprobs,
                                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse({**self._chunk([]), "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
        except Exception as exc:  # noqa: BLE001 - reported in the stream, which still ends properly
            yield stream_error(exc, self.id)
        yield "data: [DONE]\n\n"

    def _delta(self, out: RequestOutput, c: CompletionOutput, first: bool, p: int):
        """This step's text, logprob entries and token ids of one choice (the prompt first when echoing)."""
        new = len(c.delta_token_ids)
        entries = list(c.logprobs[len(c.logprobs) - new:]) if c.logprobs is not None and new else []
        text, token_ids = c.delta_text, list(c.delta_token_ids)
        if first and self.req.echo:
            prompt_entries, prompt_ids = self._echo_logprobs(out)
            text = _prompt_text(self.ctx, self.prompts[p][0], out.prompt_token_ids) + text
            entries, token_ids = prompt_entries + entries, prompt_ids + token_ids
        return text, entries, token_ids
