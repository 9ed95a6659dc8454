"""Kimi reasoning / tool-call parsers: whole-text results and chunking-invariant streaming."""

from __future__ import annotations

import json
import random

import pytest

from kimiserve.entrypoints.openai.chat_output import ChatOutputParser, DeltaMessage, ParsedMessage
from kimiserve.entrypoints.openai.reasoning_parser import KimiReasoningParser
from kimiserve.entrypoints.openai.tool_parser import (
    MAX_HEADER_CHARS,
    KimiToolParser,
    ToolCall,
    ToolCallDelta,
)

pytestmark = pytest.mark.fixed_threads  # no torch: parsing only: OMP_NUM_THREADS changes nothing

SB = "<|tool_calls_section_begin|>"
SE = "<|tool_calls_section_end|>"
CB = "<|tool_call_begin|>"
AB = "<|tool_call_argument_begin|>"
CE = "<|tool_call_end|>"


def call(header: str, args: str) -> str:
    return f"{CB}{header}{AB}{args}{CE}"


def as_content(text: str) -> tuple[str, tuple[str, str, list]]:
    """A sample whose whole text comes back as content, with no reasoning and no calls."""
    return text, ("", text, [])


WEATHER = '{"city": "Paris"}'
TIME = '{"tz": "CET"}'
NESTED = json.dumps(
    {
        "query": {"filter": {"tags": ["a", "b"], "expr": "x < 3 && y > 2"}, "limit": [1, {"n": 2}]},
        "text": 'He said "hi" {not json} </think> <|tool_call <div class="x">',
        "unicode": "日本語 🌍 naïve",
        "escaped": "\\u003c|tool_call_end|\\u003e",
    },
    ensure_ascii=False,
)
W = ("functions.get_weather:0", "get_weather", WEATHER)
T = ("functions.get_time:1", "get_time", TIME)

# name -> (text, streamed (reasoning, content, calls), parse() result when it differs)
WELL_FORMED = {
    "reasoning_only": ("<think>Let me think about 2+2.</think>", ("Let me think about 2+2.", "", [])),
    "content_only": as_content("The answer is 4."),
    "reasoning_content": (
        "<think>2+2 is basic arithmetic.</think>The answer is **4**.",
        ("2+2 is basic arithmetic.", "The answer is **4**.", []),
    ),
    "leading_whitespace": ("\n  <think>r</think>\n\nc", ("r", "\n\nc", [])),
    "empty_reasoning": ("<think></think>Hello!", ("", "Hello!", [])),
    "multiline_reasoning": (
        "<think>Step 1: a < b.\nStep 2: <b>bold</b> isn't </thinking>.\n</think>Done",
        ("Step 1: a < b.\nStep 2: <b>bold</b> isn't </thinking>.\n", "Done", []),
    ),
    "reasoning_ends_at_section": (
        f"<think>Need the weather.{SB}{call('functions.get_weather:0', WEATHER)}{SE}",
        ("Need the weather.", "", [W]),
    ),
    "one_call": (
        f"<think>I should look it up.</think>{SB}{call('functions.get_weather:0', WEATHER)}{SE}",
        ("I should look it up.", "", [W]),
    ),
    "parallel_calls": (
        f"<think>reasoning text</think>answer text{SB}{call('functions.get_weather:0', WEATHER)}"
        f"{call('functions.get_time:1', TIME)}{SE}",
        ("reasoning text", "answer text", [W, T]),
    ),
    "three_calls_no_reasoning": (
        f"{SB}{call('functions.a:0', '{}')}{call('functions.b:1', '[]')}{call('functions.a:2', '1')}{SE}",
        ("", "", [("functions.a:0", "a", "{}"), ("functions.b:1", "b", "[]"),
                  ("functions.a:2", "a", "1")]),
    ),
    "nested_json": (
        f"<think>Search.</think>{SB}{call('functions.search:0', NESTED)}{SE}",
        ("Search.", "", [("functions.search:0", "search", NESTED)]),
    ),
    "whitespace_between_markers": (
        f"<think>r</think>\n{SB}\n{CB} functions.search:0 \n{AB}" + '{"q": "x"}' + f"{CE}\n\n"
        f"{CB}functions.search:1{AB}" + ' {"q": "y"}\n ' + f"{CE}\n{SE}",
        ("r", "\n", [("functions.search:0", "search", '{"q": "x"}'),
                     ("functions.search:1", "search", ' {"q": "y"}\n ')]),
    ),
    "content_before_section": (
        f"<think>r</think>Let me check the weather.{SB}{call('functions.get_weather:0', WEATHER)}{SE}",
        ("r", "Let me check the weather.", [W]),
    ),
    "text_after_section": (
        f"<think>r</think>{SB}{call('functions.get_weather:0', WEATHER)}{SE}\nDone.",
        ("r", "\nDone.", [W]),
    ),
    "two_sections": (
        f"A{SB}{call('functions.get_weather:0', WEATHER)}{SE}"
        f"B{SB}{call('functions.get_time:1', TIME)}{SE}C",
        ("", "ABC", [W, T]),
    ),
    "bare_name": (
        f"{SB}{call('get_time:0', '{}')}{call('mcp.files-read:1', '{}')}{SE}",
        ("", "", [("get_time:0", "get_time", "{}"), ("mcp.files-read:1", "mcp.files-read", "{}")]),
    ),
    "empty_section": (f"ok{SB}{SE}", ("", "ok", [])),
    "empty_arguments": (
        f"{SB}{call('functions.ping:0', '')}{SE}", ("", "", [("functions.ping:0", "ping", "")])
    ),
    "forced_tool_prefix": (
        f"<think></think>{SB}{CB}functions.get_weather:0{AB}" + '{"city": "Oslo"}' + f"{CE}{SE}",
        ("", "", [("functions.get_weather:0", "get_weather", '{"city": "Oslo"}')]),
    ),
    "no_section_end": (
        f"x{SB}{call('functions.get_weather:0', WEATHER)}\n",
        ("", "x", [W]),
    ),
    "markup_in_content": as_content("<b>bold</b> <|im_end|> < <| <|tool"),
    "empty": as_content(""),
}

