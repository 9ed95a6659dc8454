"""`SpeculativeConfig`: vLLM's JSON shape ({"method": "ngram", ...} or {"method": "draft_model", ...})."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kimiserve.utils.docs import field_docs

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str
    """Proposer: "ngram" (prompt lookup over the prompt and the output so far) or "draft_model" (a smaller
    kimiserve model with the same tokenizer, run greedily for num_speculative_tokens steps per round)."""
    num_speculative_tokens: int
    """K: tokens proposed per round; the target scores them plus one in a single chunk of K + 1."""
    prompt_lookup_max: int | None = None
    """ngram: longest n-gram (ending at the last token) looked up in the earlier tokens (default 4)."""
    prompt_lookup_min: int | None = None
    """ngram: shortest n-gram tried when no longer one matches (default 1)."""
    model: str | None = None
    """draft_model: the draft model (a preset or a checkpoint folder)."""
    draft_num_pages: int | None = None
    """draft_model: pages of the draft model's own cache pool (default: as many tokens as the target's pool)."""
    draft_seed: int | None = None
    """draft_model: seed of a preset draft's random weights (default: the engine's seed, i.e. the same
    weights when the draft is the target's preset)."""

    @classmethod
    def from_user(cls, value: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From a SpeculativeConfig, a dict or a JSON string; ValueError naming what to change."""
        if isinstance(value, SpeculativeConfig):
            config = value
        else:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"speculative_config is not valid JSON ({exc}): give e.g. "
                                     f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}'") from None
            if not isinstance(value, dict):
                raise ValueError(f"speculative_config must be a JSON object (dict), got {type(value).__name__}")
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; valid: {', '.join(names)}")
            for key in ("method", "num_speculative_tokens"):
                if key not in value:
                    raise ValueError(f"speculative_config needs {key!r} (e.g. {{\"method\": \"ngram\", "
                                     f"\"num_speculative_tokens\": 3}})")
            config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def integer(name: str, low: int) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise ValueError(f"speculative_config {name} must be an integer >= {low}, got {v!r}")

        if self.method not in METHODS:
            hint = " (EAGLE/MTP heads are not implemented)" if self.method in ("eagle", "eagle3", "mtp", "medusa") else ""
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}{hint}")
        integer("num_speculative_tokens", 1)
        integer("prompt_lookup_max", 1)
        integer("prompt_lookup_min", 1)
        integer("draft_num_pages", 1)
        if self.draft_seed is not None:
            integer("draft_seed", 0)
        if self.method == "ngram":
            for key in ("model", "draft_num_pages", "draft_seed"):
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative_config {key} is for method draft_model, not ngram")
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = max(4, self.prompt_lookup_min or 1)
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = min(1, self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is above "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config method draft_model needs \"model\": a preset or checkpoint folder")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, key) is not None:
                    raise ValueError(f"speculative_config {key} is for method ngram, not draft_model")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @staticmethod
    def help() -> str:
        docs = field_docs(SpeculativeConfig)
        return "; ".join(f"{k}: {v}" for k, v in docs.items())
