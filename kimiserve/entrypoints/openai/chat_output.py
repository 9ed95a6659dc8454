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

THINK_DONE = "<think></think>"
"""An empty reasoning part: what the server forces before a tool call when reasoning is parsed."""


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
    """Splits model output into reasoning, content and tool calls, as enabled.

    `forced`: the text the server appended to the prompt to force a tool call (fed first by the
    caller, as part of the output). Such an output is parsed the streaming way also by `parse`,
    so a call cut short is the same call streamed or not; and if the model does not complete the
    forced call, the server's markup is removed from the content it falls back to."""

    def __init__(self, reasoning: bool, tools: bool, forced: str = "") -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.forced = forced
        self._reasoning = KimiReasoningParser() if reasoning else None
        self._tools = KimiToolParser() if tools else None
        self._markup = forced.removeprefix(THINK_DONE) if tools else ""

    def _unforced(self, content: str) -> str:
        """Content without the forced tool-call markup, which can only lead the first content piece."""
        if self._markup and content:
            content, self._markup = content.removeprefix(self._markup), ""
        return content

    def feed(self, delta_text: str) -> DeltaMessage:
        """Add streamed text; return what can be sent now."""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(delta_text)
        else:
            reasoning, content = "", delta_text
        if self._tools is None:
            return DeltaMessage(reasoning, content)
        content, calls = self._tools.feed(content)
        if calls:
            self._markup = ""  # a committed call took the markup
        return DeltaMessage(reasoning, self._unforced(content), calls)

    def finish(self) -> DeltaMessage:
        """End of stream: return what was held back."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        if self._tools is None:
            return DeltaMessage(reasoning, content)
        content, calls = self._tools.feed(content)
        tail, more = self._tools.finish()
        return DeltaMessage(reasoning, self._unforced(content + tail), _merge(calls + more))

    def parse(self, text: str) -> ParsedMessage:
        """Parse a whole output (non-streaming)."""
        if self.forced:
            return self._parse_streaming(text)
        reasoning: str | None = None
        content = text
        if self.reasoning:
            reasoning, content = KimiReasoningParser().extract(text)
        calls: list[ToolCall] = []
        if self.tools:
            content, calls = KimiToolParser().extract(content)
        return ParsedMessage(reasoning or None, None if not content and calls else content, calls)

    def _parse_streaming(self, text: str) -> ParsedMessage:
        parser = ChatOutputParser(self.reasoning, self.tools, self.forced)
        first, last = parser.feed(text), parser.finish()
        calls: dict[int, ToolCall] = {}
        for d in first.tool_calls + last.tool_calls:
            call = calls.setdefault(d.index, ToolCall(d.id or "", d.name or "", ""))
            call.arguments += d.arguments
        content = first.content + last.content
        reasoning = first.reasoning_content + last.reasoning_content
        return ParsedMessage(reasoning or None, None if not content and calls else content, list(calls.values()))