RAW_TRUNC_ARGS = f"{SB}{CB}functions.get_weather:0{AB}" + '{"city": "Par'
RAW_PARTIAL_END = f"{SB}{CB}functions.get_weather:0{AB}" + '{"city": "Paris"}<|tool_ca'
SECOND_TRUNC = f"{CB}functions.get_time:1{AB}" + '{"tz"'
LONG_NAME = "f" * (MAX_HEADER_CHARS + 1)

MALFORMED = {
    "truncated_mid_header": (
        f"<think>r</think>Sure.{SB}{CB}functions.get_wea",
        ("r", f"Sure.{SB}{CB}functions.get_wea", []),
    ),
    "truncated_mid_argument_marker": as_content(f"{SB}{CB}functions.get_weather:0<|tool_call_arg"),
    "truncated_mid_arguments": (
        "<think>r</think>" + RAW_TRUNC_ARGS,
        ("r", "", [("functions.get_weather:0", "get_weather", '{"city": "Par')]),
        ("r", RAW_TRUNC_ARGS, []),
    ),
    "truncated_mid_call_end": (
        RAW_PARTIAL_END,
        ("", "", [("functions.get_weather:0", "get_weather", '{"city": "Paris"}<|tool_ca')]),
        ("", RAW_PARTIAL_END, []),
    ),
    "second_call_truncated": (
        f"{SB}{call('functions.get_weather:0', WEATHER)}{SECOND_TRUNC}",
        ("", "", [W, ("functions.get_time:1", "get_time", '{"tz"')]),
        ("", SECOND_TRUNC, [W]),
    ),
    "section_begin_only": ("Hmm.<|tool_calls_section_begin|>", ("", "Hmm." + SB, [])),
    "section_begin_partial_call_marker": as_content(f"Hmm.{SB}\n<|tool_call_be"),
    "section_begin_then_text": as_content(
        f"Hmm.{SB}I will call a tool.{call('functions.get_weather:0', WEATHER)}{SE}"
    ),
    "missing_argument_marker": as_content(f"{SB}{CB}functions.get_weather:0{WEATHER}{CE}{SE}after"),
    "missing_index": as_content(f"{SB}{call('functions.get_weather', WEATHER)}{SE}"),
    "empty_name": as_content(f"{SB}{call('functions.:0', '{}')}{SE}"),
    "name_with_space": as_content(f"{SB}{call('functions.get weather:0', '{}')}{SE}"),
    "empty_header": as_content(f"{SB}{call(' ', '{}')}{SE}"),
    "header_too_long": as_content(f"{SB}{call(LONG_NAME + ':0', '{}')}{SE}"),
    "bad_header_after_good_call": (
        f"{SB}{call('functions.get_weather:0', WEATHER)}\n{call('bad name:1', '{}')}"
        f"{call('functions.get_time:2', TIME)}{SE}tail",
        ("", f"\n{call('bad name:1', '{}')}{call('functions.get_time:2', TIME)}{SE}tail", [W]),
    ),
    "stray_call_end_in_text": as_content(f"Result{CE} here"),
    "stray_call_begin_in_text": as_content(f"a{CB}functions.x:0{AB}{{}}b"),
    "stray_call_end_in_section": as_content(f"{SB}{CE}{SE}"),
    "doubled_call_end": (
        f"{SB}{call('functions.get_weather:0', WEATHER)}{CE}{SE}x",
        ("", f"{CE}{SE}x", [W]),
    ),
    "stray_section_end": as_content(f"a{SE}b"),
    "close_think_without_open": as_content("I think so.</think>Yes."),
    "think_not_at_start": as_content("Hi <think>r</think>c"),
    "unterminated_reasoning": ("<think>still thinking", ("still thinking", "", [])),
    "reasoning_partial_close": ("<think>still </thi", ("still </thi", "", [])),
    "partial_think_open": as_content(" <thi"),
    "think_open_only": ("<think>", ("", "", [])),
    "whitespace_only": as_content("  \n"),
    "doubled_think": ("<think><think>r</think></think>c", ("<think>r", "</think>c", [])),
    "doubled_section_begin": as_content(f"{SB}{SB}{call('functions.get_weather:0', WEATHER)}{SE}"),
    "doubled_call_begin": as_content(f"{SB}{CB}{call('functions.get_weather:0', WEATHER)}{SE}"),
    "doubled_argument_marker": (
        f"{SB}{call('functions.get_weather:0', AB + WEATHER)}{SE}",
        ("", "", [("functions.get_weather:0", "get_weather", AB + WEATHER)]),
    ),
    "doubled_section_end": (
        f"{SB}{call('functions.get_weather:0', WEATHER)}{SE}{SE}",
        ("", SE, [W]),
    ),
    "garbage_in_section": as_content(f"{SB}\n hello {call('functions.get_weather:0', WEATHER)}{SE}"),
    "non_ascii_name": as_content(f"{SB}{call('functions.wetter_ü:0', '{}')}{SE}"),
}

