"""The thinking-token budget of one sample (`SamplingParams.thinking_token_budget`).

The sample counts the tokens it generates inside `<think>` ... `</think>` (the markers
themselves not counted; a prompt that ends inside an open `<think>` starts the sample inside).
Once `budget` such tokens were generated and the block is still open, the next token is
`</think>`: the engine hands `forced_token_id` to the sampler, which returns it in place of
its draw (its logprob is the raw distribution's, as for any token). The budget covers all of
the sample's thinking: a block opened after it was spent is closed at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ThinkingBudget:
    start_id: int
    end_id: int
    budget: int
    inside: bool = False
    used: int = 0
    """Tokens generated inside thinking blocks so far."""

    @classmethod
    def for_prompt(cls, prompt_ids: list[int], start_id: int, end_id: int, budget: int) -> "ThinkingBudget":
        """The state at the start of the output: inside when the prompt's last marker opens a block."""
        inside = False
        for t in reversed(prompt_ids):
            if t == end_id or t == start_id:
                inside = t == start_id
                break
        return cls(start_id, end_id, budget, inside)

    @property
    def forced_token_id(self) -> int | None:
        """`</think>` when the budget is spent inside an open block, else None."""
        return self.end_id if self.inside and self.used >= self.budget else None

    def advance(self, token: int) -> None:
        """Account for one generated token."""
        if self.inside:
            if token == self.end_id:
                self.inside = False
            else:
                self.used += 1
        elif token == self.start_id:
            self.inside = True

    def copy(self) -> "ThinkingBudget":
        return replace(self)
