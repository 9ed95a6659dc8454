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
    FINAL_ONLY = "final_only"
    """One output, when the request finishes (or fails), holding everything as CUMULATIVE's last would; no
    output while it runs, so a step does not copy each request's tokens and text (`LLM.generate`'s kind)."""


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
class RequestTimes:
    """When a request reached each stage (time.monotonic() seconds; None until it has), as vLLM's
    per-request stats: queue time = first_scheduled - arrival, prefill = first_token - first_scheduled,
    decode = finished - first_token."""

    arrival: float
    """The engine accepted it (`LLMEngine.add_request`)."""
    first_scheduled: float | None = None
    """A step first scheduled a chunk of it (a later preemption does not move this)."""
    first_token: float | None = None
    """Its first token (of any sample) was generated."""
    finished: float | None = None
    """Its last sample finished."""


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
    times: RequestTimes | None = None
    """The request's stage times so far (the engine's own object: read, do not change)."""


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """One request's DELTA outputs, in order, folded into the output a CUMULATIVE request would
    report last (texts joined once: linear in the output's length)."""
    last = deltas[-1]
    pieces: dict[int, list[CompletionOutput]] = {}
    for out in deltas:
        for c in out.outputs:
            pieces.setdefault(c.index, []).append(c)
    outputs = []
    for index in sorted(pieces):
        parts = pieces[index]
        logprobs = None if all(c.logprobs is None for c in parts) else [e for c in parts for e in (c.logprobs or [])]
        end = parts[-1]
        outputs.append(CompletionOutput(index, "".join(c.text for c in parts), [t for c in parts for t in c.token_ids],
                                        logprobs, end.finish_reason, end.stop_reason, end.delta_text,
                                        end.delta_token_ids))
    prompt_logprobs = next((out.prompt_logprobs for out in deltas if out.prompt_logprobs is not None), None)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, outputs, last.finished, prompt_logprobs,
                         last.num_cached_tokens, last.error, last.times)
