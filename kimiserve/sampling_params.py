"""SamplingParams: how one request turns logits into tokens, and when it stops.

Every field is validated in `__post_init__`; a bad value raises ValueError naming the field and
the allowed range or type. `stop` and `stop_token_ids` are normalised to lists, and `top_k = -1`
to 0 (both mean "disabled").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
"""Largest number of top alternatives that `logprobs` / `prompt_logprobs` may ask for."""


def _kind(value: Any) -> str:
    return type(value).__name__


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An int (a bool is refused) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {_kind(value)}")
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_float(name: str, value: Any) -> float:
    """A finite int or float (a bool is refused), returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_kind(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_kind(value)}")
    return value


def _check_optional_count(name: str, value: Any) -> int | None:
    return None if value is None else _check_int(name, value, 0, MAX_LOGPROBS)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM-compatible names and meanings)."""

    n: int = 1
    """Number of samples returned for the request (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of best tokens whose mass reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep only the k best tokens; 0 or -1 disables it (-1 is stored as 0), else >= 1."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the best token's, in [0, 1]."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already in the output, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF-style (> 0): a token seen in the prompt or output has a positive logit divided by it, a
    negative one multiplied by it."""
    seed: int | None = None
    """Seed of this request's sampling; the same seed gives the same tokens in any batch."""
    stop: str | list[str] | None = None
    """Stop strings (normalised to a list); generation stops when the output text contains one."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation, besides eos (normalised to a list)."""
    max_tokens: int = 16
    """Most tokens generated per sample (>= 1)."""
    min_tokens: int = 0
    """Fewest tokens generated before eos / stop_token_ids may be sampled (0 <= min_tokens <= max_tokens)."""
    ignore_eos: bool = False
    """Keep generating after eos (eos is then an ordinary token)."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives (0..20), or None."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob plus this many top alternatives (0..20), or None."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, lo=1)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = self._in_range("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = self._in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = self._in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.max_tokens = _check_int("max_tokens", self.max_tokens, lo=1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.logprobs = _check_optional_count("logprobs", self.logprobs)
        self.prompt_logprobs = _check_optional_count("prompt_logprobs", self.prompt_logprobs)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)

    @staticmethod
    def _in_range(name: str, value: Any, lo: float, hi: float) -> float:
        value = _check_float(name, value)
        if not lo <= value <= hi:
            raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value:g}")
        return value

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {_kind(stop)}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got {_kind(s)} at stop[{i}]")
            if not s:
                raise ValueError(f"stop must not contain empty strings (stop[{i}] is empty)")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {_kind(ids)}")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"stop_token_ids must be a list of ints, got {_kind(t)} at stop_token_ids[{i}]")
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t} at stop_token_ids[{i}]")
        return list(ids)

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop token id is outside [0, vocab_size)."""
        for i, t in enumerate(self.stop_token_ids):
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {t} at stop_token_ids[{i}]")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1
