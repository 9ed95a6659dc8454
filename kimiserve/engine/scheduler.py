"""Continuous batching over the page pool: one token budget per step, decode first, chunked prefill.

Each step every running request may let its cached tokens catch up with its total (vLLM v1's
rule): decode requests first (one token each), then prefill chunks, then new requests in FCFS
order. When the pool cannot give a request its pages (after evicting prefix-cache snapshots),
the newest running request is preempted: its pages are freed and it is recomputed later.
The scheduler moves no bytes: page copies (copy-on-write) and pages to zero (fresh KDA state)
travel in its output to the runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kimiserve.cache.allocator import PageAllocator
from kimiserve.engine.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) page copies to run before the forward, in order."""
    fresh_state_pages: list[int] = field(default_factory=list)
    """State pages to zero before the forward (a sequence starting from scratch)."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the drafts fed after the pending token (num_tokens = 1 + len of them); the
    chunk is verified and only its accepted tokens are committed (`spec_decode.verify`)."""
    draft_row: object = None
    """The drafts on the device (`spec_decode.device_drafts.DraftRow`; draft_token_ids are placeholders
    until the engine reads them after the step), or None."""
    snapshot_state_pages: list[int] = field(default_factory=list)
    """Pages that receive the KDA state before the prompt's last token (for a prefix-cache
    snapshot that an identical or extended prompt can restore, leaving one token to compute)."""


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, allocator: PageAllocator, num_state_pages: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool):
        self.allocator = allocator
        self.num_state_pages = num_state_pages
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.on_finish = None
        """Called with each sample that finishes (the draft-model proposer frees its pages there)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, only: Request | None = None) -> SchedulerOutput:
        """The step's chunks; `only` restricts the step to that one request (running, or admitted
        from wherever it waits), which the engine uses to find the request a failed step was due to."""
        if only is not None:
            return self._schedule_only(only)
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in sorted(self.running, key=lambda r: (not r.is_decode, r.arrival)):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            drafts = request.spec_token_ids[: budget - 1] if request.spec_token_ids and request.is_decode else []
            n = min(request.num_pending + len(drafts), budget)
            chunk = self._reserve(request, n)
            if chunk is None and drafts:  # no pages for the drafts: decode without them before preempting
                drafts, n = [], 1
            while chunk is None and (chunk := self._reserve(request, n)) is None:
                victim = max(self.running, key=lambda r: r.arrival)
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            if chunk is not None:
                if drafts:  # (else the chunk keeps its own empty draft list and no draft row)
                    chunk.draft_token_ids = list(drafts)
                    chunk.draft_row = request.spec_draft_row
                out.chunks.append(chunk)
                budget -= n
        compiling: list[Request] = []  # waiting for their grammar: the requests behind them go first
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            if not request.ready:
                compiling.append(self.waiting.popleft())
                continue
            if len(self.running) + (request.params.n if not request.output_ids else 1) > self.max_num_seqs:
                break
            self._restore_prefix(request)
            n = min(request.num_pending, budget)
            chunk = self._reserve(request, n)
            if chunk is None:
                self._release(request)
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            out.chunks.append(chunk)
            budget -= n
        self.waiting.extendleft(reversed(compiling))
        return out

    def _schedule_only(self, request: Request) -> SchedulerOutput:
        out = SchedulerOutput()
        if request.status is Status.WAITING:
            need = request.params.n if not request.output_ids and request.sample_index == 0 else 1
            while self.running and len(self.running) + need > self.max_num_seqs:
                self._preempt(max(self.running, key=lambda r: r.arrival), out)
            self._restore_prefix(request)
            self.waiting.remove(request)
            request.status = Status.RUNNING
            self.running.append(request)
        if request.status is not Status.RUNNING:
            return out
        n = min(request.num_pending, self.max_num_batched_tokens)
        while (chunk := self._reserve(request, n)) is None:
            others = [r for r in self.running if r is not request]
            if not others:  # cannot happen: the pool holds one max_model_len sequence
                raise RuntimeError(f"the cache cannot hold request {request.request_id!r} alone")
            self._preempt(max(others, key=lambda r: r.arrival), out)
        out.chunks.append(chunk)
        return out

    def retry_later(self, sched: SchedulerOutput) -> None:
        """After a failed forward: free the pages of every request of the step (the forward may have
        written part of their KDA state) and put them back at the front of the queue, in arrival
        order, to be recomputed. Not a preemption: the preemption counters do not move."""
        requests = [c.request for c in sched.chunks]
        for chunk in sched.chunks:
            self.allocator.decref(chunk.snapshot_state_pages)
            chunk.snapshot_state_pages = []
        for request in sorted(requests, key=lambda r: r.arrival, reverse=True):
            if request.status is Status.RUNNING:
                self._release(request)
                self.running.remove(request)
                request.status = Status.WAITING
                self.waiting.appendleft(request)

    def _restore_prefix(self, request: Request) -> None:
        """Start from the longest cached prefix that ends at a snapshot (never the whole sequence)."""
        first = not request.output_ids and request.num_preemptions == 0
        if first:  # what the request reports: its first admission's hit (a recompute's is not the client's)
            request.num_cached_tokens = 0
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return
        hit = self.allocator.lookup(request.all_ids, request.num_tokens - 1, request.lora_id)
        if hit is None:
            return
        self.allocator.acquire(hit)
        request.block_table, request.state_pages = list(hit.block_table), list(hit.state_pages)
        request.num_computed = hit.num_tokens
        if first:
            request.num_cached_tokens = min(hit.num_tokens, len(request.prompt_ids))

    def reserve_ahead(self, requests: list[Request]) -> SchedulerOutput | None:
        """Async scheduling: a decode chunk for each running request's token after the one the step in
        flight feeds (that step's tokens are not known yet: they come from the device). None when the
        pool is short (no preemption here; the engine then waits for the step and schedules as usual:
        pages reserved so far are the ones that step would reserve, or are freed when the request ends)."""
        out = SchedulerOutput()
        for request in requests:
            chunk = self._reserve(request, 1, ahead=1)
            if chunk is None:
                return None
            out.chunks.append(chunk)
        return out

    def _reserve(self, request: Request, n: int, ahead: int = 0) -> ScheduledChunk | None:
        """Pages for `n` more tokens of `request` (after `ahead` tokens a launched step feeds), copying shared
        pages it writes into; None if the pool is short."""
        alloc, bs = self.allocator, self.allocator.block_size
        end = request.num_computed + ahead + n
        new_blocks = -(-end // bs) - len(request.block_table)
        writes_last = (request.num_computed + ahead) % bs != 0
        cow_last = writes_last and alloc.refcount(request.block_table[-1]) > 1
        shared_states = alloc.shared(request.state_pages)
        fresh_states = 0 if request.state_pages else self.num_state_pages
        total = new_blocks + cow_last + len(shared_states) + fresh_states
        chunk = ScheduledChunk(request, n)
        if total == 0:  # a decode within its own pages (the common step)
            if not request.output_ids:
                self._reserve_prompt_snapshot(request, chunk)
            return chunk
        if not alloc.can_allocate(total):
            return None
        pages = alloc.allocate(total)
        if cow_last:
            chunk.copies.append((request.block_table[-1], pages[0]))
            alloc.decref([request.block_table[-1]])
            request.block_table[-1] = pages.pop(0)
        for i in shared_states:
            chunk.copies.append((request.state_pages[i], pages[0]))
            alloc.decref([request.state_pages[i]])
            request.state_pages[i] = pages.pop(0)
        if fresh_states:
            request.state_pages = pages[:fresh_states]
            chunk.fresh_state_pages = list(request.state_pages)
            pages = pages[fresh_states:]
        request.block_table.extend(pages)
        self._reserve_prompt_snapshot(request, chunk)
        return chunk

    def _reserve_prompt_snapshot(self, request: Request, chunk: ScheduledChunk) -> None:
        """The chunk that ends a prompt also keeps the state before its last token, if pages allow."""
        end = request.num_computed + chunk.num_tokens
        if (not self.enable_prefix_caching or request.output_ids or request.sample_index
                or end != len(request.prompt_ids) or end < 2 or request.params.prompt_logprobs is not None
                or not self.allocator.can_allocate(self.num_state_pages)):
            return
        chunk.snapshot_state_pages = self.allocator.allocate(self.num_state_pages)
        if chunk.num_tokens == 1:  # the state before this token is the state now
            chunk.copies += list(zip(request.state_pages, chunk.snapshot_state_pages))

    def _release(self, request: Request) -> None:
        self.allocator.decref(request.pages)
        request.block_table, request.state_pages = [], []
        request.num_computed = 0
        request.spec_token_ids = []
        request.spec_draft_row = None

    def after_verify(self, request: Request) -> None:
        """After a verify chunk committed its accepted tokens: release the pages past the committed ones
        (written only for rejected drafts); the slots of rejected drafts in the last page are
        overwritten by later tokens."""
        keep = -(-request.num_computed // self.allocator.block_size)
        if len(request.block_table) > keep:
            self.allocator.decref(request.block_table[keep:])
            del request.block_table[keep:]

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Free the request's pages and requeue it at the front; returns the budget it gave back."""
        refund = 0
        for chunk in list(out.chunks):
            if chunk.request is request:
                out.chunks.remove(chunk)
                self.allocator.decref(chunk.snapshot_state_pages)
                refund += chunk.num_tokens
        self._release(request)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)
        return refund

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sample: keep a snapshot of its cached tokens for later prompts, free its pages."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            if (self.enable_prefix_caching and reason not in ("abort", "error") and request.num_computed
                    and not request.fed_ahead):
                self.allocator.snapshot(request.all_ids[: request.num_computed], request.block_table, request.state_pages,
                                        request.lora_id)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status, request.finish_reason, request.stop_reason = Status.FINISHED, reason, stop_reason
        if self.on_finish is not None:
            self.on_finish(request)

    def keep_prompt_snapshot(self, chunk: ScheduledChunk) -> None:
        """After the step: hand the state kept before the prompt's last token to the prefix cache."""
        if chunk.snapshot_state_pages:
            request = chunk.request
            self.allocator.snapshot(request.prompt_ids[:-1], request.block_table, chunk.snapshot_state_pages,
                                    request.lora_id)
            self.allocator.decref(chunk.snapshot_state_pages)  # the snapshot holds them now (or they are free)

    def drop_prompt_snapshot(self, chunk: ScheduledChunk) -> None:
        """After the step, for a chunk whose request ended during it: release the snapshot pages."""
        self.allocator.decref(chunk.snapshot_state_pages)
        chunk.snapshot_state_pages = []

    def fork(self, parent: Request, sample_index: int, arrival: int) -> Request:
        """Another sample of a request sharing the parent's pages (copy-on-write from here on)."""
        child = Request(parent.request_id, parent.prompt_ids, parent.params, arrival, sample_index,
                        num_computed=parent.num_computed, block_table=list(parent.block_table),
                        state_pages=list(parent.state_pages), status=Status.RUNNING,
                        num_cached_tokens=parent.num_cached_tokens, lora_id=parent.lora_id)
        self.allocator.incref(child.pages)
        self.running.append(child)
        return child
