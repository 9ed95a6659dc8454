"""SamplingParams: how one request turns logits into tokens, and when it stops.

Every field is validated in `__post_init__`; a bad value raises ValueError naming the field and
the allowed range or type. `stop`, `stop_token_ids` and `bad_words` are normalised to lists
(`allowed_token_ids` too, with duplicates dropped), and `top_k = -1` to 0 (both mean "disabled").

Every value accepted here is safe for the shared sampler: it never makes a step raise or return
a token outside the vocabulary (extreme values saturate; see `kimiserve/engine/sampler.py`).
The count and length of `stop` and `bad_words` are bounded because their cost is paid by every
request of the batch (the limits below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kimiserve.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Largest number of top alternatives that `logprobs` / `prompt_logprobs` may ask for."""

SAMPLING_EPS = 1e-5
"""Temperatures below this (vLLM's `_SAMPLING_EPS`) mean greedy sampling. Dividing logits by a
smaller temperature only overflows them (1e-300 turns every logit into inf); the distribution is
already a point mass on the argmax long before."""

MAX_STOP_STRINGS = 64
"""Most stop strings one request may give. The detokenizer searches the tail of the output for
every stop string after every token, in the engine thread, so this cost is paid by every other
request of the batch. OpenAI allows 4, vLLM has no limit. Measured worst cases (an adversarial
two-letter text, str.find as the detokenizer calls it) on a development CPU, in engine-thread time
per token and request: 64 strings of 256 characters 19 us, 64 of 1024 characters 44 us, 4 of 1024
3 us. With 64 x 256 (16x OpenAI's count), 50 such requests in a batch cost about 1 ms of each
step."""

MAX_STOP_STRING_CHARS = 256
"""Longest stop string, in characters. It also bounds what streaming holds back (the longest
stop string minus one character). Real stop strings (a blank line, "</answer>", "Observation:")
are far shorter."""

MAX_BAD_WORDS = 64
"""Most bad words one request may give. Each word yields up to two token sequences (as given and
with a leading space), so at most 128, vLLM's per-request bound on tokenized bad words. The
sampler checks every sequence against the output at every step (`kimiserve/engine/bad_words.py`)."""

MAX_BAD_WORD_CHARS = 256
"""Longest bad word, in characters."""

MAX_LOGIT_BIAS = 300
"""Most entries of `logit_bias` (OpenAI's limit)."""

MAX_ABS_LOGIT_BIAS = 100.0
"""`logit_bias` values lie in [-100, 100] (OpenAI's range)."""

