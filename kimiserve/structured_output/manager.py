"""Guided decoding on the engine's side: the grammar cache, compilation off the hot path, and each
sample's grammar state.

`StructuredOutputManager.submit(spec)` returns a future: the compile runs in one worker thread
(llguidance drops the GIL while it builds a grammar), so it overlaps the engine's steps; the
scheduler keeps a request waiting until its grammar is ready, and a spec that fails to compile
fails that request alone. Compiled grammars are cached by the spec (`StructuredOutputsParams.key`);
each sample deep-copies the cached matcher. `compile(spec)` does the same synchronously, for the
server to refuse a bad spec with a 400 before queuing it (the engine then finds it cached).

`RequestGrammar` is one sample's state: the matcher, advanced with each sampled token, plus the
phases that keep it off while the model reasons (`after_reasoning`) or until a trigger token
opens the constrained part (`trigger`). It can fork (n > 1) and roll back k tokens (speculative
decoding). Preemption needs nothing: a preempted request keeps its output tokens, and its matcher
stays where they left it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kimiserve.structured_output.params import StructuredOutputsParams

THINK_START, THINK_END = "<think>", "</think>"
WAIT, OPEN, THINKING, ACTIVE = "wait", "open", "thinking", "active"
"""Phases of a RequestGrammar: waiting for the trigger token (free), at the start of a reply that may
open `<think>` (grammar mask plus `<think>`), inside a `<think>` block (free), constrained."""


class StructuredOutputManager:
    """Per engine: the backend (built on first use, in the compile thread), the cache, the worker."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, cache_size: int = 512):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._backend = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimiserve-grammar")

    def _get_backend(self):
        with self._lock:
            if self._backend is None:
                from kimiserve.structured_output.backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self._tokenizer, self._vocab_size, self._eos)
            return self._backend

    def check_available(self) -> None:
        """ValueError when guided decoding cannot run here (no tokenizer, llguidance missing)."""
        if self._tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this model has none")
        from kimiserve.structured_output.backend import import_llguidance

        import_llguidance()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled prototype matcher (cached by spec; a cached failure fails again)."""
        self.check_available()
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputsParams):
        backend = self._get_backend()
        if spec.trigger is not None and spec.trigger not in backend.special_ids:
            raise ValueError(f"structured_outputs.trigger {spec.trigger!r} is not a special token of this tokenizer")
        return backend.compile(spec)

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Compile now (or find it cached); ValueError naming the problem when the spec does not compile."""
        self.submit(spec).result()

    def new_grammar(self, spec: StructuredOutputsParams, prototype, prompt_ids: list[int]) -> "RequestGrammar":
        """The state of a request's first sample at the start of its output."""
        backend = self._get_backend()
        ids = backend.special_ids
        start, end = ids.get(THINK_START), ids.get(THINK_END)
        trigger = ids.get(spec.trigger) if spec.trigger else None
        if trigger is not None:
            phase = WAIT
        elif spec.after_reasoning and start is not None and end is not None:
            last = next((t for t in reversed(prompt_ids) if t in (start, end)), None)
            phase = ACTIVE if prompt_ids and prompt_ids[-1] == end else THINKING if last == start else OPEN
        else:
            phase = ACTIVE
        grammar = RequestGrammar(backend, prototype.deep_copy(), phase, start, end, trigger)
        if spec.prefix:
            grammar.phase = ACTIVE
            if not grammar.matcher.consume_tokens(self._tokenizer.encode(spec.prefix, allow_special=True)):
                raise ValueError(f"structured_outputs.prefix {spec.prefix!r} does not start the grammar")
            grammar.history.clear()  # the prefix is the prompt's, never rolled back
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class RequestGrammar:
    """One sample's grammar: the matcher and the phase (see the module doc)."""

    backend: object
    matcher: object
    phase: str
    think_start: int | None
    think_end: int | None
    trigger: int | None
    history: list[tuple[str, bool]] = field(default_factory=list)
    """Per accepted token: the phase before it, and whether the matcher consumed it (for rollback)."""

    @property
    def needs_mask(self) -> bool:
        return self.phase in (OPEN, ACTIVE)

    @property
    def is_terminated(self) -> bool:
        return self.phase == ACTIVE and self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        """Advance by one generated token; ValueError when the grammar does not allow it."""
        before, consumed = self.phase, False
        if self.phase == WAIT:
            if token == self.trigger:
                consumed, self.phase = True, ACTIVE
        elif self.phase == THINKING:
            if token == self.think_end:
                self.phase = ACTIVE
        elif self.phase == OPEN and token == self.think_start:
            self.phase = THINKING
        else:
            consumed, self.phase = True, ACTIVE
        if consumed and not self.matcher.consume_token(token):
            self.phase = before
            raise ValueError(f"token {token} is not allowed by the request's grammar "
                             f"({self.matcher.get_error() or 'rejected'})")
        self.history.append((before, consumed))

    def accept_tokens(self, tokens: list[int]) -> None:
        for t in tokens:
            self.accept(t)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= len(self.history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self.history)} were accepted")
        undone = self.history[len(self.history) - num_tokens:]
        del self.history[len(self.history) - num_tokens:]
        consumed = sum(c for _, c in undone)
        if consumed and not self.matcher.rollback(consumed):
            raise ValueError(f"the matcher could not roll back {consumed} tokens")
        if undone:
            self.phase = undone[0][0]

    def fork(self) -> "RequestGrammar":
        return RequestGrammar(self.backend, self.matcher.deep_copy(), self.phase, self.think_start, self.think_end,
                              self.trigger, list(self.history))


def fill_bitmask(grammars: list[RequestGrammar | None], bitmask: torch.Tensor) -> list[int]:
    """Fill bitmask[i] (CPU int32 [R, W]) for each grammar that needs a mask (each distinct grammar
    once; rows sharing one, such as the n samples drawn from a prompt, get a copy); returns the rows
    filled. Rows in the OPEN phase also allow `<think>`."""
    first: dict[int, int] = {}
    work: dict[int, list] = {}
    rows = []
    for i, g in enumerate(grammars):
        if g is None or not g.needs_mask:
            continue
        rows.append(i)
        if id(g) in first:
            continue
        first[id(g)] = i
        work.setdefault(id(g.backend), [g.backend, []])[1].append((g.matcher, i))
    for backend, matchers in work.values():
        backend.fill(matchers, bitmask)
    for i in rows:
        g = grammars[i]
        j = first[id(g)]
        if j != i:
            bitmask[i] = bitmask[j]
        if g.phase == OPEN and g.think_start is not None:
            word, bit = divmod(g.think_start, 32)
            value = (int(bitmask[i, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[i, word] = value - (1 << 32) if value >= 1 << 31 else value
    return rows