SAMPLES = {**WELL_FORMED, **MALFORMED}


def chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] if size else [text]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assemble(messages: list[DeltaMessage]) -> tuple[str, str, list[tuple[str, str, str]]]:
    """Accumulate deltas; checks each call's id/name come once, first, and indices are 0..n-1."""
    calls: dict[int, list] = {}
    for m in messages:
        for d in m.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.name is not None and d.arguments == ""
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None and d.arguments
                calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return (
        "".join(m.reasoning_content for m in messages),
        "".join(m.content for m in messages),
        [tuple(calls[i]) for i in range(len(calls))],
    )


def stream(parts: list[str], reasoning: bool = True, tools: bool = True):
    parser = ChatOutputParser(reasoning=reasoning, tools=tools)
    return assemble([parser.feed(p) for p in parts] + [parser.finish()])


def parsed(text: str, reasoning: bool = True, tools: bool = True):
    msg = ChatOutputParser(reasoning=reasoning, tools=tools).parse(text)
    calls = [(c.id, c.name, c.arguments) for c in msg.tool_calls]
    return msg.reasoning_content or "", msg.content or "", calls


@pytest.mark.parametrize("name", list(SAMPLES))
@pytest.mark.parametrize("size", [1, 2, 3, 7, 0])
def test_streaming_result_is_documented_and_chunking_invariant(name, size):
    text, expected = SAMPLES[name][:2]
    assert stream(chunks(text, size)) == expected


