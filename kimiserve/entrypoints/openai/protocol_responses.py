"""Request models of the OpenAI Responses API (POST /v1/responses).

Known fields are type-checked strictly (a bad value is a 400 naming the field); unknown ones pass
(`service_tier`, `prompt_cache_key`, `safety_identifier`, ...). Input is text: messages with
input_text / output_text parts, function_call and function_call_output items, reasoning items;
images, files, audio, hosted tools and item references are a 400 that says so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class ResponsesModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(ResponsesModel):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class RefusalPart(ResponsesModel):
    type: Literal["refusal"]
    refusal: StrictStr


Part = Annotated[Union[TextPart, RefusalPart], Field(discriminator="type")]
PART_TYPES = ("input_text", "output_text", "text", "refusal")


class MessageItem(ResponsesModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[Part]
    id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in PART_TYPES:
                    raise ValueError(f"content[{i}]: part type {kind!r} is not supported: this model takes text "
                                     f"(parts of type input_text or output_text)")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class FunctionCallItem(ResponsesModel):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None


class FunctionCallOutputItem(ResponsesModel):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[TextPart]
    id: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(ResponsesModel):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(ResponsesModel):
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                      Field(discriminator="type")]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(ResponsesModel):
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(ResponsesModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(ResponsesModel):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextConfig(ResponsesModel):
    format: TextFormat | None = None


class ReasoningConfig(ResponsesModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: StrictStr | None = None


class ResponsesRequest(ResponsesModel):
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    store: StrictBool | None = True
    previous_response_id: StrictStr | None = None
    stream: StrictBool | None = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("input is empty: give a string or at least one item")
        out = []
        for i, item in enumerate(value):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}  # an easy input message
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}]: item type {kind!r} is not supported here (items of type "
                                 f"{', '.join(ITEM_TYPES)} are)")
            out.append(item)
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ValueError(f"tools[{i}]: tool type {kind!r} is not supported: only function tools run here")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] != "function":
            raise ValueError(f"tool_choice of type {value['type']!r} is not supported: give none, auto, required or "
                             f"{{\"type\": \"function\", \"name\": ...}}")
        return value


UNSUPPORTED_RESPONSES_FIELDS: dict[str, tuple] = {
    "background": (None, False), "conversation": (None,), "prompt": (None,), "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
"""Responses fields this server does not implement: a 400 naming the field when set to anything but
these values. (`include` is accepted and ignored: it asks for extras, e.g. encrypted reasoning,
that this server does not produce.)"""


def unsupported_responses_field(req: ResponsesRequest) -> str | None:
    extra = req.model_extra or {}
    for name, inert in UNSUPPORTED_RESPONSES_FIELDS.items():
        if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in inert):
            return name
    return None
