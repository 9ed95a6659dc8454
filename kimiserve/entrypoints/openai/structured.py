"""Guided decoding fields of chat and completion requests -> StructuredOutputsParams, checked to
compile before the request is queued (a 400 naming the problem), and `logit_bias` -> token ids.

Sources, one per request: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` extra body (`json`, `regex`, `choice`, `grammar`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. The chat handler adds the tool-call grammar
(`tool_choice` required / named, `--enforce-tool-call-grammar`).
"""

from __future__ import annotations

from typing import Any

from kimiserve.entrypoints.openai.errors import OpenAIError
from kimiserve.entrypoints.openai.protocol import SamplingRequest
from kimiserve.entrypoints.openai.serving_utils import ServingContext
from kimiserve.structured_output.params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _spec(param: str, after_reasoning: bool, **fields: Any) -> tuple[StructuredOutputsParams, str]:
    try:
        return StructuredOutputsParams(after_reasoning=after_reasoning, **fields), param
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param) from None


def requested_spec(req: SamplingRequest, after_reasoning: bool = False) -> tuple[StructuredOutputsParams | None, str]:
    """The request's guided decoding (or None) and the request field it came from."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(_spec("response_format", after_reasoning, json_object=True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise OpenAIError("response_format of type 'json_schema' needs json_schema.schema (the JSON schema)", 400,
                              "response_format.json_schema.schema")
        found.append(_spec("response_format.json_schema.schema", after_reasoning, json=rf.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        unknown = sorted(set(so.model_extra or {}))
        if unknown:
            raise OpenAIError(f"structured_outputs.{unknown[0]} is not supported by this server (it takes json, "
                              f"regex, choice, grammar or json_object)", 400, f"structured_outputs.{unknown[0]}")
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": bool(so.json_object)}
        set_fields = [k for k, v in fields.items() if v not in (None, False)]
        param = f"structured_outputs.{set_fields[0]}" if len(set_fields) == 1 else "structured_outputs"
        found.append(_spec(param, after_reasoning, **{k: v for k, v in fields.items() if k in set_fields}))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append(_spec(name, after_reasoning, **{kind: value}))
    if len(found) > 1:
        raise OpenAIError(f"{found[1][1]} cannot be combined with {found[0][1]}: give one kind of guided decoding",
                          400, found[1][1])
    return found[0] if found else (None, "")


async def check_compiles(ctx: ServingContext, spec: StructuredOutputsParams | None, param: str) -> None:
    """400 naming the problem when the grammar does not compile (compiled in a worker thread; the
    engine then finds it in its cache)."""
    if spec is None:
        return
    try:
        await ctx.run_blocking(ctx.engine.engine.structured_outputs.compile, spec)
    except ValueError as exc:
        message = str(exc)
        if not param.startswith("structured_outputs"):
            message = f"{param}: {message}"
        raise OpenAIError(message, 400, param) from None
