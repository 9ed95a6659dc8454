"""Request models of the Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens).

Known fields are type-checked strictly (a bad value is a 400 in the Anthropic error shape naming
the field); unknown ones pass (`metadata`, `service_tier`, `cache_control` on blocks: prefix
caching is automatic here). Content is text: image and document blocks are a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: StrictStr


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: StrictStr | None = None


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


Block = Annotated[Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock],
                  Field(discriminator="type")]
BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _check_block_types(value: Any) -> Any:
    """A clear 400 for block types this text-only server does not take (before the union's own)."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise ValueError(f"content[{i}]: block type {kind!r} is not supported: this model takes text "
                                 f"(blocks of type {', '.join(BLOCK_TYPES)})")
    return value


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _block_types(cls, value: Any) -> Any:
        return _check_block_types(value)


class Tool(AnthropicModel):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        if value is not None and value != "custom":
            raise ValueError(f"tool type {value!r} is not supported: only custom tools (name, description, "
                             f"input_schema) run here; server tools (web search, code execution, ...) do not")
        return value


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(None, ge=1)


class JSONOutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(AnthropicModel):
    format: JSONOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(AnthropicModel):
    model: StrictStr | None = None
    messages: list[Message] = Field(..., min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None
    """The structured-outputs beta's name for output_config.format."""

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(..., ge=1)
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = False
    temperature: Float | None = Field(None, ge=0, le=1)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)


UNSUPPORTED_MESSAGES_FIELDS = ("mcp_servers", "container", "context_management")
"""Messages API fields that would change what the client gets and that this server does not implement
(a 400 naming the field when set)."""
