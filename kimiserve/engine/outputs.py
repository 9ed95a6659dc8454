"""What the engine reports per request (the shape vLLM users know)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kimiserve.engine.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    """Which of the request's n samples this is."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    """None while running; "stop", "length" or "abort"."""
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
