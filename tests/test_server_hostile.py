"""Hostile input, generated: one real server (the random `tiny` model, --max-model-len 256,
--max-request-body-bytes 256 KiB, --body-read-timeout 1 s, an API key, the Kimi reasoning and
tool-call parsers, a chat template reading three chat_template_kwargs), 600 requests from
hypothesis strategies written per endpoint: a mix of valid requests that reach the engine and
generate (a few tokens each) and requests wrong in every way a client can be wrong.

For every request: never a 5xx; a non-2xx body is an OpenAI error `{"error": {"message", "type",
"param", "code"}}` (413, 408 and the 400 for unparsable HTTP included; a 3xx is a redirect with a
Location, not an error; a HEAD's answer has no body to check); a 200 stream ends with
`data: [DONE]` and an error event in it is OpenAI-shaped, last, and not an internal error; the
server logged no traceback and no ERROR meanwhile; afterwards `/health` is 200 and a one-token
completion still succeeds. At the end: no pages held by requests once idle, and a clean exit on
SIGTERM (`running_server`).

Strategies: the `*_FIELDS` tables give every field the request models declare (checked against
the models) a strategy of valid values, edges included (seeds -2**63 and 2**64-1, top_k 2**64,
temperature 5e-324 and 1e308, n = --max-num-seqs, max_tokens at the context's edge, 64 stop
strings of 256 characters, allowed_token_ids that make the model write tool-call markup, ...);
`request_bodies` draws a body valid, with one or several fields hostile (`hostile`: ints up to
2**100 and below -2**64, 1e308, -0.0, subnormals, NaN and Infinity literals, strings for
numbers, lists for objects, null, nested lists; `BAD_FIELD_VALUES`: wrong in the field's own
way), or with UNSUPPORTED_FIELDS and unknown fields added. Text everywhere comes from `texts`:
lone surrogates, NUL, RTL marks, emoji, Jinja syntax, long strings and the model's special-token
text. Bodies go out as JSON with NaN literals allowed and lone surrogates escaped or as raw
(invalid UTF-8) bytes; a few clients send a missing or wrong API key, or hang up early (after a
stream's first line, or before a non-stream answer). Raw bodies: malformed JSON bytes, other
encodings, deep nesting in every field; raw HTTP: odd request lines, headers and framing
(Content-Length, chunked), some pipelined after a good request; GETs: odd model ids, methods and
query strings; fixed cases: bodies just over and at --max-request-body-bytes, a stalled body.

Deterministic (derandomize: CI sets no seed) and about 25 s here. For exploring by hand:
KIMISERVE_HOSTILE_RANDOM=1 draws fresh examples, KIMISERVE_HOSTILE_SCALE=4 four times as many,
KIMISERVE_HOSTILE_LOG=FILE appends each request, its status, time and answer to FILE.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

import h11
import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kimiserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kimiserve.tokenizer.tokenizer import PACKAGED_TEMPLATE
from hostile_requests import (
    ALIAS, API_KEY, AUTH, BODY_LIMIT, C, CHAT, CHAT_FIELDS, COMPLETION_FIELDS, DETOK, DETOKENIZE_FIELDS, GET_ROUTES,
    MAX_MODEL_LEN, REQUEST_TIMEOUT, SENT, SERVER_ARGS, TEMPLATE_SUFFIX, TOK, TOKENIZE_FIELDS, check_error,
    check_fields_cover, check_stream, encode_body, hostile_settings, request_bodies)
from server_utils import metrics, running_server, wait_until

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing


class Hostile:
    """The server under test, its client and its stderr read position (new ERROR lines or a
    traceback are pinned on the request that caused them)."""

    def __init__(self, server):
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT, follow_redirects=False)
        self.auth: dict = dict(AUTH)  # the next request's Authorization header (None: none sent)
        self.err_pos = 0

    def new_stderr(self) -> str:
        err = self.server.stderr()
        new, self.err_pos = err[self.err_pos:], len(err)
        return new

    def send(self, label: str, method: str, path: str, content: bytes | None = None,
             headers: dict | None = None, expect_stream: bool = False) -> httpx.Response:
        shown = content if isinstance(content, bytes) else b"<streamed>" if content is not None else b""
        where = f"{method} {path} {shown[:300]!r}{'...' if len(shown) > 300 else ''}"
        headers = {k: v for k, v in {**self.auth, **(headers or {})}.items() if v is not None}
        self.auth = dict(AUTH)
        t0 = time.monotonic()
        try:
            r = self.http.request(method, path, content=content, headers=headers)
        except httpx.TimeoutException:
            raise AssertionError(f"{where}: no answer in {REQUEST_TIMEOUT} s (a hang)") from None
        SENT[(label, r.status_code)] += 1
        if os.environ.get("KIMISERVE_HOSTILE_LOG"):
            with open(os.environ["KIMISERVE_HOSTILE_LOG"], "a") as f:
                f.write(f"{r.status_code} {time.monotonic() - t0:.3f} {where[:300]!r} {r.text[:300]!r}\n")
        self.check(r, where, method, expect_stream)
        return r

    def check(self, r: httpx.Response, where: str, method: str, expect_stream: bool) -> None:
        assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:1000]}"
        if method == "HEAD":
            pass  # no body to check
        elif 300 <= r.status_code < 400:
            assert r.headers.get("location"), f"{where}: a {r.status_code} without a Location"
        elif r.status_code >= 400:
            assert r.headers.get("content-type", "").startswith("application/json"), f"{where}: {r.headers}"
            try:
                body = r.json()
            except ValueError:
                raise AssertionError(f"{where}: a {r.status_code} whose body is not JSON: {r.text[:500]!r}") from None
            check_error(body, where)
        elif r.status_code < 300 and r.headers.get("content-type", "").startswith("text/event-stream"):
            check_stream(r.text, where)
        elif r.status_code < 300 and r.headers.get("content-type", "").startswith("application/json"):
            body = r.json()
            assert "error" not in body, f"{where}: {body}"
        if expect_stream and r.status_code == 200:
            assert r.headers["content-type"].startswith("text/event-stream"), f"{where}: {r.headers}"
        err = self.new_stderr()
        assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), \
            f"{where}: the server logged\n{err[-5000:]}"

    def alive(self) -> None:
        """/health is 200 and a one-token completion still succeeds."""
        r = self.http.get("/health")
        assert r.status_code == 200, f"/health after the request: {r.status_code} {r.text}"
        r = self.http.post(C, json={"prompt": "hi", "max_tokens": 1}, headers=AUTH)
        assert r.status_code == 200, f"the canary completion after the request: {r.status_code} {r.text}"
        assert r.json()["usage"]["completion_tokens"] == 1, r.text

    def post_json(self, path: str, body, ascii_only: bool, hang_up: bool = False) -> None:
        stream = isinstance(body, dict) and body.get("stream") is True
        content = encode_body(body, ascii_only)
        if hang_up:
            self.hang_up(path, content)
        else:
            self.send(f"POST {path}", "POST", path, content, {"Content-Type": "application/json"},
                      expect_stream=stream)
        self.alive()

    def hang_up(self, path: str, content: bytes) -> None:
        """Send the request and leave early: after the first line of a stream, or before the answer
        (a 50 ms read timeout); the server must abort what it started and free its pages."""
        label, where = f"POST {path} (hung up)", f"POST {path} {content[:300]!r} (hung up)"
        timeout = httpx.Timeout(REQUEST_TIMEOUT, read=0.05)
        with httpx.Client(base_url=self.server.url, timeout=timeout) as client:
            try:
                with client.stream("POST", path, content=content,
                                   headers={"Content-Type": "application/json", **AUTH}) as r:
                    SENT[(label, r.status_code)] += 1
                    assert r.status_code < 500, f"{where}: {r.status_code} {r.read()[:1000]!r}"
                    if r.status_code >= 400:
                        check_error(json.loads(r.read()), where)
                    else:
                        next(r.iter_lines(), None)  # the first line, then the connection closes
            except httpx.ReadTimeout:
                SENT[(label, "left")] += 1
        err = self.new_stderr()
        assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), \
            f"{where}: the server logged\n{err[-5000:]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = time.monotonic()
    template = tmp_path_factory.mktemp("hostile") / "chat_template.jinja"
    template.write_text(PACKAGED_TEMPLATE.read_text(encoding="utf-8") + TEMPLATE_SUFFIX, encoding="utf-8")
    with running_server(*SERVER_ARGS, "--chat-template", str(template)) as s:
        yield s
    summary = ", ".join(f"{label} {status}x{n}" for (label, status), n in sorted(SENT.items(), key=str))
    print(f"\nhostile: {sum(SENT.values())} generated requests in {time.monotonic() - started:.1f} s: {summary}")


@pytest.fixture(scope="module")
def h(server):
    hostile_client = Hostile(server)
    yield hostile_client
    hostile_client.http.close()


def test_strategies_cover_every_declared_field():
    check_fields_cover(COMPLETION_FIELDS, CompletionRequest)
    check_fields_cover(CHAT_FIELDS, ChatCompletionRequest)
    check_fields_cover(TOKENIZE_FIELDS, TokenizeRequest)
    check_fields_cover(DETOKENIZE_FIELDS, DetokenizeRequest)


hang_ups = st.sampled_from([False] * 7 + [True])
"""Now and then the client leaves early (see Hostile.hang_up)."""
auths = st.sampled_from([AUTH] * 60 + [{"Authorization": None}, {"Authorization": "Bearer wrong"},
                                       {"Authorization": f"bearer {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
                                       {"Authorization": "Basic aG9zdGlsZS1rZXk="}, {"Authorization": "Bearer"},
                                       {"Authorization": "Bearer " + "k" * 10000}])
"""The API key (--api-key: /v1 routes need it), now and then missing or wrong."""


@hostile_settings(140)
@given(body=request_bodies(COMPLETION_FIELDS, ("prompt", "max_tokens")), ascii_only=st.booleans(), hang_up=hang_ups,
       auth=auths)
def test_completions(h, body, ascii_only, hang_up, auth):
    h.auth = auth
    h.post_json(C, body, ascii_only, hang_up)


@hostile_settings(160)
@given(body=request_bodies(CHAT_FIELDS, ("messages", "max_tokens")), ascii_only=st.booleans(), hang_up=hang_ups,
       auth=auths)
def test_chat_completions(h, body, ascii_only, hang_up, auth):
    h.auth = auth
    h.post_json(CHAT, body, ascii_only, hang_up)


@hostile_settings(50)
@given(body=st.one_of(request_bodies(TOKENIZE_FIELDS, ("prompt",)), request_bodies(TOKENIZE_FIELDS, ("messages",))),
       ascii_only=st.booleans())
def test_tokenize(h, body, ascii_only):
    h.post_json(TOK, body, ascii_only)


@hostile_settings(40)
@given(body=request_bodies(DETOKENIZE_FIELDS, ("tokens",)), ascii_only=st.booleans())
def test_detokenize(h, body, ascii_only):
    h.post_json(DETOK, body, ascii_only)


MODEL_IDS = ["tiny", ALIAS, "kimi/alias-%C3%A9", "", "nope", "%00", "%ff", "%ed%a0%80", "..%2F..%2Fetc%2Fpasswd",
             "a/b/c", "tiny/", "x" * 3000, "%F0%9F%98%80", "tiny%20", "tiny?x=1", "%7B%7B7*7%7D%7D", "%3Cscript%3E"]
QUERIES = ["", "?", "?a=b&a=c", "?model=\u00e9", "?%ff=%00", "?x=" + "y" * 2000]


@hostile_settings(50)
@given(route=st.one_of(st.sampled_from(GET_ROUTES), st.just("/v1/models/{id}"),
                       st.sampled_from((C, CHAT, TOK, DETOK, "/", "/v1", "/v1/", "/health/", "/nope",
                                        "/openapi.json"))),
       model_id=st.sampled_from(MODEL_IDS), query=st.sampled_from(QUERIES),
       method=st.one_of(st.just("GET"), st.sampled_from(["POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS",
                                                          "PREFLIGHT"])))
@example(route="/health", model_id="tiny", query="", method="GET")
@example(route="/version", model_id="tiny", query="", method="GET")
@example(route="/metrics", model_id="tiny", query="", method="GET")
@example(route="/v1/models", model_id="tiny", query="", method="GET")
@example(route="/v1/models/{id}", model_id=ALIAS, query="", method="GET")
def test_get_routes_and_methods(h, route, model_id, query, method):
    path = route.replace("{id}", model_id) + query
    headers = {}
    if method == "PREFLIGHT":  # CORS preflight: no API key, any origin
        method, headers = "OPTIONS", {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                                      "Authorization": None}
    label = f"{method} {route if route in GET_ROUTES + (C, CHAT, TOK, DETOK) else 'other'}"
    h.send(label, method, path, b"{}" if method in ("POST", "PUT", "PATCH") else None, headers)
    h.alive()


def deep_body(path: str, depth: int, where: str) -> bytes:
    """A body with a list or object nested `depth` deep at `where`, written as text (json.dumps
    itself refuses to go that deep)."""
    open_, close = ("[" * depth, "]" * depth) if where != "object" else ('{"a":' * depth, "}" * depth)
    inner = open_ + "1" + close
    base = {C: '"prompt": "x", "max_tokens": 1',
            CHAT: '"messages": [{"role": "user", "content": "x"}], "max_tokens": 1',
            TOK: '"prompt": "x"', DETOK: '"tokens": [1]'}[path]
    field = {C: "prompt", CHAT: "chat_template_kwargs", TOK: "prompt", DETOK: "tokens"}[path]
    if where == "tools" and path == CHAT:
        return (f'{{{base}, "tool_choice": "required", "tools": [{{"type": "function", "function": {{"name": "f", '
                f'"parameters": {{"type": "object", "properties": {{"a": {inner}}}}}}}}}]}}').encode()
    if where == "content" and path in (CHAT, TOK):
        return (f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "x", "x": {inner}}}]}}], '
                f'"max_tokens": 1}}').encode()
    if where == "arguments" and path in (CHAT, TOK):
        return (f'{{"messages": [{{"role": "user", "content": "x"}}, {{"role": "assistant", "tool_calls": '
                f'[{{"id": "a", "function": {{"name": "f", "arguments": {{"a": {inner}}}}}}}]}}, '
                f'{{"role": "user", "content": "y"}}], "max_tokens": 1}}').encode()
    if where == "template" and path in (CHAT, TOK):
        return (f'{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": 1, '
                f'"chat_template_kwargs": {{"note": {inner}, "tags": {inner}}}}}').encode()
    if where == "unknown":
        return f'{{{base}, "metadata": {inner}}}'.encode()
    if where == "top":
        return inner.encode()
    return f'{{{base}, "{field}": {{"x": {inner}}}}}'.encode() if where == "object" else \
        f'{{{base}, "{field}": {inner}}}'.encode()


VALID_C = b'{"prompt": "hi", "max_tokens": 2}'
RAW_BODIES = [
    b"", b"{", b"}", b"[", b"null", b"true", b"1", b'"str"', b"[]", b"{}", b'{"prompt": "x",}', b"{'prompt': 'x'}",
    b'{"prompt": "x"} trailing', b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}', b"\xff\xfe\x00",
    b'{"prompt": "\xff"}',
    b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}', b'{"prompt": "\\ud800", "max_tokens": 1, "echo": true}',
    b'{"prompt": "x", "prompt": [1, 2], "max_tokens": 1}', b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "x", "seed": -' + b"9" * 4300 + b"}",
    b'{"prompt": "x", "temperature": -Infinity}', b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "n": 1.0}',
    b'{"prompt": "x", "max_tokens": 1, "stream": true, "stream_options": {"include_usage": true}}',
    b"\x00" * 10, '{"prompt": "x", "max_tokens": 1}'.encode("utf-16"), '{"prompt": "x"}'.encode("utf-32"),
    b'{"prompt": "x", "max_tokens": 1}\x00', b'{"prompt": "\x00\x01\x1f", "max_tokens": 1}',
    b'{"prompt": "x", "max_tokens": 1, "stop": "\\u0000"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"tokens": [1, 2, 3]}', b'{"tokens": [1e2]}', b'{"tokens": [01]}', b'{"prompt": "x", "max_tokens": +1}',
    b'{"prompt": "x", "max_tokens": 0x10}', b'{"prompt": "x", "max_tokens": 1, "user": "' + b"\\" * 5 + b'"}',
]


@st.composite
def raw_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["fixed", "fixed", "binary", "truncated", "flipped", "deep"]))
    if kind == "fixed":
        return draw(st.sampled_from(RAW_BODIES))
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        return VALID_C[:draw(st.integers(0, len(VALID_C) - 1))]
    if kind == "flipped":
        i = draw(st.integers(0, len(VALID_C) - 1))
        return VALID_C[:i] + bytes([draw(st.integers(0, 255))]) + VALID_C[i + 1:]
    return b"deep"  # replaced in the test, which knows the path


@hostile_settings(70)
@given(path=st.sampled_from([C, CHAT, TOK, DETOK]), body=raw_bodies(),
       depth=st.sampled_from([50, 500, 900, 990, 1100, 5000, 100_000]),
       where=st.sampled_from(["list", "object", "tools", "content", "arguments", "template", "unknown", "top"]),
       content_type=st.sampled_from(["application/json", "application/json", "text/plain", None,
                                     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                     "application/json; charset=latin-1"]))
def test_raw_bodies(h, path, body, depth, where, content_type):
    if body == b"deep":
        body = deep_body(path, depth, where)
    headers = {"Content-Type": content_type} if content_type else {}
    h.send(f"POST {path}", "POST", path, body, headers)
    h.alive()


RAW_METHODS = [b"GET", b"POST", b"POST", b"HEAD", b"OPTIONS", b"DELETE", b"G\xc3\xa9T", b"PRI", b"", b"get", b"GET /x"]
RAW_TARGETS = [b"/health", b"/version", b"/metrics", b"/v1/models", b"/v1/models/tiny", C.encode(), CHAT.encode(),
               TOK.encode(), DETOK.encode(), b"*", b"http://evil/v1/models", b"/v1/models/a b", b"/v1/models/\xc3\xa9",
               b"/%", b"/%zz", b"//v1//models", b"/v1/models/..", b"/v1/models/%2e%2e", b"/" + b"a" * 20000, b"",
               b"/\x00", b"/\x7f", b"/v1/completions?%ff=%00", b"/v1/completions#frag"]
RAW_VERSIONS = [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9",
                b"HTTP/1.1 x", b"", b"http/1.1"]
RAW_HOSTS = [b"Host: 127.0.0.1", b"Host: 127.0.0.1", None, b"Host: ", b"Host: \xff", b"Host: a\r\nHost: b"]
RAW_HEADERS = [b"X-A: " + b"a" * 20000, b"X-\xff: y", b"X-A: \x00", b"no colon", b" folded: x", b"Content-Type: \xff",
               b"Content-Type: application/json", b"Expect: 100-continue", b"Expect: teapot",
               b"Upgrade: h2c\r\nConnection: Upgrade", b"Authorization: Bearer \xc3\xa9", b"Origin: null",
               b"Accept-Encoding: gzip, br", b"Content-Encoding: gzip", b"Transfer-Encoding: chunked, chunked",
               b": empty-name", b"X-A:" + b" " * 5000, b"Origin: http://\xc3\xa9", b"Authorization: Bearer \xff",
               b"Access-Control-Request-Method: POST\r\nOrigin: http://x", b"Access-Control-Request-Headers: \xff"]
RAW_REQUEST_BODIES = [b"", VALID_C, b'{"prompt": "hi", "max_tokens": 2, "stream": true}', b"{", b"\xff" * 10,
                      b'{"tokens": [1, 2]}', b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}']


@st.composite
def raw_http_requests(draw) -> tuple[list[bytes], bytes]:
    """(the methods, the bytes): a request line, headers and a body framed right or wrong (never a
    body shorter than its Content-Length: that is the stalled-body case, 1 s each), now and then
    after a good request on the same connection."""
    method = draw(st.sampled_from(RAW_METHODS))
    line = b" ".join(x for x in (method, draw(st.sampled_from(RAW_TARGETS)), draw(st.sampled_from(RAW_VERSIONS))) if x)
    headers = [h for h in [draw(st.sampled_from(RAW_HOSTS))] if h is not None]
    if draw(st.integers(0, 3)):
        headers.append(b"Authorization: " + AUTH["Authorization"].encode())
    headers += draw(st.lists(st.sampled_from(RAW_HEADERS), unique=True, max_size=3))
    body = draw(st.sampled_from(RAW_REQUEST_BODIES))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "bad-length", "negative-length",
                                    "two-lengths", "bad-chunk", "te-gzip", "length-short", "te-and-length"]))
    if framing in ("length", "te-and-length"):
        headers.append(b"Content-Length: %d" % len(body))
    if framing in ("chunked", "te-and-length"):
        headers.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif framing == "bad-length":
        bad = [b"abc", b"1e3", b"0x10", b"", b"+5", b"99999999999999999999"]
        headers.append(b"Content-Length: " + draw(st.sampled_from(bad)))
    elif framing == "negative-length":
        headers.append(b"Content-Length: -1")
    elif framing == "two-lengths":
        headers += [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + 1)]
    elif framing == "bad-chunk":
        headers.append(b"Transfer-Encoding: chunked")
        body = draw(st.sampled_from([b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabcdef\r\n0\r\n\r\n", b"-1\r\n\r\n",
                                     b"ffffffffffffffffffff\r\nab\r\n", b"0\r\nX-Trailer: \xff\r\n\r\n"]))
    elif framing == "te-gzip":
        headers.append(b"Transfer-Encoding: gzip")
    elif framing == "length-short" and body:
        headers.append(b"Content-Length: %d" % draw(st.integers(0, len(body) - 1)))  # the rest: a next "request"
    headers.append(b"Connection: close")
    data = line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body
    if draw(st.integers(0, 3)) == 0:  # pipelined after a good request on the same connection
        return [b"GET", method], b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + data
    return [method], data


def raw_exchange(port: int, data: bytes, methods: list[bytes]) -> tuple[list[tuple[int, dict, bytes]], bytes]:
    """Send bytes on a fresh connection and read to EOF; the (status, headers, body) of each final
    response, in order (one per request in `methods`, fewer if the server closed before), and the
    bytes received."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server answered and closed before reading it all
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"{data[:300]!r}: no answer and no close in {REQUEST_TIMEOUT} s") from None
    conn = h11.Connection(h11.CLIENT)
    responses: list[tuple[int, dict, bytes]] = []
    for i, method in enumerate(methods):
        if i:
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                break  # the server closed after the previous response
            conn.start_next_cycle()
        conn.send(h11.Request(method=b"HEAD" if method == b"HEAD" else b"GET", target=b"/", headers=[(b"host", b"x")]))
        conn.send(h11.EndOfMessage())
        if i == 0:
            conn.receive_data(got)
            conn.receive_data(b"")
        status, headers, body = None, {}, b""
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)) or event is h11.NEED_DATA:
                break
        if status is None:
            break
        responses.append((status, headers, body))
    return responses, got


