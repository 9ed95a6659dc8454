"""Kimi reasoning parser: splits ``<think>...</think>`` from the answer, whole-text and streaming.

An output has reasoning only when it starts with ``<think>`` (after optional whitespace, which
is dropped); otherwise all of it is content, ``</think>`` included. Reasoning ends at the first
``</think>`` (dropped) or the first ``<|tool_calls_section_begin|>`` (kept, as the start of the
content, for the tool parser). Unterminated reasoning runs to the end of the text.
"""

from __future__ import annotations

from kimiserve.entrypoints.openai.tool_parser import SECTION_BEGIN, partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"
_ENDS = (THINK_END, SECTION_BEGIN)

_START, _REASONING, _CONTENT = range(3)


def _split(body: str) -> tuple[str, str] | None:
    end = body.find(THINK_END)
    section = body.find(SECTION_BEGIN)
    if section != -1 and (end == -1 or section < end):
        return body[:section], body[section:]
    if end != -1:
        return body[:end], body[end + len(THINK_END):]
    return None


class KimiReasoningParser:
    """``extract`` parses a whole output; ``feed``/``finish`` parse a stream."""

    def __init__(self) -> None:
        self._state = _START
        self._buf = ""
        self._space: list[str] = []

    def extract(self, text: str) -> tuple[str | None, str]:
        """(reasoning, or None when the output has no ``<think>``; content)."""
        body = text.lstrip()
        if not body.startswith(THINK_START):
            return None, text
        body = body[len(THINK_START):]
        parts = _split(body)
        return parts if parts is not None else (body, "")

    def feed(self, delta: str) -> tuple[str, str]:
        """Add streamed text; return (reasoning delta, content delta) decidable so far."""
        if self._state == _START and not self._buf:
            body = delta.lstrip()
            self._space.append(delta[: len(delta) - len(body)])
            delta = body
        self._buf += delta
        if self._state == _START:
            body = self._buf
            if body.startswith(THINK_START):
                self._state = _REASONING
                self._buf = body[len(THINK_START):]
                self._space = []
            elif THINK_START.startswith(body):
                return "", ""
            else:
                self._state = _CONTENT
                self._buf = "".join(self._space) + body
                self._space = []
        if self._state == _CONTENT:
            out, self._buf = self._buf, ""
            return "", out
        parts = _split(self._buf)
        if parts is not None:
            self._state = _CONTENT
            self._buf = ""
            return parts
        buf = self._buf
        cut = len(buf) - partial_marker_len(buf, _ENDS)
        self._buf = buf[cut:]
        return buf[:cut], ""

    def finish(self) -> tuple[str, str]:
        """End of stream: release what was held back and reset the parser."""
        buf, state = "".join(self._space) + self._buf, self._state
        self._state, self._buf, self._space = _START, "", []
        return (buf, "") if state == _REASONING else ("", buf)
