"""Limits on reading HTTP requests: a body size limit and read timeouts (slowloris).

`BodyLimitMiddleware(app, max_bytes)` is pure ASGI middleware. A request whose `Content-Length`
is over the limit is answered with a 413 before anything reads its body; a body without a
`Content-Length` (chunked) is read into a buffer of at most `max_bytes` and refused the same way
as soon as it passes the limit, else replayed to the app as one `http.request` message (a request
with both a Transfer-Encoding and a Content-Length is counted too: h11 then reads chunks, so a
small Content-Length must not be trusted). The 413
is in the OpenAI error shape and carries `Connection: close`: uvicorn then ends the connection
instead of feeding the rest of the upload through h11 to discard it, as it does after a keep-alive
response (without the header, a 50 MB upload would be read to its end before the connection can
serve anything else).

Ending the connection at once is not enough for a client that is still uploading: closing a
socket with unread bytes makes the server's kernel send a TCP reset (and drop what it had not sent
yet). Measured on loopback with a 1 MiB limit, closing at once (uvicorn's plain behaviour): a
blocking client (httpx.Client, raw `socket.sendall`) gets ECONNRESET/EPIPE on its write after
0-5 MB and then usually still reads the 413 (Linux keeps what was received in the socket, and
httpcore reads the response after a failed write: 60/60 tries of 1 MiB + 1 byte, 4 MiB and 50 MB),
but not always (one `httpx.ReadError` in a run of this module's tests); httpx.AsyncClient (what
AsyncOpenAI uses) gets `httpx.ReadError` every time (30/30): asyncio drops the transport on the
failed write and the 413 is never read, and the openai client would retry the upload as a
connection error. So `TimeoutH11Protocol` closes such a connection in stages (a lingering close,
RFC 9112 section 9.6, as nginx's `lingering_close`): FIN after the response, then what the client
still sends is read and dropped unparsed (not through h11 nor the app) for at most `LINGER_TIME`
= 10 s (`LINGER_TIMEOUT` = 2 s without a byte ends it sooner), then the socket is closed. Measured
so, for a 50 MB body: both clients get the 413 every time, the blocking one in 0.13 s (median of
20; 0.24 s max), the asyncio one in 0.09 s; 1 MiB + 1 byte in under 0.03 s. An upload that would
need more than 10 s gets the reset then. No lingering once the server is shutting down.

`TimeoutH11Protocol` (and `h11_protocol_with_timeouts(header_timeout, body_timeout)` for other
values), passed as `uvicorn.Config(http=...)`, is uvicorn's h11 protocol plus two timers that
concern reading the request only, never the response (an SSE stream of an hour is unaffected):

- header timeout: the request line and headers must be complete within `header_timeout` seconds
  of the connection being made, or of the previous response completing on a keep-alive
  connection, however slowly the bytes trickle in. Otherwise the connection is closed (after a
  408 if part of a request had arrived; an idle keep-alive connection is closed silently, as
  uvicorn's keep-alive timer does). uvicorn itself has no timer from the connection's start to
  complete headers, and its keep-alive timer is cancelled by the first byte of the next request,
  so a client that sends one byte a second holds a connection (and its memory) forever. As the
  timer starts with the connection, a connection a client opens ahead of use and leaves idle is
  closed after `header_timeout` too (as nginx's `client_header_timeout` does); pooled clients
  (httpx, the openai client) notice the close and connect again.
- body timeout: while a request body is being received, a gap of `body_timeout` seconds with no
  byte from the client ends the request: a 408 in the OpenAI shape with `Connection: close` if no
  response has started (the app then sees `http.disconnect`, as for a client that went away),
  else the connection is closed. It is inactivity, not a total: a large upload at any steady
  rate is fine. The clock stops while the server itself is not reading (uvicorn's flow control
  paused reading because the app has not consumed the body yet, or the client waits for a
  `100 Continue` the app has not asked for yet).

Defaults and why:

- `DEFAULT_MAX_REQUEST_BODY_BYTES` = 16 MiB. The largest legitimate body is one prompt that fills
  the context: the presets allow 1M tokens (`max_position_embeddings` 1048576). As English text
  that is ~4 MB of JSON (~4 bytes a token); as token ids for /v1/completions ~7 MB (ids up to 6
  digits plus a comma); CJK text escaped as `\\uXXXX` ~9-12 MB. 16 MiB admits all of these with
  room for the messages' structure and tool schemas, and still refuses at once the 50 MB bodies
  that made the server spend 30+ s before a 400. nginx's `client_max_body_size` default is 1 MB
  (far too small for long-context prompts); uvicorn, gunicorn and vLLM have no body limit.
- `DEFAULT_HEADER_READ_TIMEOUT` = 30 s. nginx's `client_header_timeout` is 60 s, Apache's
  mod_reqtimeout 20-40 s, Go servers commonly set `ReadHeaderTimeout` of a few seconds, uvicorn
  and vLLM have none (uvicorn issue #157 proposed ~10 s). Headers are a few hundred bytes, so
  any real client sends them in milliseconds; 30 s is generous for a slow network yet bounds
  what a slowloris connection costs. Note that with uvicorn's `timeout_keep_alive` (5 s) shorter,
  an idle keep-alive connection is still closed after 5 s as before.
- `DEFAULT_BODY_READ_TIMEOUT` = 30 s. nginx's `client_body_timeout` (between two reads) is 60 s;
  gunicorn's worker `--timeout` is 30 s. A client that sends nothing for 30 s in the middle of a
  body is stalled or hostile; a slow but steady upload is never cut.

Suggested flags (none exist in vLLM): `--max-request-body-bytes`, `--header-read-timeout`,
`--body-read-timeout` (0 or None turns a limit off).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from kimiserve.entrypoints.openai.errors import OpenAIError, is_anthropic_path, to_json

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_HEADER_READ_TIMEOUT = 30.0
DEFAULT_BODY_READ_TIMEOUT = 30.0
LINGER_TIME = 10.0
LINGER_TIMEOUT = 2.0

logger = logging.getLogger("kimiserve.server")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.4g} {unit})"
    return f"{n} bytes"


def error_body(message: str, status: int, path: str = "") -> bytes:
    """The JSON body of an error response, as UTF-8: OpenAI-shaped (Anthropic-shaped on its routes)."""
    error = OpenAIError(message, status)
    return to_json(error.anthropic_body() if is_anthropic_path(path) else error.body()).encode("utf-8")


def error_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close")]


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body length the request's framing promises, or None when it is not given by a valid
    Content-Length alone (a Transfer-Encoding beats a Content-Length: h11 then reads chunks)."""
    lengths: list[bytes] = []
    for name, value in headers:
        if name.lower() == b"transfer-encoding":
            return None
        if name.lower() == b"content-length":
            lengths += value.split(b",")
    if not lengths:
        return None
    try:
        values = [int(v.strip()) for v in lengths]
    except ValueError:
        return None
    return max(values) if min(values) >= 0 else None


