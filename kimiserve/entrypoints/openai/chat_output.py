"""Chat output parsing for the OpenAI server: reasoning first, then tool calls on the content.

The server may feed a forced prefix of the assistant output (``<think></think>``, or a tool
section opened up to ``<|tool_call_argument_begin|>``) before the generated text; it is parsed
like any other text. ``parse`` gives ``reasoning_content`` None when there is no reasoning or
it is empty, and ``content`` None when it is empty and there are tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kimiserve.entrypoints.openai.reasoning_parser import KimiReasoningParser
from kimiserve.entrypoints.openai.tool_parser import KimiToolParser, ToolCall, ToolCallDelta


@dataclass
class DeltaMessage:
    """What one streamed step adds to the assistant message."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.reasoning_content or self.content or self.tool_calls)


@dataclass
class ParsedMessage:
    """A whole assistant message."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    merged: list[ToolCallDelta] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and d.id is None and last.index == d.index and last.id is None:
            last.arguments += d.arguments
        else:
            merged.append(d)
    return merged


class ChatOutputParser:
    """Splits model output into reasoning, content and tool calls, as enabled."""

    def __init__(self, reasoning: bool, tools: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._reasoning = KimiReasoningParser() if reasoning else None
        self._tools = KimiToolParser() if tools else None

    def feed(self, delta_text: str) -> DeltaMessage:
        """Add streamed text; return what can be sent now."""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(delta_text)
        else:
            reasoning, content = "", delta_text
        if self._tools is None:
            return DeltaMessage(reasoning, content)
        content, calls = self._tools.feed(content)
        return DeltaMessage(reasoning, content, calls)

    def finish(self) -> DeltaMessage:
        """End of stream: return what was held back."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        if self._tools is None:
            return DeltaMessage(reasoning, content)
        content, calls = self._tools.feed(content)
        tail, more = self._tools.finish()
        return DeltaMessage(reasoning, content + tail, _merge(calls + more))

    def parse(self, text: str) -> ParsedMessage:
        """Parse a whole output (non-streaming)."""
        reasoning: str | None = None
        content = text
        if self.reasoning:
            reasoning, content = KimiReasoningParser().extract(text)
        calls: list[ToolCall] = []
        if self.tools:
            content, calls = KimiToolParser().extract(content)
        return ParsedMessage(reasoning or None, None if not content and calls else content, calls)