MAX_BAD_WORDS_TOKENS = 4096
"""Most tokens over all the tokenized bad-word sequences of one request (checked in
`update_from_tokenizer`): bounds the sampler's worst-case matching work per step and row (vLLM's
GPU path bounds it at 1024)."""


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
    """Softmax temperature (>= 0); 0 means greedy (argmax), and so does any temperature below
    `SAMPLING_EPS` (1e-5, as vLLM), whose distribution is an argmax in all but rounding."""
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
    """Stop strings (normalised to a list); generation stops when the output text contains one.
    At most `MAX_STOP_STRINGS` (64) non-empty strings of at most `MAX_STOP_STRING_CHARS` (256)."""
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
    allowed_token_ids: list[int] | None = None
    """Only these token ids can be generated (vLLM's meaning): every other token is masked before
    the argmax of greedy rows and before sampling. A non-empty list of ints >= 0 (duplicates are
    dropped), checked against the vocabulary by `validate_vocab`. Logprobs stay those of the raw
    model distribution, as for the other sampling parameters."""
    bad_words: list[str] | None = None
    """Words that must not be generated (vLLM's meaning), normalised to a list: at most
    `MAX_BAD_WORDS` (64) non-empty strings of at most `MAX_BAD_WORD_CHARS` (256). Each word is
    tokenized as given (leading whitespace stripped) and with one leading space (the word can start
    mid-text); at every step, the last token of a sequence is banned when the output so far ends
    with the sequence's other tokens (a one-token sequence is always banned). The token ids come
    from `update_from_tokenizer`, which the engine calls once when the request is added; a word
    the model spells with other tokens is not caught (as in vLLM). Logprobs stay raw."""
    logit_bias: dict[int, float] | None = None
    """OpenAI's logit_bias: token id -> a bias in [-100, 100] added to that token's logit before
    sampling (after the hard masks, before the penalties; greedy rows take the argmax of the biased
    logits). At most `MAX_LOGIT_BIAS` (300) entries; ids are checked against the vocabulary by
    `validate_vocab`. A bias never brings back a token a hard mask excludes. Logprobs stay raw."""
    thinking_token_budget: int | None = None
    """Most tokens the sample may generate inside `<think>` ... `</think>` (vLLM's name; >= 0): once
    that many were generated and the block is still open, the next token is `</think>`
    (`kimiserve/engine/thinking.py`). Needs a tokenizer with both markers. None: no budget."""
    structured_outputs: StructuredOutputsParams | None = None
    """Guided decoding (vLLM's name): the output must match this JSON schema, regex, choice list or
    grammar (`kimiserve/structured_output/`). The engine compiles it off the hot path (the request
    waits until it is ready; one that does not compile fails alone) and masks every step's logits
    with the grammar; each of the n samples has its own matcher. Logprobs stay raw."""
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    """The bad words' token sequences, set by `update_from_tokenizer` (None until then)."""

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
        self.allowed_token_ids = self._normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = self._normalise_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS,
                                                 "a list of strings")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{_kind(self.structured_outputs)}")
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _check_int("thinking_token_budget", self.thinking_token_budget, lo=0)

    @staticmethod
    def _in_range(name: str, value: Any, lo: float, hi: float) -> float:
        value = _check_float(name, value)
        if not lo <= value <= hi:
            raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value:g}")
        return value

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if isinstance(stop, str):
            stop = [stop]
        return SamplingParams._normalise_strings("stop", stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS,
                                                 "a string or a list of strings")

    @staticmethod
    def _normalise_strings(name: str, values: Any, max_count: int, max_chars: int, what: str) -> list[str]:
        """None -> []; else a list or tuple of at most max_count non-empty strings of at most
        max_chars characters each."""
        if values is None:
            return []
        if not isinstance(values, (list, tuple)):
            raise ValueError(f"{name} must be {what}, got {_kind(values)}")
        if len(values) > max_count:
            raise ValueError(f"{name} must hold at most {max_count} strings, got {len(values)}")
        for i, s in enumerate(values):
            if not isinstance(s, str):
                raise ValueError(f"{name} must be {what}, got {_kind(s)} at {name}[{i}]")
            if not s:
                raise ValueError(f"{name} must not contain empty strings ({name}[{i}] is empty)")
            if len(s) > max_chars:
                raise ValueError(f"{name} must hold strings of at most {max_chars} characters, got {len(s)} at {name}[{i}]")
        return list(values)

    @staticmethod
    def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"allowed_token_ids must be a list of ints, got {_kind(ids)}")
        if not ids:
            raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"allowed_token_ids must be a list of ints, got {_kind(t)} at allowed_token_ids[{i}]")
            if t < 0:
                raise ValueError(f"allowed_token_ids must be >= 0, got {t} at allowed_token_ids[{i}]")
        return list(dict.fromkeys(ids))

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_kind(bias)}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        out = {}
        for t, b in bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias must have token ids (ints >= 0) as keys, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                    or not -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {b!r} for token {t}")
            out[t] = float(b)
        return out or None

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
        """Raise ValueError if a stop token id, an allowed token id or a logit_bias id is outside
        [0, vocab_size)."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            for i, t in enumerate(getattr(self, name) or ()):
                if t >= vocab_size:
                    raise ValueError(f"{name} must be in [0, {vocab_size}), got {t} at {name}[{i}]")
        for t in self.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(f"logit_bias must have token ids in [0, {vocab_size}) as keys, got {t}")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` into `_bad_words_token_ids` (the engine calls this once per request,
        in add_request). No bad words: nothing to do, whatever the tokenizer. Raises ValueError
        naming bad_words when there is no tokenizer, or when the sequences hold more than
        `MAX_BAD_WORDS_TOKENS` tokens in all. Calling it again with the same tokenizer gives the
        same ids (a SamplingParams shared by several requests is fine)."""
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none: use allowed_token_ids")
        from kimiserve.engine.bad_words import bad_words_token_ids

        seqs = bad_words_token_ids(tokenizer, self.bad_words)
        total = sum(len(s) for s in seqs)
        if total > MAX_BAD_WORDS_TOKENS:
            raise ValueError(f"bad_words tokenize to {total} tokens in all; at most {MAX_BAD_WORDS_TOKENS} are allowed")
        self._bad_words_token_ids = seqs

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature below `SAMPLING_EPS` (0 included;
        vLLM's rule) or top_k 1. top_p, min_p and the seed are then ignored."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1