class BodyLimitMiddleware:
    """413 (OpenAI shape, `Connection: close`) for an HTTP request body over `max_bytes`: at once
    from its Content-Length, else (chunked) as soon as what arrived passes the limit. A body
    within the limit reaches the app unchanged. `max_bytes` None or 0: no limit."""

    def __init__(self, app, max_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no limit), got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes or None

    def message(self, sent: int | None) -> str:
        what = f"{sent} bytes" if sent is not None else "more than that"
        return (f"the request body is too large: the limit is {_size(self.max_bytes)} and this request sent "
                f"{what}; start the server with a larger --max-request-body-bytes to allow it")

    async def refuse(self, scope, send, sent: int | None) -> None:
        body = error_body(self.message(sent), 413, scope.get("path", ""))
        await send({"type": "http.response.start", "status": 413, "headers": error_headers(body)})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.max_bytes is None:
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope["headers"])
        if declared is not None:
            # the server reads exactly `declared` bytes as this request's body (h11 enforces the framing)
            if declared > self.max_bytes:
                await self.refuse(scope, send, declared)
                return
            await self.app(scope, receive, send)
            return
        # no Content-Length: count the body as it arrives, keeping at most max_bytes of it
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self.refuse(scope, send, None)
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: http.disconnect when the client goes

        await self.app(scope, replay, send)


class _FlowControl(FlowControl):
    """uvicorn's flow control, telling the protocol when reading resumes (the body clock restarts)."""

    def __init__(self, transport: asyncio.Transport, on_resume) -> None:
        super().__init__(transport)
        self._on_resume = on_resume

    def resume_reading(self) -> None:
        was_paused = self.read_paused
        super().resume_reading()
        self._on_resume(was_paused)


