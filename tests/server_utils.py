"""A real `kimiserve serve` process on loopback for the server tests.

    with running_server("--max-model-len", "256") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x")
        ...
    # on exit: SIGTERM, and the process must exit with code 0 and no traceback or ERROR on stderr
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from dist_utils import free_port  # noqa: F401 - the tests import it from here too

ROOT = Path(__file__).resolve().parent.parent
LIGHT_SERVER = ("--model", "tiny", "--max-model-len", "256", "--num-pages", "3000", "--max-num-seqs", "64")


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, stdout: Path, stderr: Path):
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.url}/v1"
        self._stdout = stdout
        self._stderr = stderr

    def stderr(self) -> str:
        return self._stderr.read_text(errors="replace")

    def stdout(self) -> str:
        return self._stdout.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; wait for the exit and return its code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit {timeout}s after SIGTERM:\n{self.stderr()[-3000:]}")

    def check_clean_exit(self, code: int) -> None:
        err = self.stderr()
        assert code == 0, f"server exited with {code}:\n{err[-3000:]}"
        assert "Traceback" not in err, err[-5000:]
        assert not re.search(r"^(ERROR|CRITICAL)", err, re.MULTILINE), err[-5000:]


def _wait_healthy(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode} while starting:\n{server.stderr()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server did not become healthy in {timeout}s:\n{server.stderr()}")


def _start(launcher: tuple[str, ...], args: tuple[str, ...], env: dict[str, str], out: Path,
           err: Path) -> ServerProcess:
    port = free_port()
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([sys.executable, *launcher, "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--disable-uvicorn-access-log", *args], cwd=ROOT, env=env, stdout=fo, stderr=fe)
    return ServerProcess(proc, port, out, err)


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None, check_exit: bool = True,
                   startup_timeout: float = 120.0,
                   launcher: tuple[str, ...] = ("-m", "kimiserve.entrypoints.cli")) -> Iterator[ServerProcess]:
    """Start `python -m kimiserve.entrypoints.cli serve --port FREE ARGS` (or `python LAUNCHER serve ...`),
    wait for /health (started again on another port if the drawn one was taken first), yield it; afterwards
    SIGTERM it (unless it has exited) and (check_exit) require exit code 0 and a clean stderr. The model is
    the random `tiny` preset unless ARGS give --model."""
    if "--model" not in args:
        args = ("--model", "tiny", *args)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(3):  # another test may draw the same port and bind it first
            server = _start(launcher, args, full_env, Path(tmp) / f"stdout{attempt}", Path(tmp) / f"stderr{attempt}")
            try:
                _wait_healthy(server, startup_timeout)
                break
            except RuntimeError:
                if server.proc.poll() is None:
                    server.proc.kill()
                    server.proc.wait()
                if attempt == 2 or "address already in use" not in server.stderr():
                    raise
        try:
            yield server
        except BaseException:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
            raise
        code = server.terminate()
        if check_exit:
            server.check_clean_exit(code)


def metrics(url: str, prefix: str = "kimiserve:") -> dict[str, float]:
    """GET /metrics -> {'kimiserve:name{labels}': value} (labels without model_name; sorted); `prefix`
    "vllm:" for the vLLM-named copies."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, value = line.rsplit(" ", 1)
        match = re.match(r"([^{]+)\{(.*)\}", name)
        if match:
            labels = [kv for kv in match.group(2).split(",") if not kv.startswith("model_name=")]
            name = match.group(1) + (("{" + ",".join(sorted(labels)) + "}") if labels else "")
        out[name] = float(value)
    return out


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02):
    """Poll predicate() until it returns a truthy value (returned) or the timeout passes (the last value)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
