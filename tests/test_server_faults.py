"""Faults at the server: a request that fails inside the engine fails alone; a fatal engine error
closes the streams and exits the process non-zero; a huge body is refused at once without
stalling other streams; a client that stops reading costs bounded memory and is cut off."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_utils import metrics, running_server, wait_until

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

ROOT = Path(__file__).resolve().parent
LAUNCHER = (str(ROOT / "fault_injection.py"),)
POISON, FATAL = 1000, 1001
SERVER = ("--max-model-len", "512", "--num-pages", "600", "--max-num-seqs", "16")


def stream_events(url: str, body: dict, out: dict) -> None:
    """POST a streaming completion; out gets "events" (decoded data payloads) and "times" (arrival times)."""
    out["events"], out["times"] = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["times"].append(time.monotonic())
                out["events"].append(line[6:])


def text_of(events: list[str]) -> tuple[list[str], list[dict]]:
    """(text pieces, error bodies) of a completion stream's events."""
    texts, errors = [], []
    for e in events:
        if e == "[DONE]":
            continue
        d = json.loads(e)
        if "error" in d:
            errors.append(d["error"])
        else:
            texts += [c["text"] for c in d["choices"]]
    return texts, errors


def background(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def test_a_request_failing_in_the_engine_fails_alone():
    env = {"KIMISERVE_TEST_POISON": str(POISON)}
    with running_server(*SERVER, launcher=LAUNCHER, env=env, check_exit=False) as s:
        normal = {"prompt": list(range(1, 40)), "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        alone = httpx.post(f"{s.base_url}/completions", json=normal, timeout=120).json()["choices"][0]["text"]
        seen: dict = {}
        t = background(stream_events, s.url, normal, seen)
        wait_until(lambda: len(seen.get("events", [])) > 3, timeout=60)
        r = httpx.post(f"{s.base_url}/completions", json={"prompt": [5, POISON, 6], "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
        assert "secret" not in r.text and "injected" not in r.text
        poisoned: dict = {}
        stream_events(s.url, {"prompt": [7, POISON], "max_tokens": 4}, poisoned)
        assert poisoned["status"] == 200 and poisoned["events"][-1] == "[DONE]"
        _, errors = text_of(poisoned["events"])
        assert [e["code"] for e in errors] == ["request_failed"] and "secret" not in json.dumps(errors)
        t.join(120)
        texts, errors = text_of(seen["events"])
        assert not errors and "".join(texts) == alone  # the other stream: every token, the same tokens
        assert httpx.get(f"{s.url}/health").status_code == 200
        after = httpx.post(f"{s.base_url}/completions", json=normal, timeout=120)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == alone
        m = wait_until(lambda: (lambda m: m if m["kimiserve:num_requests_running"] == 0 else None)(metrics(s.url)))
        assert m["kimiserve:request_success_total{finished_reason=\"error\"}"] == 2
        assert m["kimiserve:cache_pages_used_by_requests"] == 0
    assert s.proc.returncode == 0


def test_a_fatal_engine_error_closes_the_streams_and_exits_non_zero():
    env = {"KIMISERVE_TEST_FATAL": str(FATAL)}
    with running_server(*SERVER, launcher=LAUNCHER, env=env, check_exit=False) as s:
        seen: dict = {}
        t = background(stream_events, s.url, {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}, seen)
        wait_until(lambda: len(seen.get("events", [])) > 3, timeout=60)
        r = httpx.post(f"{s.base_url}/completions", json={"prompt": [FATAL], "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "illegal" not in r.text and "injected" not in r.text
        t.join(60)
        assert seen["events"][-1] == "[DONE]"
        _, errors = text_of(seen["events"])
        assert [e["code"] for e in errors] == ["engine_dead"] and "illegal" not in json.dumps(errors)
        code = s.proc.wait(60)
        stderr = s.stderr()
    assert code == 1 and "the engine is dead" in stderr


def answer_without_the_body(port: int, path: str, length: int) -> tuple[int, dict]:
    """POST only the headers of a `length`-byte JSON body: the server's (status, JSON body), read until it
    closes. A server that reads the body before refusing waits for bytes that never come: its answer, if
    any, is the body timeout's 408 (or none: socket.timeout after 60 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_huge_body_is_refused_at_once_and_other_streams_keep_flowing():
    with running_server(*SERVER) as s:
        seen: dict = {}
        t = background(stream_events, s.url, {"prompt": [1, 2, 3], "max_tokens": 150, "ignore_eos": True}, seen)
        wait_until(lambda: len(seen.get("events", [])) > 3, timeout=60)
        huge = b'{"messages": [{"role": "user", "content": "' + b"x" * 50_000_000 + b'"}]}'
        for path in ("/v1/chat/completions", "/tokenize"):
            # at once: answered before any of the body is sent, so never read nor parsed
            status, body = answer_without_the_body(s.port, path, len(huge))
            assert status == 413 and body["error"]["code"] == 413, (path, status, body)
            # and a client that uploads it all still gets the 413
            r = httpx.post(f"{s.url}{path}", content=huge, headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 413 and r.json()["error"]["code"] == 413, (path, r.text[:300])
        # under the body limit but far over the context: refused by the byte bound ("at least N input
        # tokens"), not after tokenising 8 MB (that message gives the exact count)
        r = httpx.post(f"{s.base_url}/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "word " * 1_600_000}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "has at least" in r.json()["error"]["message"], r.json()
        t.join(120)
        # the stream went on through the refusals to its end, without an error
        _, errors = text_of(seen["events"])
        assert seen["events"][-1] == "[DONE]" and not errors and len(seen["events"]) > 100
        idle = wait_until(lambda: metrics(s.url)["kimiserve:num_requests_running"] == 0, timeout=60)
        assert idle and metrics(s.url)["kimiserve:cache_pages_used_by_requests"] == 0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


UNREAD_BOUND_MB = 200
"""What an unread n=64 x 1200-token stream with 20 logprobs may add to the server's memory (without
the bound it grew by 1.1 GB in 71 s): 4 MiB of queued output allowed (--max-queued-output-bytes),
plus what the socket buffers, the engine's 64 sequences and Python's allocator keep."""


def start_unread_stream(port: int, n: int) -> socket.socket:
    """POST a large streamed completion (n samples x 1200 tokens with 20 logprobs each) on a raw socket
    with a small receive buffer, and read nothing: the caller decides when (if ever) to read."""
    body = json.dumps({"prompt": [1, 2, 3], "n": n, "max_tokens": 1200, "logprobs": 20, "ignore_eos": True,
                       "temperature": 1.0, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_a_stream_cut_by_the_send_timeout_closes_its_connection_without_a_server_error():
    """The send-timeout path on its own: the queue bound is far away, so the only thing that ends the
    unread stream is --stream-send-timeout. The server closes the connection (the client reaches EOF),
    aborts the request and logs its warning, and exits with a clean stderr (uvicorn's "ASGI callable
    returned without completing response" for the cut response is not an error: it used to be one)."""
    args = ("--max-model-len", "1300", "--num-pages", "3000", "--max-num-seqs", "64",
            "--max-queued-output-bytes", str(512 * 2**20), "--stream-send-timeout", "1")
    with running_server(*args) as s:
        sock = start_unread_stream(s.port, n=16)
        assert wait_until(lambda: "closed a stream whose client read nothing" in s.stderr(), timeout=600), s.stderr()
        sock.settimeout(120)
        while sock.recv(1 << 20):  # the server closed the connection
            pass
        sock.close()
        assert wait_until(lambda: metrics(s.url)["kimiserve:cache_pages_used_by_requests"] == 0, timeout=120)
        r = httpx.post(f"{s.base_url}/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
        assert r.status_code == 200
    # running_server's exit check: no ERROR line in the server's stderr


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc for the server's memory")
def test_an_unread_stream_is_held_to_a_bound_then_aborted_and_cut_off():
    args = ("--max-model-len", "1300", "--num-pages", "3000", "--max-num-seqs", "64",
            "--max-queued-output-bytes", str(4 * 2**20), "--stream-send-timeout", "3")
    with running_server(*args) as s:
        base = rss_mb(s.proc.pid)
        sock = start_unread_stream(s.port, n=64)
        peak, started = base, time.monotonic()
        aborted = False
        while time.monotonic() - started < 600:  # the request is aborted while nobody reads the socket
            peak = max(peak, rss_mb(s.proc.pid))
            m = metrics(s.url)
            if m["kimiserve:request_success_total{finished_reason=\"abort\"}"] >= 1:
                aborted = m["kimiserve:cache_pages_used_by_requests"] == 0
                break
            time.sleep(0.2)
        assert aborted, "the unread stream was not aborted"
        # the others are served meanwhile (the unread connection still open)
        r = httpx.post(f"{s.base_url}/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
        assert r.status_code == 200
        # and after --stream-send-timeout the server closes the connection: reading reaches EOF
        sock.settimeout(120)
        while sock.recv(1 << 20):
            pass
        sock.close()
        peak = max(peak, rss_mb(s.proc.pid))
    print(f"server RSS {base:.0f} MB -> peak {peak:.0f} MB with an unread stream")
    assert peak - base < UNREAD_BOUND_MB, (base, peak)
