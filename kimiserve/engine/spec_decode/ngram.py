"""N-gram prompt lookup: draft the tokens that followed an earlier occurrence of the sequence's last n
tokens: the longest n in [prompt_lookup_min, prompt_lookup_max] whose occurrence is followed by k
tokens (the latest such), else the earliest occurrence of the longest n-gram (followed by the most
tokens); over the prompt and the output so far."""

from __future__ import annotations

import numpy as np


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k drafts after token_ids (fewer when the match lies near the end; none without a match)."""
    a = np.asarray(token_ids, dtype=np.int64)
    L = len(a)
    if k < 1 or L < min_n + 1:
        return []
    ends = np.flatnonzero(a[: L - 1] == a[L - 1])  # candidate n-gram ends i < L - 1: a[i] == last token
    if ends.size == 0:
        return []
    # matched n-gram length at each candidate, up to max_n: the leading run of equal tokens going back
    back = np.arange(min(max_n, L - 1))
    at = ends[:, None] - back
    same = (at >= 0) & (a[np.maximum(at, 0)] == a[L - 1 - back])
    length = np.cumprod(same, axis=1).sum(axis=1)
    best = int(length.max())
    if best < min_n:
        return []
    followed = ends + k <= L - 1  # followed by k tokens
    n = int(length[followed].max()) if followed.any() else 0
    if n >= min_n:  # the longest n-gram followed by k tokens: its latest occurrence
        end = int(ends[np.flatnonzero(followed & (length >= n))[-1]])
    else:  # the earliest occurrence of the longest n-gram (followed by the most tokens)
        end = int(ends[np.flatnonzero(length == best)[0]])
    return a[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    def __init__(self, config):
        self.k, self.min_n, self.max_n = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        self._ids: dict[object, np.ndarray] = {}
        """Each request's tokens so far as a numpy buffer (grown in place: a round appends the tokens it kept)."""
        self._lengths: dict[object, int] = {}

    def _tokens(self, request) -> np.ndarray:
        """request.all_ids as an array, from the cached buffer plus the tokens appended since."""
        buf, n = self._ids.get(request), self._lengths.get(request, 0)
        total = request.num_tokens
        if buf is None or n > total:
            buf, n = np.empty(max(64, 2 * total), dtype=np.int64), 0
        elif total > buf.size:
            buf = np.concatenate([buf[:n], np.empty(total, dtype=np.int64)])
        if n < total:
            prompt = len(request.prompt_ids)
            if n < prompt:
                buf[n:prompt] = request.prompt_ids[n:]
                n = prompt
            buf[n:total] = request.output_ids[n - prompt : total - prompt]
        self._ids[request], self._lengths[request] = buf, total
        return buf[:total]

    def propose(self, requests: list, limits: list[int], on_device: bool = False) -> list[list[int]]:
        """Drafts per request (its tokens so far), at most limits[i] tokens each (on the host: `on_device` is
        the draft model's)."""
        return [ngram_propose(self._tokens(r), min(self.k, n), self.min_n, self.max_n) if n > 0 else []
                for r, n in zip(requests, limits)]

    def release(self, request) -> None:
        self._ids.pop(request, None)
        self._lengths.pop(request, None)

    def check_idle(self) -> None:
        if self._ids:
            raise RuntimeError(f"the n-gram proposer still holds the tokens of {len(self._ids)} request(s)")
