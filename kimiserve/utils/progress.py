"""A small progress bar on stderr (no tqdm): "generate: 12/64 requests, 340 tok/s out".

The line is rewritten in place with a carriage return, at most `1 / min_interval` times a
second (the last state is always drawn), and ended with a newline by `close()`. A bar for a
single item (total <= 1) or with `enabled=False` writes nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, desc: str = "generate", unit: str = "requests", enabled: bool = True,
                 stream: TextIO | None = None, min_interval: float = 0.1):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled and total > 1
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.done = 0
        self.tokens = 0
        self._start = time.monotonic()
        self._last_draw = float("-inf")
        self._width = 0
        self._closed = False

    def update(self, done: int = 0, tokens: int = 0) -> None:
        """Count `done` more finished items and `tokens` more generated tokens."""
        self.done += done
        self.tokens += tokens
        if self.enabled and time.monotonic() - self._last_draw >= self.min_interval:
            self._draw()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return f"{self.desc}: {self.done}/{self.total} {self.unit}, {self.tokens / elapsed:.0f} tok/s out"

    def _draw(self) -> None:
        text = self.line()
        # pad with spaces so a shorter line fully covers the previous one
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)
        self._last_draw = time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
