"""The grammar library behind guided decoding: llguidance (PyPI `llguidance`, the `guided` extra).

Chosen over xgrammar by `benchmarks/guided_libraries.py` (BENCHMARKS.md, "Guided decoding"):
JSON-schema grammars compile in about a millisecond instead of 17-32 ms at a 150K vocabulary, it
enforces Kimi's tool-call section (special tokens around embedded JSON schemas) where xgrammar
as set up there left no token allowed, it has no dependencies, and its matchers fork and roll
back (speculative decoding). Its per-row mask fill is slower (tens of microseconds at 150K ids),
which the runner overlaps with the device's forward (the mask is filled on the host after the
forward was launched and copied without blocking).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kimiserve.structured_output.params import StructuredOutputsParams

MISSING = ("guided decoding needs the llguidance package: pip install 'kimiserve[guided]' "
           "(or pip install llguidance)")


def import_llguidance():
    try:
        import llguidance  # not llguidance.torch: it imports torch.compile's machinery (seconds)
    except ImportError as exc:
        raise ValueError(MISSING) from exc
    return llguidance


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a KimiTokenizer: every id's bytes (special
    tokens by name, and listed as special so that text can never spell them), eos and an encoder."""

    def __init__(self, tokenizer, eos_token_id: int | None):
        self._tok = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode_token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = list(range(tokenizer.num_base_tokens, tokenizer.vocab_size))

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, allow_special=False)


def grammar_text(llg, spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its serialised form) of a spec; ValueError when it cannot be built."""
    kind = spec.kind
    options = {"whitespace_flexible": spec.whitespace_flexible}
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec.json, defaults=options)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(spec.grammar)  # GBNF/EBNF to Lark; Lark passes through
    except Exception as exc:  # noqa: BLE001 - any converter failure is the grammar's problem
        raise ValueError(f"the grammar is neither valid GBNF/EBNF nor Lark: {exc}") from None
    return llg.LLMatcher.grammar_from_lark(lark)


class LLGuidanceBackend:
    """One tokenizer's view for llguidance, the compiler of specs into matchers, and the batched
    mask fill. Built once per engine (the vocabulary view costs ~0.4 s at 160K ids)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, mask_threads: int | None = None):
        llg = import_llguidance()
        self.llg = llg
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerView(tokenizer, eos_token_id)),
                                         n_vocab=vocab_size)
        self.executor = llg.LLExecutor(mask_threads)
        self.special_ids = dict(tokenizer.special_tokens)

    def compile(self, spec: StructuredOutputsParams):
        """A fresh matcher at the start of the grammar (the prototype requests deep-copy); ValueError
        naming the problem when the spec does not compile."""
        try:
            text = grammar_text(self.llg, spec)
            matcher = self.llg.LLMatcher(self.tokenizer, text, log_level=0)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the library raises for a spec is the spec's problem
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: {exc}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: {matcher.get_error()}")
        return matcher

    @property
    def mask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill(self, matchers: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        """Write the next-token bitmask of each (matcher, row) into bitmask[row] (CPU int32 [R, W],
        contiguous): what llguidance.torch's fill helpers do, through the same library calls."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        rows, width = bitmask.shape
        row_bytes = width * 4
        if len(matchers) == 1:
            matcher, row = matchers[0]
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
        else:
            self.executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, rows)