@pytest.mark.parametrize("name", list(SAMPLES))
def test_parse_result(name):
    text, expected, *whole = SAMPLES[name]
    assert parsed(text) == (whole[0] if whole else expected)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_random_splits(name):
    text, expected = SAMPLES[name][:2]
    rng = random.Random(f"kimi-{name}")
    for _ in range(40):
        assert stream(random_chunks(text, rng)) == expected


@pytest.mark.parametrize("name", list(SAMPLES))
def test_reasoning_parser_alone(name):
    text = SAMPLES[name][0]
    reasoning, content = KimiReasoningParser().extract(text)
    for size in (1, 2, 3, 7, 0):
        p = KimiReasoningParser()
        outs = [p.feed(c) for c in chunks(text, size)] + [p.finish()]
        assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (reasoning or "", content)
    if reasoning is None:
        assert content == text


@pytest.mark.parametrize("name", list(SAMPLES))
def test_tool_parser_alone(name):
    text = SAMPLES[name][0]
    results = set()
    for size in (1, 2, 3, 7, 0):
        p = KimiToolParser()
        pieces = [p.feed(c) for c in chunks(text, size)] + [p.finish()]
        msgs = [DeltaMessage(content=c, tool_calls=d) for c, d in pieces]
        r, content, calls = assemble(msgs)
        results.add((content, tuple(calls)))
    assert len(results) == 1
    content, calls = KimiToolParser().extract(text)
    if name in WELL_FORMED:
        assert results == {(content, tuple((c.id, c.name, c.arguments) for c in calls))}


@pytest.mark.parametrize("name", list(SAMPLES))
@pytest.mark.parametrize("reasoning,tools", [(False, True), (True, False), (False, False)])
def test_disabled_parts(name, reasoning, tools):
    text = SAMPLES[name][0]
    got = [stream(chunks(text, size), reasoning, tools) for size in (1, 3, 0)]
    assert got[0] == got[1] == got[2]
    r, content, calls = got[0]
    if not reasoning:
        assert r == ""
    if not tools:
        assert calls == []
    if not reasoning and not tools:
        assert content == text
    if name in WELL_FORMED:
        assert got[0] == parsed(text, reasoning, tools)


def test_reasoning_disabled_keeps_think_in_content():
    text = "<think>plan</think>answer"
    assert stream(chunks(text, 1), reasoning=False) == ("", text, [])
    assert ChatOutputParser(reasoning=False, tools=True).parse(text) == ParsedMessage(None, text, [])


def test_tools_disabled_keeps_markers_in_content():
    text = f"<think>plan</think>x{SB}{call('functions.get_weather:0', WEATHER)}{SE}"
    expected = ("plan", f"x{SB}{call('functions.get_weather:0', WEATHER)}{SE}", [])
    assert stream(chunks(text, 2), tools=False) == expected
    assert parsed(text, tools=False) == expected


def test_parse_message_shape():
    parser = ChatOutputParser(reasoning=True, tools=True)
    text = WELL_FORMED["one_call"][0]
    assert parser.parse(text) == ParsedMessage(
        "I should look it up.", None, [ToolCall("functions.get_weather:0", "get_weather", WEATHER)]
    )
    assert parser.parse("<think></think>Hi") == ParsedMessage(None, "Hi", [])
    assert parser.parse("") == ParsedMessage(None, "", [])
    assert parser.parse("<think>r</think>") == ParsedMessage("r", "", [])


def test_header_sent_as_soon_as_complete():
    text = WELL_FORMED["parallel_calls"][0]
    parser = ChatOutputParser(reasoning=True, tools=True)
    seen = []
    for i, ch in enumerate(text):
        for d in parser.feed(ch).tool_calls:
            if d.id is not None:
                seen.append((i + 1, d))
    ends = [i + len(AB) for i in range(len(text)) if text.startswith(AB, i)]
    assert [pos for pos, _ in seen] == ends
    assert [d for _, d in seen] == [
        ToolCallDelta(0, "functions.get_weather:0", "get_weather", ""),
        ToolCallDelta(1, "functions.get_time:1", "get_time", ""),
    ]


