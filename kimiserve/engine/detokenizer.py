"""IncrementalDetokenizer: output token ids -> text, one token at a time, with stop strings.

Kimi's tokenizer is byte-level, so a token may end in the middle of a UTF-8 character. The
token bytes go through an incremental UTF-8 decoder (errors="replace") that holds an incomplete
character back until its remaining bytes arrive; the text it produces is always exactly
`tokenizer.decode(output_ids, skip_special_tokens)` once `finish()` has flushed the tail.
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    """Decodes one sample's output tokens incrementally and watches for stop strings.

    `min_tokens` (an addition to the usual arguments): stop strings are only looked for once more
    than min_tokens tokens exist, matching the sampler's masking of eos before min_tokens.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)  # byte-level BPE: the output decodes without prompt context
        self.output_ids: list[int] = []
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._special_ids = frozenset(tokenizer.special_tokens.values()) if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the text is kept as what stream_delta returned (pieces, joined lazily) and what it has not:
        # appending a token then costs its own length, not the length of the text so far
        self._sent: list[str] = []
        self._pending = ""
        self._finished = False
        self._stopped: str | None = None
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        """Output text so far: complete characters only (until `finish()`), cut at a matched stop."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return (self._sent[0] if self._sent else "") + self._pending

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stopped

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids and self.tokenizer.decode([token_id], skip_special_tokens=True) == "":
            return b""  # a skipped special token (markers flagged `special: false` are kept)
        return self.tokenizer.decode_token_bytes(token_id)

    def add(self, token_id: int) -> str | None:
        """Append one token; return the stop string if the output text now contains one."""
        if self._stopped is not None or self._finished:
            raise RuntimeError("add() after the output was stopped or finished")
        self.output_ids.append(int(token_id))
        return self._append(self._decoder.decode(self._token_bytes(token_id), final=False))

    def finish(self) -> str | None:
        """Flush held-back bytes (an unfinished character decodes to U+FFFD, as decode() does)."""
        if self._finished or self._stopped is not None:
            self._finished = True
            return None
        self._finished = True
        return self._append(self._decoder.decode(b"", final=True))

    def _append(self, new_text: str) -> str | None:
        old_len = len(self._pending)
        self._pending += new_text
        if not new_text or not self.stop or len(self.output_ids) <= self.min_tokens:
            return None
        best: tuple[int, int] | None = None  # (position in the pending text, index into self.stop)
        for k, s in enumerate(self.stop):
            # only a match that ends in the new text is new: it starts after old_len - len(s); such a
            # match never reaches into text already streamed, which holds back (longest stop - 1) chars
            pos = self._pending.find(s, max(0, old_len - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, k)
        if best is None:
            return None
        pos, k = best
        self._stopped = self.stop[k]
        self._pending = self._pending[:pos + len(self._stopped) if self.include_stop_str_in_output else pos]
        return self._stopped

    def stream_delta(self, finished: bool = False) -> str:
        """Text not returned by earlier calls. While not finished (and not stopped) the last
        (longest stop length - 1) characters are held back, so a stop string is never streamed in
        part. finished=True flushes everything (calls `finish()`)."""
        if finished:
            self.finish()
        hold = 0 if (self._finished or self._stopped is not None) else self._hold
        n = max(0, len(self._pending) - hold)
        delta, self._pending = self._pending[:n], self._pending[n:]
        if delta:
            self._sent.append(delta)
            if len(self._sent) > 256:  # a stream that never reads `text`: one string per 256 deltas
                self._sent = ["".join(self._sent)]
        return delta
