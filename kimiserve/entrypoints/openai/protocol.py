"""Request models of the OpenAI-compatible API (pydantic 2).

Unknown fields are allowed (as vLLM allows them: clients send `user`, `metadata`, ...); known
fields are type-checked strictly (no "1" for an int, no "yes" for a bool) and range-checked, so
a bad value is a 400 naming the field. Sampling ranges that SamplingParams also checks are
repeated here only where the request's name for a field differs from the engine's.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from kimiserve.sampling_params import MAX_LOGPROBS

Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
TOOL_NAME = re.compile(r"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*")
"""Tool names: OpenAI's [a-zA-Z0-9_-]{1,64}, plus inner dots (what the Kimi tool-call format parses)."""


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` extra body (exactly one of these)."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: StrictStr | None = None
    n: StrictInt | None = Field(1, ge=1)
    temperature: Float | None = Field(None, ge=0)
    top_p: Float | None = Field(None, gt=0, le=1)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = None
    user: StrictStr | None = None
    # vLLM's extra sampling parameters
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, gt=0)
    min_tokens: StrictInt = Field(0, ge=0)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    bad_words: list[StrictStr] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    thinking_token_budget: StrictInt | None = Field(None, ge=0)
    """Most tokens of reasoning (vLLM's name); then `</think>` is forced. Also `max_thinking_tokens`."""
    max_thinking_tokens: StrictInt | None = Field(None, ge=0)

    @field_validator("n")
    @classmethod
    def _n_default(cls, value: int | None) -> int:
        return 1 if value is None else value


class CompletionRequest(SamplingRequest):
    prompt: Any = Field(..., description="str, list of str, list of token ids, or list of lists of token ids")
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)
    add_special_tokens: StrictBool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def ids(v) -> bool:
            return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if ids(value) or all(isinstance(p, str) for p in value) or all(ids(p) for p in value):
                return value
        if isinstance(value, list) and not value:
            raise ValueError("prompt is empty: give a string, a list of strings, a list of token ids or a list "
                             "of lists of token ids")
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                         "token ids")


class FunctionDefinition(OpenAIBaseModel):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not (1 <= len(value) <= 64 and TOOL_NAME.fullmatch(value)):
            raise ValueError(f"invalid function name {value!r}: 1 to 64 letters, digits, '_', '-' or inner dots")
        return value

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and "type" in value and value["type"] != "object":
            raise ValueError(f"parameters must be a JSON schema of type 'object', got type {value['type']!r}")
        if value is not None and "properties" in value and not isinstance(value["properties"], dict):
            raise ValueError("parameters.properties must be an object")
        return value


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: StrictStr


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(OpenAIBaseModel):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] | None = None


class AssistantToolCall(OpenAIBaseModel):
    id: StrictStr | None = None
    type: Literal["function"] | None = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    def text(self) -> str | None:
        """The content as one string (its text parts joined), or None."""
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return self.content


def check_text_only(messages: list[ChatMessage]) -> None:
    """This model reads text only: every content part must be {"type": "text", "text": "..."}.
    Raises ValueError naming the part (a 400 at the server)."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"messages[{i}].content[{j}].type: {kind!r} is not supported: this model takes "
                                 f"text only (content parts of type 'text')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}].text: expected a string, got "
                                 f"{type(part.get('text')).__name__}")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extras
    echo: StrictBool = False
    """Start the reply with the last message's content when that message is the assistant's."""
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    """Render the final message open-ended so the model continues it (needs add_generation_prompt false)."""
    include_reasoning: StrictBool = True


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either `prompt` or `messages` (then the chat template is applied)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


UNSUPPORTED_FIELDS: dict[str, tuple] = {
    # name: the values that mean "not used" (accepted); any other value is a 400 naming the field
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "early_stopping": (None, False),
    "logits_processors": (None,), "truncate_prompt_tokens": (None,), "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True), "mm_processor_kwargs": (None,), "documents": (None,),
    "chat_template": (None,), "functions": (None,), "function_call": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "priority": (None, 0), "reasoning_effort": (None,),
    "cache_salt": (None,),
}
"""Request fields that OpenAI or vLLM define and this server does not implement. Unknown fields
(`user`, `metadata`, ...) pass, as in vLLM; these would silently change what the client gets."""


def unsupported_field(req: OpenAIBaseModel) -> str | None:
    """The first field of UNSUPPORTED_FIELDS that the request sets to a value that would need it."""
    extra = req.model_extra or {}
    for name, inert in UNSUPPORTED_FIELDS.items():
        if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in inert):
            return name
    return None