@hostile_settings(80)
@given(request=raw_http_requests())
def test_raw_http(h, server, request):
    methods, data = request
    where = f"raw {data[:300]!r}"
    responses, got = raw_exchange(server.port, data, methods)
    assert len(responses) == len(methods), \
        f"{where}: {len(responses)} responses to {len(methods)} requests: {got[:500]!r}"
    for method, (status, headers, body) in zip(methods, responses):
        assert status < 500, f"{where}: {got[:1000]!r}"
        if status >= 400 and method != b"HEAD":
            assert headers.get("content-type", "").startswith("application/json"), f"{where}: {got[:1000]!r}"
            check_error(json.loads(body), where)
        elif 200 <= status < 300 and headers.get("content-type", "").startswith("text/event-stream"):
            check_stream(body.decode(), where)
    SENT[("RAW http", responses[-1][0])] += 1
    err = h.new_stderr()
    assert "Traceback" not in err and not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), \
        f"{where}: the server logged\n{err[-5000:]}"
    h.alive()


# fixed cases: the body limit, a stalled body -----------------------------------------------------
def test_bodies_over_the_limit_are_413(h):
    over = b'{"prompt": "' + b"x" * (BODY_LIMIT - 13) + b'"}'
    assert len(over) == BODY_LIMIT + 1
    r = h.send(f"POST {C}", "POST", C, over, {"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    h.alive()

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 4096 + 1):
            yield b"y" * 4096
        yield b'"}]}'
    r = h.send(f"POST {CHAT}", "POST", CHAT, chunks(), {"Content-Type": "application/json"})
    assert r.status_code == 413
    h.alive()
    at_limit = b'{"prompt": "' + b"z" * (BODY_LIMIT - 14) + b'"}'  # exactly the limit: read, then too long a prompt
    r = h.send(f"POST {TOK}", "POST", TOK, at_limit, {"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["count"] > MAX_MODEL_LEN
    r = h.send(f"POST {C}", "POST", C, at_limit, {"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    h.alive()


def test_stalled_body_is_408(h, server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        data = b""
        while chunk := s.recv(65536):  # --body-read-timeout 1: a 408, then the server closes
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    SENT[(f"POST {C} (stalled)", status)] += 1
    assert status == 408, data
    error = check_error(json.loads(body), "a stalled body")
    assert "--body-read-timeout" in error["message"]
    h.new_stderr()  # the server logs a WARNING for it
    h.alive()


def test_no_leaked_pages_once_idle(server, h):
    assert sum(SENT.values()) >= 200, SENT
    assert {label.split()[1] for label, _ in SENT} >= {C, CHAT, TOK, DETOK, *GET_ROUTES, "http"}, SENT
    assert any(label == f"POST {C}" and status == 200 for label, status in SENT)
    assert any(label == f"POST {CHAT}" and status == 200 for label, status in SENT)

    def idle():
        m = metrics(server.url)
        return m["kimiserve:num_requests_running"] == 0 and m["kimiserve:num_requests_waiting"] == 0 \
            and m["kimiserve:cache_pages_used_by_requests"] == 0
    assert wait_until(idle, timeout=10), metrics(server.url)
    h.alive()
