"""Kimi tool-call parser (K2 / K2-Thinking format), whole-text and streaming.

Format::

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>
      ...
    <|tool_calls_section_end|>

Whitespace is allowed between markers and around the header. The id of a call is the whole
header (``functions.NAME:IDX``, or a bare ``NAME:IDX``); its name is NAME (letters, digits,
``_``, ``-``, inner dots). Arguments are the raw text between the argument marker and the
first ``<|tool_call_end|>``; they are not validated as JSON. Text outside sections is content;
after a section end, later sections are parsed too. Stray call markers outside a section are
content.

Malformed input never raises. The first point where a section cannot continue (garbage between
calls, a header that cannot become valid, header over ``MAX_HEADER_CHARS``, or end of text
inside the section) turns the raw text since the last committed call (from the section-begin
marker when nothing was committed in that section) plus everything after it into content;
nothing later in the output is parsed as a tool call. ``extract`` commits a call at its
``<|tool_call_end|>``, so complete calls before the failure are kept and a truncated call is
content. Streaming commits a call when its header is complete (its id and name are sent then),
so a call truncated by end of stream keeps what was sent, and the held-back tail of its
arguments is flushed as arguments. An unclosed section that ends right after a complete call
(only whitespace left) is simply closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MAX_HEADER_CHARS = 512

_NAME = r"[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*"
_HEADER = re.compile(rf"(?:functions\.)?({_NAME}):[0-9]+")
_QUALIFIED_NAME = re.compile(rf"(?:functions\.)?{_NAME}")
_NAME_PREFIX = re.compile(r"(?:[A-Za-z0-9_\-]+\.)*[A-Za-z0-9_\-]*")
_DIGITS = re.compile(r"[0-9]*")

_TEXT, _SECTION, _HEADER_STATE, _ARGS, _DEAD = range(5)


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker.

    Every marker starts with ``<``; the caller has already checked that no whole marker
    occurs in ``text``.
    """
    markers = tuple(markers)
    i = text.find("<", max(0, len(text) - max(map(len, markers)) + 1))
    while i != -1:
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return len(text) - i
        i = text.find("<", i + 1)
    return 0


def _header_viable(text: str) -> bool:
    """Whether ``text`` (after the call marker, no ``<`` in it) can still start a valid header."""
    if len(text) > MAX_HEADER_CHARS:
        return False
    body = text.lstrip()
    core = body.rstrip()
    if core != body:
        return _HEADER.fullmatch(core) is not None
    name, colon, idx = core.partition(":")
    if not colon:
        return _NAME_PREFIX.fullmatch(name) is not None
    return _QUALIFIED_NAME.fullmatch(name) is not None and _DIGITS.fullmatch(idx) is not None


@dataclass
class ToolCall:
    """A complete tool call; ``arguments`` is the JSON text as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """Streaming piece of call ``index``: id and name only in its first delta."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class _Out:
    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def text(self, s: str) -> None:
        if s:
            self.content.append(s)

    def args(self, index: int, s: str) -> None:
        if not s:
            return
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index and last.id is None:
            last.arguments += s
        else:
            self.calls.append(ToolCallDelta(index, None, None, s))

    def result(self) -> tuple[str, list[ToolCallDelta]]:
        return "".join(self.content), self.calls


class KimiToolParser:
    """Splits tool calls from content: ``extract`` on a whole output, ``feed``/``finish`` on a stream."""

    def __init__(self) -> None:
        self._eager = True
        self._reset()

    def _reset(self) -> None:
        self._state = _TEXT
        self._buf = ""
        self._raw: list[str] = []
        self._index = 0
        self._call: list[str] | None = None

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """Parse a whole output: (content outside tool sections, complete calls)."""
        parser = KimiToolParser()
        parser._eager = False
        content, deltas = parser.feed(text)
        tail, more = parser.finish()
        calls = [ToolCall(d.id or "", d.name or "", d.arguments) for d in deltas + more]
        return content + tail, calls

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Add streamed text; return (content delta, tool-call deltas) decidable so far."""
        self._buf += delta
        out = _Out()
        while self._step(out):
            pass
        return out.result()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of stream: release what was held back and reset the parser."""
        out = _Out()
        buf = self._buf
        if self._state == _ARGS and self._eager:
            out.args(self._index, buf)
        elif self._state in (_SECTION, _HEADER_STATE, _ARGS):
            rest = "".join(self._raw) + buf
            if self._state != _SECTION or rest.strip():
                out.text(rest)
        else:
            out.text(buf)
        self._reset()
        return out.result()

    def _step(self, out: _Out) -> bool:
        buf = self._buf
        state = self._state
        if state == _TEXT:
            i = buf.find(SECTION_BEGIN)
            if i == -1:
                keep = partial_marker_len(buf, (SECTION_BEGIN,))
                out.text(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            out.text(buf[:i])
            self._raw = [SECTION_BEGIN]
            self._buf = buf[i + len(SECTION_BEGIN):]
            self._state = _SECTION
            return True
        if state == _SECTION:
            body = buf.lstrip()
            if len(body) < len(buf):
                self._raw.append(buf[: len(buf) - len(body)])
                self._buf = body
            if body.startswith(CALL_BEGIN):
                self._raw.append(CALL_BEGIN)
                self._buf = body[len(CALL_BEGIN):]
                self._state = _HEADER_STATE
                return True
            if body.startswith(SECTION_END):
                self._raw = []
                self._buf = body[len(SECTION_END):]
                self._state = _TEXT
                return True
            if CALL_BEGIN.startswith(body) or SECTION_END.startswith(body):
                return False
            return self._fail(out)
        if state == _HEADER_STATE:
            return self._header(out)
        if state == _ARGS:
            i = buf.find(CALL_END)
            if i == -1:
                keep = partial_marker_len(buf, (CALL_END,))
                self._args(out, buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._args(out, buf[:i])
            self._end_call(out)
            self._buf = buf[i + len(CALL_END):]
            self._state = _SECTION
            return True
        out.text(buf)
        self._buf = ""
        return False

    def _header(self, out: _Out) -> bool:
        buf = self._buf
        j = buf.find(ARG_BEGIN)
        if j == -1:
            lt = buf.find("<")
            head = buf if lt == -1 else buf[:lt]
            if lt != -1 and not ARG_BEGIN.startswith(buf[lt:]):
                return self._fail(out)
            return False if _header_viable(head) else self._fail(out)
        header = buf[:j]
        match = _HEADER.fullmatch(header.strip()) if len(header) <= MAX_HEADER_CHARS else None
        if match is None:
            return self._fail(out)
        call_id, name = header.strip(), match.group(1)
        end = j + len(ARG_BEGIN)
        if self._eager:
            out.calls.append(ToolCallDelta(self._index, call_id, name, ""))
            self._raw = []
        else:
            self._call = [call_id, name, ""]
            self._raw.append(buf[:end])
        self._buf = buf[end:]
        self._state = _ARGS
        return True

    def _args(self, out: _Out, s: str) -> None:
        if self._eager:
            out.args(self._index, s)
        elif self._call is not None:
            self._call[2] += s
            self._raw.append(s)

    def _end_call(self, out: _Out) -> None:
        if not self._eager and self._call is not None:
            out.calls.append(ToolCallDelta(self._index, *self._call))
            self._call = None
        self._index += 1
        self._raw = []

    def _fail(self, out: _Out) -> bool:
        out.text("".join(self._raw) + self._buf)
        self._raw = []
        self._buf = ""
        self._call = None
        self._state = _DEAD
        return False
