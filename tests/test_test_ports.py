"""The test helpers' loopback ports: drawn outside the kernel's ephemeral range, and a server whose drawn
port another process took first is started again on another."""

import socket

import httpx
import pytest

import dist_utils
import server_utils

pytestmark = pytest.mark.fixed_threads  # the server runs with one torch thread; the rest uses no torch


def test_free_port_is_free_and_outside_the_ephemeral_range():
    ephemeral = dist_utils._ephemeral_ports()
    for _ in range(20):
        port = dist_utils.free_port()
        assert port not in ephemeral and 1024 <= port < 65536
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_server_starts_again_when_its_port_was_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(server_utils, "free_port", lambda: next(ports, None) or dist_utils.free_port())
        with server_utils.running_server("--max-model-len", "64", "--num-pages", "40") as server:
            assert server.port != taken.getsockname()[1]
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
