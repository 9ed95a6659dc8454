"""kimiserve/entrypoints/openai/http_limits.py on loopback: a real uvicorn server (in a thread) with
TimeoutH11Protocol and BodyLimitMiddleware in front of a minimal ASGI app of this file (not the
model server). Small limits and timeouts keep it fast; every socket and client has a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import threading
import time
from urllib.parse import parse_qs

import httpx
import pytest
import uvicorn

from kimiserve.entrypoints.openai.http_limits import (
    BodyLimitMiddleware, TimeoutH11Protocol, h11_protocol_with_timeouts)

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

LIMIT = 1 << 20
HEADER_TIMEOUT = 0.8
BODY_TIMEOUT = 0.8
BIG = 50 * 1000 * 1000  # the attacker's 50 MB
SLACK = 0.6  # how late a timeout may fire on a loaded 2-core machine


class App:
    """/ping; /echo (reads the body, returns its length and sha256); /slowread?delay=S (waits S
    seconds before reading the body); /stream?n=N&gap=S (N chunks, S seconds apart). Every JSON
    reply carries the client's port (one port = one connection). A request whose client went away
    is recorded in `disconnects` under its x-test-id header."""

    def __init__(self):
        self.disconnects: list[str] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        test_id = dict(scope["headers"]).get(b"x-test-id", b"").decode()
        path = scope["path"]
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            n, gap = int(query.get("n", 3)), float(query.get("gap", 1.0))
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                await send({"type": "http.response.body", "body": f"chunk {i}\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        reply = {"client_port": scope["client"][1]}
        if path in ("/echo", "/slowread"):
            if path == "/slowread":
                await asyncio.sleep(float(query.get("delay", 1.0)))
            digest, size = hashlib.sha256(), 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnects.append(test_id)
                    return
                digest.update(message.get("body", b""))
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            reply.update(len=size, sha256=digest.hexdigest())
        body = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def running_server(app, protocol: type):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_config=None, access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "the server did not shut down"
        sock.close()


@pytest.fixture(scope="module")
def server():
    app = App()
    protocol = h11_protocol_with_timeouts(HEADER_TIMEOUT, BODY_TIMEOUT)
    with running_server(BodyLimitMiddleware(app, LIMIT), protocol) as port:
        yield app, port


class Raw:
    """A raw HTTP/1.1 connection: send bytes, read responses (kept in order for pipelining)."""

    def __init__(self, port: int, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def _more(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError(self.buf)
        self.buf += chunk
        return chunk

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        n = int(headers.get("content-length", 0))
        while len(self.buf) < n:
            self._more()
        body, self.buf = self.buf[:n], self.buf[n:]
        return int(lines[0].split()[1]), headers, body

    def wait_closed(self, limit: float) -> float:
        """Seconds until the server ends the connection (EOF or reset), reading whatever comes."""
        t0 = time.monotonic()
        self.sock.settimeout(limit)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except socket.timeout:
            pytest.fail(f"the connection was still open after {limit} s")
        return time.monotonic() - t0

    def trickle(self, data: bytes, every: float, limit: float) -> tuple[float, bytes]:
        """Send `data` one byte every `every` seconds; returns (seconds until the server ended the
        connection, what it sent before)."""
        t0, got, i = time.monotonic(), b"", 0
        self.sock.settimeout(every)
        while time.monotonic() - t0 < limit:
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                try:
                    self.sock.send(data[i % len(data):][:1])
                    i += 1
                except OSError:
                    return time.monotonic() - t0, got
                continue
            except ConnectionResetError:
                return time.monotonic() - t0, got
            if not chunk:
                return time.monotonic() - t0, got
            got += chunk
        pytest.fail(f"the connection was still open after {limit} s of trickling")

    def close(self):
        self.sock.close()


def check_error(status: int, headers: dict, body: bytes, expected_status: int) -> str:
    """The response is an OpenAI-shaped error that ends the connection; returns its message."""
    assert status == expected_status
    assert headers["connection"].lower() == "close"
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] == expected_status
    return error["message"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- body limit


def test_huge_content_length_refused_at_once_and_server_stays_responsive(server):
    _, port = server
    url = f"http://127.0.0.1:{port}"
    body = b"x" * BIG
    results: list = []

    def upload():
        with httpx.Client(base_url=url, timeout=10) as uploader:
            for _ in range(3):
                t0 = time.monotonic()
                try:
                    r = uploader.post("/echo", content=body)
                    results.append((r, time.monotonic() - t0))
                except Exception as exc:  # noqa: BLE001 - reported below
                    results.append((exc, time.monotonic() - t0))

    pings = []
    with httpx.Client(base_url=url, timeout=5) as client:
        assert client.get("/ping").status_code == 200  # connected before the uploads start
        uploads = threading.Thread(target=upload)
        uploads.start()
        while uploads.is_alive() or not pings:  # /health-like requests on another connection meanwhile
            t0 = time.monotonic()
            assert client.get("/ping").status_code == 200
            pings.append(time.monotonic() - t0)
            time.sleep(0.02)
        uploads.join(10)
    assert max(pings) < 1.0, pings
    assert len(results) == 3
    for response, seconds in results:
        assert isinstance(response, httpx.Response), f"the uploading client got {response!r}, not the 413"
        message = check_error(response.status_code, response.headers, response.content, 413)
        assert str(LIMIT) in message and "--max-request-body-bytes" in message and str(BIG) in message
        assert seconds < 1.0, f"the 50 MB body took {seconds:.2f} s to be refused"


def test_async_client_still_uploading_sees_the_413(server):
    # httpx.AsyncClient (AsyncOpenAI's transport) only reads the response once its upload is
    # written; a server that resets the connection mid-upload costs it the 413 (httpx.ReadError)
    _, port = server

    async def main():
        async with httpx.AsyncClient(timeout=10) as client:
            t0 = time.monotonic()
            r = await client.post(f"http://127.0.0.1:{port}/echo", content=b"x" * BIG)
            return r, time.monotonic() - t0

    r, seconds = asyncio.run(main())
    check_error(r.status_code, r.headers, r.content, 413)
    assert seconds < 2.0  # ~0.1 s: the server reads and drops the rest of the upload (lingering close)


def test_body_of_exactly_the_limit_passes_one_byte_more_is_refused(server):
    _, port = server
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        exact = bytes(range(256)) * (LIMIT // 256)
        assert len(exact) == LIMIT
        r = client.post("/echo", content=exact)
        assert r.status_code == 200 and r.json()["len"] == LIMIT and r.json()["sha256"] == sha(exact)
        r = client.post("/echo", content=exact + b"!")
        message = check_error(r.status_code, r.headers, r.content, 413)
        assert f"sent {LIMIT + 1} bytes" in message


def test_chunked_body_counted_as_it_arrives(server):
    _, port = server
    pieces = [bytes([i]) * n for i, n in enumerate([1, 1000, 65536, 300_000, LIMIT - 366_537])]
    assert sum(map(len, pieces)) == LIMIT
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        r = client.post("/echo", content=iter(pieces))  # an iterator: Transfer-Encoding: chunked
        assert r.request.headers.get("transfer-encoding") == "chunked"
        assert r.status_code == 200
        assert (r.json()["len"], r.json()["sha256"]) == (LIMIT, sha(b"".join(pieces)))
        r = client.post("/echo", content=iter(pieces + [b"!"]))
        message = check_error(r.status_code, r.headers, r.content, 413)
        assert str(LIMIT) in message and "--max-request-body-bytes" in message
    chunk = b"y" * (1 << 20)
    t0 = time.monotonic()
    r = httpx.post(f"http://127.0.0.1:{port}/echo", content=(chunk for _ in range(50)), timeout=10)
    assert r.status_code == 413 and time.monotonic() - t0 < 1.0


def test_transfer_encoding_beats_a_small_content_length(server):
    # h11 reads a chunked body when both headers are sent; the declared 10 bytes must not be trusted
    _, port = server
    conn = Raw(port)
    try:
        conn.sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"z" * 65536
        with contextlib.suppress(OSError):
            for _ in range(2 * LIMIT // len(piece)):
                conn.sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        check_error(*conn.response(), 413)
    finally:
        conn.close()


def test_lingering_after_the_413_is_bounded():
    # the rest of the upload is read and dropped, but not for ever: linger_timeout without a byte,
    # linger_time in all
    protocol = type("P", (h11_protocol_with_timeouts(HEADER_TIMEOUT, BODY_TIMEOUT),),
                    {"linger_time": 1.0, "linger_timeout": 0.3})
    with running_server(BodyLimitMiddleware(App(), LIMIT), protocol) as port:
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"

        def peer_reads(conn: Raw) -> bool:
            """Whether the server still takes bytes: once its socket is closed, a send draws a reset
            and the next one fails."""
            try:
                for _ in range(2):
                    conn.sock.sendall(b"x" * 1000)
                    time.sleep(0.05)
                return True
            except OSError:
                return False

        quiet = Raw(port)  # sends a little of its body, reads the 413, then neither sends nor closes
        try:
            quiet.sock.sendall(head + b"x" * 200_000)
            check_error(*quiet.response(), 413)
            assert quiet.sock.recv(100) == b""  # FIN after the response: the server's half-close
            assert peer_reads(quiet)  # ... while it still reads and drops the body
            time.sleep(0.3 + SLACK)
            assert not peer_reads(quiet)  # then closed, 0.3 s (linger_timeout) after the last byte
        finally:
            quiet.close()
        flood = Raw(port)  # keeps sending as fast as it can
        try:
            flood.sock.sendall(head)
            t0, piece = time.monotonic(), b"x" * 65536
            with pytest.raises(OSError):
                while time.monotonic() - t0 < 10:
                    flood.sock.sendall(piece)
            assert 1.0 - 0.05 <= time.monotonic() - t0 <= 1.0 + SLACK
        finally:
            flood.close()


# -- header timeout


def test_headers_trickling_in_are_cut_at_the_header_timeout(server):
    _, port = server
    conn = Raw(port)
    try:
        conn.sock.sendall(b"GET /ping HTTP/1.1\r\nHos")  # half a header line, then a byte every 0.2 s
        seconds, got = conn.trickle(b"t: example\r\nX-Padding: ", every=0.2, limit=HEADER_TIMEOUT + 5)
    finally:
        conn.close()
    assert HEADER_TIMEOUT - 0.05 <= seconds <= HEADER_TIMEOUT + SLACK
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert "--header-read-timeout" in json.loads(body)["error"]["message"]


def test_connection_that_sends_nothing_is_closed_silently(server):
    _, port = server
    conn = Raw(port)
    try:
        t0 = time.monotonic()
        conn.sock.settimeout(HEADER_TIMEOUT + 5)
        assert conn.sock.recv(100) == b""  # EOF, no 408 for a request that never started
        assert HEADER_TIMEOUT - 0.05 <= time.monotonic() - t0 <= HEADER_TIMEOUT + SLACK
    finally:
        conn.close()


def test_keep_alive_connection_whose_next_request_trickles_is_closed(server):
    _, port = server
    conn = Raw(port)
    try:
        conn.sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.response()[0] == 200
        # uvicorn's own keep-alive timer (5 s) stops at the first byte of the next request
        seconds, got = conn.trickle(b"GET /ping HTTP/1.1\r\nHost: x\r\n", every=0.2, limit=HEADER_TIMEOUT + 5)
    finally:
        conn.close()
    assert seconds <= HEADER_TIMEOUT + SLACK
    assert got.startswith(b"HTTP/1.1 408 ")


# -- body timeout


def test_body_that_stalls_gets_408_and_the_connection_is_closed(server, caplog):
    app, port = server
    conn = Raw(port)
    caplog.set_level(logging.WARNING)
    try:
        conn.sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Test-Id: stall\r\nContent-Length: 100\r\n\r\n"
                          + b"a" * 10)
        t0 = time.monotonic()
        message = check_error(*conn.response(), 408)
        seconds = time.monotonic() - t0
        assert conn.wait_closed(5) < 1.0
    finally:
        conn.close()
    assert BODY_TIMEOUT - 0.05 <= seconds <= BODY_TIMEOUT + SLACK
    assert "--body-read-timeout" in message
    deadline = time.monotonic() + 2
    while "stall" not in app.disconnects and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "stall" in app.disconnects  # the app saw the client as gone, as for a disconnect
    assert not [r for r in caplog.records if "ASGI" in r.getMessage()]  # no 500, no "exception in ASGI app"


def test_head_request_whose_body_stalls_gets_the_408_head(server):
    """The answer to a HEAD has no body, so the 408 is its head alone; h11 refused the 408's body
    and the connection was reset with no answer at all (found by test_server_hostile.py)."""
    _, port = server
    conn = Raw(port)
    try:
        conn.sock.sendall(b"HEAD /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"a" * 10)
        conn.sock.settimeout(BODY_TIMEOUT + 5)
        got = b""
        while chunk := conn.sock.recv(65536):
            got += chunk
    finally:
        conn.close()
    assert got.startswith(b"HTTP/1.1 408 ") and got.endswith(b"\r\n\r\n"), got
    assert b"content-type: application/json" in got.lower() and b"connection: close" in got.lower()


def test_slow_but_steady_body_is_not_cut(server):
    # the body timeout is inactivity between bytes, not a total
    _, port = server
    conn = Raw(port)
    pieces = [bytes([65 + i]) * 10 for i in range(6)]
    try:
        conn.sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 60\r\n\r\n")
        t0 = time.monotonic()
        for piece in pieces:
            conn.sock.sendall(piece)
            time.sleep(BODY_TIMEOUT * 0.4)
        status, _, body = conn.response()
    finally:
        conn.close()
    assert time.monotonic() - t0 > 2 * BODY_TIMEOUT
    assert status == 200 and json.loads(body)["sha256"] == sha(b"".join(pieces))


def test_server_not_reading_the_body_is_not_a_client_stall(server):
    # the app waits longer than the body timeout before reading: flow control has paused reading
    # (the body is over uvicorn's 64 KiB buffer), or the client waits for its 100 Continue
    _, port = server
    delay = BODY_TIMEOUT + 0.7
    body = b"q" * 900_000
    r = httpx.post(f"http://127.0.0.1:{port}/slowread?delay={delay}", content=body, timeout=10)
    assert r.status_code == 200 and r.json()["sha256"] == sha(body)
    conn = Raw(port)
    try:
        conn.sock.sendall(f"POST /slowread?delay={delay} HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                          "Content-Length: 5\r\n\r\n".encode())
        status, _, _ = conn.response()
        assert status == 100
        conn.sock.sendall(b"hello")
        status, _, reply = conn.response()
    finally:
        conn.close()
    assert status == 200 and json.loads(reply)["sha256"] == sha(b"hello")


# -- what must not change


def test_keep_alive_client_making_several_requests_is_unaffected(server):
    _, port = server
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        t0, ports = time.monotonic(), set()
        for i in range(8):
            r = client.get("/ping") if i % 2 else client.post("/echo", content=b"p" * 5000)
            assert r.status_code == 200
            ports.add(r.json()["client_port"])
            time.sleep(0.15)
        assert len(ports) == 1, "the keep-alive connection was not reused"
        assert time.monotonic() - t0 > 1.2 * HEADER_TIMEOUT  # outlived one header timeout
        # idle past the header timeout: the server closed the connection, the client opens another
        time.sleep(HEADER_TIMEOUT + 0.4)
        r = client.get("/ping")
        assert r.status_code == 200 and r.json()["client_port"] not in ports


def test_streaming_response_outlasts_both_timeouts(server):
    _, port = server
    gap = max(HEADER_TIMEOUT, BODY_TIMEOUT) + 0.3
    t0 = time.monotonic()
    with httpx.stream("GET", f"http://127.0.0.1:{port}/stream?n=3&gap={gap}", timeout=10) as r:
        assert r.status_code == 200
        text = b"".join(r.iter_bytes()).decode()
    assert text == "chunk 0\nchunk 1\nchunk 2\n"
    assert time.monotonic() - t0 >= 2 * gap - 0.05


def test_pipelined_requests_are_answered_in_order(server):
    _, port = server
    conn = Raw(port)
    try:
        conn.sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
                          b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                          b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        replies = [conn.response() for _ in range(3)]
    finally:
        conn.close()
    assert [status for status, _, _ in replies] == [200, 200, 200]
    assert json.loads(replies[1][2])["sha256"] == sha(b"hello") and "sha256" not in json.loads(replies[2][2])


def test_configuration():
    protocol = h11_protocol_with_timeouts(2.5, 0)
    assert issubclass(protocol, TimeoutH11Protocol)
    assert (protocol.header_timeout, protocol.body_timeout) == (2.5, None)
    assert (TimeoutH11Protocol.header_timeout, TimeoutH11Protocol.body_timeout) == (30.0, 30.0)
    with pytest.raises(ValueError):
        h11_protocol_with_timeouts(-1, 1)
    with pytest.raises(ValueError):
        BodyLimitMiddleware(App(), -1)
