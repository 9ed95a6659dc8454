"""StructuredOutputsParams: what a request's output must match (vLLM's `structured_outputs`).

Plain data, checked here for shape only (no grammar library needed); whether the grammar compiles
is checked by `StructuredOutputManager.compile` (the server does it before queuing, so a grammar
that cannot compile is a 400 naming the problem).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 1024
"""Most strings a `choice` list may hold."""
MAX_SPEC_CHARS = 1 << 20
"""Longest grammar, regex or JSON schema text (characters): compile time grows with it."""

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of `json`, `regex`, `choice`, `grammar` or `json_object` (vLLM's fields)."""

    json: dict | str | None = None
    """A JSON schema (a dict, or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match (Rust `regex` syntax, as llguidance's)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: GBNF/EBNF (`root ::= ...`, as vLLM's examples and llama.cpp) or Lark
    (`start: ...`, llguidance's dialect: `%json {...}` embeds a JSON schema, `<|name|>` a special token)."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    after_reasoning: bool = False
    """Reasoning-aware (vLLM's behaviour with a reasoning parser): tokens inside a `<think>` block are
    free and the grammar applies after `</think>`. A prompt ending inside an open `<think>` starts
    inside it; a prompt ending after `</think>` starts with the grammar; otherwise the first token
    may open `<think>` or start the grammar."""
    trigger: str | None = None
    """Lazy grammar: the output is free until this special token is generated, then the grammar
    (which must start with that token) applies from it on, e.g. the Kimi tool-call section
    (`kimi_tool_call_params(..., lazy=True)`)."""
    prefix: str | None = None
    """Text the constrained output starts with that the caller already put at the end of the prompt
    (a forced start, such as an opened tool call): the matcher consumes its tokens first."""
    whitespace_flexible: bool = False
    """JSON: allow whitespace between tokens (off: compact JSON, which also keeps a model from
    filling its budget with whitespace)."""

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar or json_object "
                             f"(got {got})")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(self.json).__name__}")
        for name in ("regex", "grammar", "trigger", "prefix"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if isinstance(value, str) and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} must be at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must hold at most {MAX_CHOICES} strings")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice[{i}] must be a non-empty string")
            self.choice = list(self.choice)
        for name in ("json_object", "after_reasoning", "whitespace_flexible"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")
        try:
            text = self.key[1]
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply") from None
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} must be at most {MAX_SPEC_CHARS} characters as JSON")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the grammar cache's key): kind, canonical text,
        whitespace. `after_reasoning`, `trigger` and `prefix` act on the engine's side, not the grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind in ("json", "choice"):
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, self.whitespace_flexible
