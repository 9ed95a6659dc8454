"""The grammar of Kimi's tool-call section, built from the declared tools' JSON schemas.

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON args}<|tool_call_end|>
      ...
    <|tool_calls_section_end|>

Every call's arguments follow the JSON schema of the function it names (compact JSON), and the
calls are numbered 0, 1, ... so their ids (the whole `functions.NAME:IDX` header, as the parser
reads them) are distinct. A Lark grammar in llguidance's dialect (special tokens as `<|name|>`,
JSON schemas embedded with `%json`). Used by the chat server for `tool_choice` "required", a named
function and `--enforce-tool-call-grammar` (lazily, from the section's first token), and meant
for any API that forces tool calls (`kimi_tool_call_params`).
"""

from __future__ import annotations

import json
from typing import Any

from kimiserve.structured_output.params import StructuredOutputsParams

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MAX_PARALLEL_CALLS = 16
"""Most calls one section may hold under the grammar (parallel calls)."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def functions_of_openai_tools(tools: list[dict]) -> dict[str, dict | None]:
    """{name: parameters schema or None} of OpenAI-shaped tools ({"type": "function", "function": {...}})."""
    return {t["function"]["name"]: t["function"].get("parameters") for t in tools}


def kimi_tool_call_grammar(functions: dict[str, dict | None], name: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar of one tool-call section calling `functions` ({name: JSON schema of its
    arguments, None for any object}); `name`: only that function, once; `parallel` False: one call."""
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    if name is not None:
        if name not in functions:
            raise ValueError(f"function {name!r} is not among the tools ({', '.join(functions)})")
        functions, parallel = {name: functions[name]}, False
    lines = []
    names = list(functions)
    for k, fn in enumerate(names):
        schema = dict(functions[fn] if functions[fn] is not None else ANY_OBJECT)
        schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON, as the chat template writes it
        lines.append(f"args{k}: {ARG_BEGIN} %json {json.dumps(schema, ensure_ascii=False)}")
    calls = MAX_PARALLEL_CALLS if parallel else 1
    for i in range(calls):
        alts = " | ".join(f"{json.dumps(f'functions.{fn}:{i}')} args{k}" for k, fn in enumerate(names))
        lines.append(f"call{i}: {CALL_BEGIN} ({alts}) {CALL_END}")
        lines.append(f"calls{i}: call{i}" + (f" calls{i + 1}?" if i + 1 < calls else ""))
    return "\n".join([f"start: {SECTION_BEGIN} calls0 {SECTION_END}", *lines]) + "\n"


def kimi_tool_call_params(functions: dict[str, dict | None], name: str | None = None, parallel: bool = True,
                          lazy: bool = False, prefix: str | None = None) -> StructuredOutputsParams:
    """Guided decoding of a tool-call section: from the first output token (`tool_choice` required
    or named), or lazily from the moment the model opens a section (`lazy`). `prefix`: the start of
    the section already forced at the end of the prompt (the matcher starts past it)."""
    return StructuredOutputsParams(grammar=kimi_tool_call_grammar(functions, name, parallel),
                                   trigger=SECTION_BEGIN if lazy else None, prefix=prefix)