def test_arguments_stream_as_they_arrive():
    parser = KimiToolParser()
    assert parser.feed(f"Hi{SB}{CB}functions.f:0") == ("Hi", [])
    assert parser.feed(f"{AB}" + '{"a": ') == ("", [ToolCallDelta(0, "functions.f:0", "f", ""),
                                                  ToolCallDelta(0, None, None, '{"a": ')])
    assert parser.feed("1}<|tool_") == ("", [ToolCallDelta(0, None, None, "1}")])
    assert parser.feed("call_end|>") == ("", [])
    assert parser.feed(f"{SE}ok") == ("ok", [])
    assert parser.finish() == ("", [])


def test_invalid_header_released_early():
    parser = KimiToolParser()
    assert parser.feed(f"{SB}{CB}get weather") == (f"{SB}{CB}get weather", [])
    assert parser.feed(f"{AB}{{}}{CE}{SB}") == (f"{AB}{{}}{CE}{SB}", [])
    assert parser.finish() == ("", [])


@pytest.mark.parametrize(
    "header", ["functions.:", "functions.f:0{", "functions.f:0 x", ".f", "f..g", "f:0:", "f:x", "f<b", "f <"]
)
def test_header_that_cannot_be_valid_is_released_before_more_text(header):
    parser = KimiToolParser()
    assert parser.feed(f"{SB}{CB}") == ("", [])
    assert parser.feed(header) == (f"{SB}{CB}{header}", [])


@pytest.mark.parametrize(
    "header",
    ["", " ", "functions", "functions.", "functions.f", "f.g", "f:", "f:12", "f:1 ", "f:1<|tool_call_arg"],
)
def test_header_prefix_that_may_be_valid_is_held(header):
    parser = KimiToolParser()
    assert parser.feed(f"{SB}{CB}{header}") == ("", [])
    assert parser.finish() == (f"{SB}{CB}{header}", [])


def test_long_whitespace_runs_are_linear():
    parser = ChatOutputParser(reasoning=True, tools=True)
    msgs = [parser.feed("\n") for _ in range(100_000)]
    msgs += [parser.feed(f"<think>r</think>{SB}{call('functions.f:0', '{}')}")]
    msgs += [parser.feed(" ") for _ in range(100_000)] + [parser.feed(SE + "x"), parser.finish()]
    assert assemble(msgs) == ("r", "x", [("functions.f:0", "f", "{}")])


def test_forced_prefix_fed_first():
    parser = ChatOutputParser(reasoning=True, tools=True)
    first = parser.feed(f"<think></think>{SB}{CB}functions.get_weather:0{AB}")
    assert first == DeltaMessage("", "", [ToolCallDelta(0, "functions.get_weather:0", "get_weather", "")])
    rest = [parser.feed(c) for c in chunks('{"city": "Oslo"}' + CE + SE, 4)] + [parser.finish()]
    oslo = ("functions.get_weather:0", "get_weather", '{"city": "Oslo"}')
    assert assemble([first, *rest]) == ("", "", [oslo])


def test_truncated_call_keeps_what_was_sent_and_flushes_tail():
    parser = KimiToolParser()
    content, deltas = parser.feed(RAW_PARTIAL_END)
    assert content == "" and deltas[-1].arguments == '{"city": "Paris"}'
    assert parser.finish() == ("", [ToolCallDelta(0, None, None, "<|tool_ca")])


def test_delta_message_empty():
    assert DeltaMessage().empty
    assert not DeltaMessage(content="x").empty
    assert not DeltaMessage(reasoning_content="x").empty
    assert not DeltaMessage(tool_calls=[ToolCallDelta(0, None, None, "")]).empty


def test_parser_is_reusable_after_finish():
    parser = ChatOutputParser(reasoning=True, tools=True)
    text = WELL_FORMED["parallel_calls"][0]
    first = assemble([parser.feed(text), parser.finish()])
    assert assemble([parser.feed(text), parser.finish()]) == first


def test_long_arguments_stream_in_order():
    args = json.dumps({"items": [{"i": i, "s": "<" * (i % 5) + "x"} for i in range(500)]})
    text = f"<think>r</think>{SB}{call('functions.bulk:0', args)}{SE}"
    assert stream(chunks(text, 5)) == ("r", "", [("functions.bulk:0", "bulk", args)])