class _CycleTransport:
    """The transport as a request's RequestResponseCycle sees it: its close() goes to the protocol,
    which may close in stages (lingering close) when the client is still sending the body."""

    def __init__(self, transport: asyncio.Transport, protocol: TimeoutH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closed = False
        self.write = transport.write

    def is_closing(self) -> bool:
        return self._closed or self._transport.is_closing()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._protocol._close_after_response()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class TimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a body inactivity timeout (see the module
    docstring), and a lingering close after a response that ends the connection while the client
    is still sending its body. Class attributes; `h11_protocol_with_timeouts` makes a subclass with
    other timeouts. None turns a timeout off."""

    header_timeout: float | None = DEFAULT_HEADER_READ_TIMEOUT
    body_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT
    linger_time: float = LINGER_TIME
    linger_timeout: float = LINGER_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_cycle: Any = None  # the cycle whose body the body clock is timing
        self._body_activity = 0.0  # loop time of the last byte received (or of reading resuming)
        self._awaiting_100 = False  # the client waits for a 100 Continue the app has not asked for yet
        self._upgraded = False
        self._wrapped_cycle: Any = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_end = 0.0
        self.lingering = False
        self._shutting_down = False

    # uvicorn's protocol interface, with the timers kept in step

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _FlowControl(transport, self._reading_resumed)
        self._sync_timers()

    def data_received(self, data: bytes) -> None:
        self._body_activity = self.loop.time()
        if self.lingering:
            return  # the rest of a body whose response has been sent: dropped unparsed
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()  # called by data_received and on_response_complete (keep-alive)
        cycle = self.cycle
        if cycle is not None and cycle is not self._wrapped_cycle:
            # a new cycle (its task has not run yet): its close() may linger
            self._wrapped_cycle = cycle
            cycle.transport = _CycleTransport(self.transport, self)  # type: ignore[assignment]
        self._sync_timers()

    def on_response_complete(self) -> None:
        if self.lingering:
            self.server_state.total_requests += 1
            return
        super().on_response_complete()

    def shutdown(self) -> None:
        self._shutting_down = True  # no lingering from now on: uvicorn waits for every connection to close
        if self.lingering:
            self.transport.close()
            return
        super().shutdown()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the transport goes to another protocol: these timers must not touch it
        self._cancel_timers()
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse as a request (a bad Content-Length, no Host, a
        space in the target, a bad chunk, a TLS hello), in the OpenAI shape: uvicorn's own is text/plain."""
        body = error_body("invalid HTTP request: it could not be parsed as HTTP/1.1 (request line, headers "
                          "or body framing)", 400)
        try:
            head = self.conn.send(h11.Response(status_code=400, reason=b"Bad Request", headers=error_headers(body)))
        except h11.LocalProtocolError:  # a response had already started: nothing more can be said
            self.transport.close()
            return
        try:
            tail = self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # the answer to a HEAD request has no body: the head is all of it
            tail = b""
        self.transport.write(head + tail)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    # lingering close

    def _close_after_response(self) -> None:
        """A cycle closes the connection (a `Connection: close` response, e.g. the 413 of
        BodyLimitMiddleware, or an error). If its response is complete and the client is still
        sending the body, closing now would answer its next bytes with a TCP reset, and a client
        still uploading may then never read the response (asyncio clients such as httpx's
        AsyncClient lose it: their write fails and the transport is dropped unread). So close in
        stages, as RFC 9112 section 9.6 describes: send FIN after the response, read and drop what
        the client still sends for up to `linger_time` seconds (`linger_timeout` without a byte
        ends it sooner), then close."""
        transport = self.transport
        if (transport.is_closing() or self._upgraded or self._shutting_down or not self.linger_time
                or self.conn.their_state is not h11.SEND_BODY
                or self.conn.our_state not in (h11.MUST_CLOSE, h11.CLOSED)):
            transport.close()
            return
        self.lingering = True
        self._cancel_timers()
        self._unset_keepalive_if_required()
        if transport.can_write_eof():
            transport.write_eof()  # after the buffered response is written
        transport.resume_reading()  # uvicorn's flow control may have paused it
        now = self.loop.time()
        self._body_activity = now
        self._linger_end = now + self.linger_time
        self._linger_timer = self.loop.call_later(min(self.linger_timeout, self.linger_time), self._check_linger)

    def _check_linger(self) -> None:
        self._linger_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        left = min(self._linger_end - now, self._body_activity + self.linger_timeout - now)
        if left > 0:
            self._linger_timer = self.loop.call_later(left, self._check_linger)
        else:
            self.transport.close()

    # the timers

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _gone(self) -> bool:
        return self._upgraded or self.transport is None or self.transport.is_closing()

    def _sync_timers(self) -> None:
        """Arm the timer of the phase h11 is in: IDLE = waiting for (the rest of) a request's
        headers, SEND_BODY = receiving its body; no timer in any other state (the request is
        complete: the app runs and responds for as long as it takes)."""
        if self._gone():
            self._cancel_timers()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            self._cancel_body_timer()
            if self._header_timer is None and self.header_timeout:
                # entering IDLE: at connection_made, or when the previous cycle ended; the deadline
                # does not move while bytes trickle in
                self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)
        elif state is h11.SEND_BODY:
            self._cancel_header_timer()
            if self._body_cycle is not self.cycle:  # a new request: its body clock starts now
                self._body_cycle = self.cycle
                self._body_activity = self.loop.time()
                self._awaiting_100 = bool(self.cycle is not None and self.cycle.waiting_for_100_continue)
            if self._body_timer is None and self.body_timeout:
                self._body_timer = self.loop.call_later(self.body_timeout, self._check_body)
        else:
            self._cancel_timers()

    def _reading_resumed(self, was_paused: bool) -> None:
        """From the flow control: reading resumes. If the server had stopped reading (paused, or the
        client was waiting for its 100 Continue, which uvicorn sends just before resuming), the
        client could not send meanwhile: its body clock restarts."""
        waited_100 = self._awaiting_100 and not (self.cycle is not None and self.cycle.waiting_for_100_continue)
        if was_paused or waited_100:
            self._awaiting_100 = self._awaiting_100 and not waited_100
            self._body_activity = self.loop.time()

    def _reading_held(self) -> bool:
        """The server is not reading the body: not the client's stall."""
        cycle = self.cycle
        return self.flow.read_paused or bool(cycle is not None and not cycle.response_started
                                             and cycle.waiting_for_100_continue)

    def _check_body(self) -> None:
        self._body_timer = None
        if self._gone() or self.conn.their_state is not h11.SEND_BODY or not self.body_timeout:
            return
        now = self.loop.time()
        if self._reading_held():
            self._body_activity = now
            self._body_timer = self.loop.call_later(self.body_timeout, self._check_body)
            return
        idle = now - self._body_activity
        if idle < self.body_timeout:
            self._body_timer = self.loop.call_later(self.body_timeout - idle, self._check_body)
            return
        self._body_timed_out()

    def _prefix(self) -> str:
        return "%s:%d - " % self.client if self.client else ""

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._gone() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:
            logger.warning("%sclosing the connection: the request headers were not complete within %g s "
                           "(--header-read-timeout)", self._prefix(), self.header_timeout)
            body = error_body(f"the request headers were not complete within {self.header_timeout:g} s "
                              f"(--header-read-timeout)", 408)
            head = [b"HTTP/1.1 408 Request Timeout\r\n"]
            for name, value in self.server_state.default_headers + error_headers(body):
                head += [name, b": ", value, b"\r\n"]
            self.transport.write(b"".join(head) + b"\r\n" + body)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def _body_timed_out(self) -> None:
        cycle = self.cycle
        logger.warning("%sending the request: no byte of its body arrived for %g s (--body-read-timeout)",
                       self._prefix(), self.body_timeout)
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            body = error_body(f"the request body stopped arriving: nothing received for {self.body_timeout:g} s "
                              f"(--body-read-timeout)", 408)
            try:
                out = self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout",
                                                  headers=self.server_state.default_headers + error_headers(body)))
                if cycle.scope.get("method") != "HEAD":  # the answer to a HEAD has no body: the head is all of it
                    out += self.conn.send(h11.Data(data=body))
                out += self.conn.send(h11.EndOfMessage())
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                self.transport.abort()
                return
            # the app sees the client as gone: receive() gives http.disconnect, send() is a no-op
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.write(out)
            self.transport.close()
        elif cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.abort()  # a response is half sent; the client may not be reading it either
        else:
            self.transport.close()  # the response is complete; the rest of the body is not worth waiting for


def h11_protocol_with_timeouts(header_timeout: float | None = DEFAULT_HEADER_READ_TIMEOUT,
                               body_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT) -> type[TimeoutH11Protocol]:
    """A `TimeoutH11Protocol` subclass with these timeouts (seconds; None or 0: off), for
    `uvicorn.Config(http=...)`."""
    for name, value in (("header_timeout", header_timeout), ("body_timeout", body_timeout)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0 (0: off), got {value}")
    return type("TimeoutH11Protocol", (TimeoutH11Protocol,),
                {"header_timeout": header_timeout or None, "body_timeout": body_timeout or None,
                 "__module__": __name__})
