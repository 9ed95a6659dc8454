"""Kimi tokenizer (tokenizers or tiktoken backend) and chat template."""

from kimiserve.tokenizer.tokenizer import (
    DEFAULT_SYSTEM_PROMPT,
    NUM_SPECIAL_SLOTS,
    ONIG_PAT_STR,
    PAT_STR,
    KimiTokenizer,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "NUM_SPECIAL_SLOTS",
    "ONIG_PAT_STR",
    "PAT_STR",
    "KimiTokenizer",
    "load_tokenizer",
]
