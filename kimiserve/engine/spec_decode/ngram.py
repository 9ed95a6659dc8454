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
    ends = np.nonzero(a[: L - 1] == a[L - 1])[0]  # candidate n-gram ends i < L - 1: a[i] == last token
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # matched n-gram length at each candidate, up to max_n
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, L - 1)):
        ok = alive & (ends - j >= 0)
        ok[ok] = a[ends[ok] - j] == a[L - 1 - j]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = length.max()
    if best < min_n:
        return []
    full = ends + k <= L - 1  # followed by k tokens
    for n in range(best, min_n - 1, -1):
        pick = np.nonzero(full & (length >= n))[0]
        if pick.size:
            return a[ends[pick[-1]] + 1 : ends[pick[-1]] + 1 + k].tolist()
    end = int(ends[np.nonzero(length == best)[0][0]])
    return a[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    def __init__(self, config):
        self.k, self.min_n, self.max_n = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list, limits: list[int], on_device: bool = False) -> list[list[int]]:
        """Drafts per request (request.all_ids), at most limits[i] tokens each (on the host: `on_device` is
        the draft model's)."""
        return [ngram_propose(r.all_ids, min(self.k, n), self.min_n, self.max_n) if n > 0 else []
                for r, n in zip(requests, limits)]

    def release(self, request) -> None:
        """Nothing held per request."""

    def check_idle(self) -> None:
        """Nothing held per request."""
