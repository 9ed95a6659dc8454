"""A sequence being served: its tokens, how far the cache has caught up, and the pages it holds."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kimiserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kimiserve.engine.detokenizer import IncrementalDetokenizer
    from kimiserve.engine.sampler import TokenLogprobs
    from kimiserve.engine.thinking import ThinkingBudget
    from kimiserve.structured_output.manager import RequestGrammar


def sample_seed(seed: int | None, sample_index: int) -> int | None:
    """The seed of sample `sample_index` of a request seeded with `seed` (sample 0 keeps it)."""
    if seed is None or sample_index == 0:
        return seed
    return hash((seed, sample_index)) & (2**63 - 1)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sample (one of `params.n`) of a request. The cache holds its first `num_computed` tokens;
    the scheduler only lets `num_computed` catch up with `num_tokens` (vLLM v1's rule), and a
    sample is drawn each time it does."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    """Admission order; the newest running request is preempted first."""
    sample_index: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    state_pages: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    """"stop" (eos, stop token or stop string), "length" (max_tokens or max_model_len) or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sample."""
    logprobs: list["TokenLogprobs"] = field(default_factory=list)
    prompt_logprobs: list["TokenLogprobs | None"] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens restored from the prefix cache at the request's first admission (what usage
    reports as cached_tokens; a recompute after a preemption does not change it)."""
    num_preemptions: int = 0
    detokenizer: "IncrementalDetokenizer | None" = None
    streamed_tokens: int = 0
    """Output tokens already reported by streaming outputs."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: drafted tokens after the pending one, verified by the next step (placeholders
    when `spec_draft_row` holds them on the device)."""
    spec_draft_row: "DraftRow | None" = None
    """The drafts on the device (`spec_decode.device_drafts`), or None: `spec_token_ids` are the drafts."""
    lora_id: int = 0
    """The engine's id of the LoRA adapter this sample runs with (0: the base model); salts its prefix-cache keys."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Drafted tokens verified for this sample and how many of them were kept."""
    grammar: "RequestGrammar | None" = None
    """Guided decoding: this sample's grammar state (advanced by the engine with each token)."""
    grammar_future: "Future | None" = None
    """The grammar still compiling; the scheduler keeps the request waiting until it is resolved."""
    thinking: "ThinkingBudget | None" = None
    """The thinking-token budget's state (params.thinking_token_budget set), advanced by the engine."""
    fed_ahead: bool = False
    """Async scheduling: a step feeding this sample's next token was launched before its last token
    reached the host, so its KDA state pages are already past `num_computed` (no prefix-cache
    snapshot is kept from them if the sample ends now; the extra row is discarded)."""

    @property
    def ready(self) -> bool:
        """False while the request's grammar compiles."""
        return self.grammar_future is None

    @property
    def forced_token_id(self) -> int | None:
        """A token the next sample must be (the budget's `</think>`), else None."""
        return self.thinking.forced_token_id if self.thinking is not None else None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] without building all_ids (a decode step feeds one token of a long context)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : max(0, stop - p)]
        if stop <= p:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the last sampled token counts: it is fed next)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed  # (num_tokens inlined: per request per step)

    @property
    def is_decode(self) -> bool:
        return self.num_pending == 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def seed(self) -> int | None:
        return sample_seed(self.params.seed, self.sample_index)

    @property
    def pages(self) -> list[int]:
        return self.block_table + self.state_pages
