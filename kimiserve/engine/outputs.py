"""What the engine reports per request (the shape vLLM users know)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kimiserve.engine.sampler import TokenLogprobs


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"
    """Everything so far: text, token_ids and logprobs from the start (delta_* say what is new)."""
    DELTA = "delta"
    """Only what is new since the request's previous output: text, token_ids and logprobs are the
    delta, prompt_logprobs come once, in the first output. The engine keeps no copy of what it has
    reported, so a long stream costs memory in proportion to what is unread, not to its square."""


@dataclass
class CompletionOutput:
    index: int
    """Which of the request's n samples this is."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    """None while running; "stop", "length", "abort" or "error" (the request failed inside the engine)."""
    stop_reason: int | str | None = None
    delta_text: str = ""
    """Streaming: text added since the previous output of this request (stop strings never leak)."""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens restored from the prefix cache instead of computed."""
    error: str | None = None
    """Set when the request failed inside the engine (finish_reason "error"): a message fit for the
    client, without internal details (those are in the engine's log under the request id)."""


def merge_delta(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a DELTA output into the running total of the request (None: the first output); the
    result is what a CUMULATIVE output of the same step would hold."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False,
                              delta.prompt_logprobs, delta.num_cached_tokens)
    by_index = {c.index: c for c in total.outputs}
    for c in delta.outputs:
        acc = by_index.get(c.index)
        if acc is None:
            acc = by_index[c.index] = CompletionOutput(c.index, "", [], None if c.logprobs is None else [], None)
            total.outputs.append(acc)
        acc.text += c.text
        acc.token_ids += c.token_ids
        if c.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + c.logprobs
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
        acc.delta_text, acc.delta_token_ids = c.delta_text, c.delta_token_ids
    total.outputs.sort(key=lambda c: c.index)
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    total.finished, total.error = delta.finished, delta.error
    total.num_cached_tokens = delta.num_cached_tokens
    return total
