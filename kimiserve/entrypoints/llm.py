"""The offline API: `LLM` runs batches of prompts through one `LLMEngine` and returns the outputs.

    from kimiserve import LLM, SamplingParams

    llm = LLM("tiny", max_model_len=512)
    outs = llm.generate(["Hello", "Kimi"], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)

An `LLM` owns its engine and runs one call at a time: `generate`/`chat` return when every request
of the call has finished; `stream` yields outputs step by step and aborts what is left when the
consumer stops early. Bad input raises ValueError and leaves nothing allocated in the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any, Union

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.engine.outputs import RequestOutput, RequestOutputKind
from kimiserve.sampling_params import SamplingParams
from kimiserve.utils.progress import ProgressBar

PromptType = Union[str, Sequence[int]]
"""One prompt: text (needs a tokenizer) or token ids."""
Conversation = Sequence[dict]


class LLM:
    """A model plus its engine, for offline batched generation.

    `LLM(model, **engine_kwargs)`: the keywords are `EngineArgs` fields (max_model_len, num_pages,
    dtype, seed, ...); an unknown one is a ValueError that lists the valid ones.
    """

    def __init__(self, model: str = "kimi-demo", **engine_kwargs: Any):
        valid = [f.name for f in dataclasses.fields(EngineArgs)]
        unknown = sorted(set(engine_kwargs) - set(valid))
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(unknown)}; valid ones are the EngineArgs "
                             f"fields: {', '.join(valid)}")
        self._engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
        self._request_ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    def get_tokenizer(self):
        """The model's KimiTokenizer, or None (the random presets small and kimi-k3.1-pro have none)."""
        return self._engine.tokenizer

    # public calls ------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in input order.

        prompts: a str, a list of str, a list of ints (one tokenized prompt) or a list of lists of
        ints. sampling_params: one SamplingParams for all prompts or one per prompt (default:
        SamplingParams()). use_tqdm: show a progress bar on stderr for more than one prompt.
        lora_request: the name of a loaded LoRA adapter to run them with (None: the base model).
        """
        prompts = _as_prompts(prompts)
        params = _as_params(sampling_params, len(prompts))
        return self._run(self._add_all(prompts, params, lora_request, RequestOutputKind.FINAL_ONLY), use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of message dicts) or to each
        of a list of conversations, through the tokenizer's chat template (tools go to every one)."""
        tokenizer = self._engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self._engine.args.model!r} has no tokenizer, which chat() needs: give "
                             f"a tokenizer folder (tokenizer=...) or call generate() with token ids")
        many = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        conversations = list(messages) if many else [messages]
        prompts = [tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompts: PromptType | Sequence[PromptType],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each step's RequestOutputs as they come; `delta_text` / `delta_token_ids` of each
        CompletionOutput are what is new since that request's previous output, and the output with
        `finished=True` is a request's last. Stopping early (close(), break) aborts what is left.

        The arguments are checked here; the requests are added when iteration starts, so an engine
        check (such as a prompt longer than max_model_len) raises from the first next().
        """
        prompts = _as_prompts(prompts)
        params = _as_params(sampling_params, len(prompts))
        return self._stream(prompts, params)

    # internals -----------------------------------------------------------------------------------
    def _stream(self, prompts: list, params: list[SamplingParams]) -> Iterator[RequestOutput]:
        ids = self._add_all(prompts, params)
        yield from self._steps(ids)

    def _add_all(self, prompts: list, params: list[SamplingParams], lora_request: str | None = None,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> list[str]:
        """Add every request, or none: if one is refused, abort those already added and re-raise."""
        if self._engine.has_unfinished_requests():
            raise RuntimeError("this LLM is still running requests of an earlier call (an unfinished stream()?): "
                               "finish or close it first")
        ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = str(next(self._request_ids))
            try:
                self._engine.add_request(request_id, prompt, p, output_kind, lora_name=lora_request)
            except BaseException as e:
                for added in ids:
                    self._engine.abort_request(added)
                if isinstance(e, ValueError) and len(prompts) > 1:
                    raise ValueError(f"prompt {i}: {e}") from e
                raise
            ids.append(request_id)
        return ids

    def _steps(self, ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until the given requests finish, yielding their outputs; whatever has
        not finished when this generator ends (closed, or an error) is aborted."""
        pending = set(ids)
        try:
            while pending:
                before, in_flight = self._engine.num_steps, self._engine.step_in_flight
                outputs = self._engine.step()
                stalled = self._engine.num_steps == before and not in_flight and not self._engine.num_compiling
                if not outputs and stalled:
                    raise RuntimeError(f"the engine scheduled nothing while {len(pending)} requests wait")
                for out in outputs:
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for request_id in pending:
                self._engine.abort_request(request_id)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        with ProgressBar(len(ids), desc="generate", unit="requests", enabled=use_tqdm) as bar, \
                closing(self._steps(ids)) as steps:
            for out in steps:
                bar.update(done=int(out.finished), tokens=sum(len(c.delta_token_ids) for c in out.outputs))
                if out.finished:
                    final[out.request_id] = out
        return [final[request_id] for request_id in ids]


def _as_prompts(prompts: Any) -> list[str | list[int]]:
    """A str, a list of str, a list of ints (one prompt) or a list of lists of ints -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a str, a list of str, a list of token ids or a list of lists of "
                         f"token ids, got {type(prompts).__name__}")
    if prompts and all(isinstance(p, int) for p in prompts):
        return [list(prompts)]
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, list, tuple)):
            raise ValueError(f"prompts[{i}] must be a str or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_params(sampling_params: Any, n: int) -> list[SamplingParams]:
    """None, one SamplingParams or one per prompt -> a list of n SamplingParams."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                         f"{type(sampling_params).__name__}")
    if len(sampling_params) != n:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts: give one "
                         f"SamplingParams for all or one per prompt")
    for i, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return list(sampling_params)
