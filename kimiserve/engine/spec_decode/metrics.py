"""Counters of speculative decoding (vLLM's spec_decode_* names in /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    """K (0: speculation off)."""
    num_drafts: int = 0
    """Verify rounds: chunks that carried at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[i]: rounds whose draft at position i (0-based) was accepted."""

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify round: the accepted drafts plus the target's own token (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        if not self.num_speculative_tokens:
            return {}
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                            if self.num_draft_tokens else 0.0),
        }
