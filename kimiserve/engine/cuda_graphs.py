"""CUDA graphs for decode steps: one graph per (padded batch size, context bucket), captured the
first time a step of that shape runs, then replayed.

A graph's inputs live in static device buffers that each step refills with one host-to-device copy
(from a pinned mirror, so the host does not wait for the device): token ids, positions, the cache
slot each token writes, block tables, context lengths and KDA state pages. Rows past the
real batch are padding: they read and write one reserved attention page and one reserved set of
state pages that no sequence owns, so their garbage never touches a request. The context bucket
(a power of two >= 2048, capped at max_model_len) is the width of the index scan's score rows and
of the dense MLA splits, so short contexts do not pay for max_model_len.

Capturing runs the forward once eagerly on padding rows only (it compiles kernels and settles the
allocator) and then records it; neither touches a real sequence's pages, so the step it was
captured for then replays once with its real inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings

import numpy as np
import torch

from kimiserve.cache.pool import PagePool
from kimiserve.model.batch import ForwardBatch, SequenceChunk
from kimiserve.model.model import KimiForCausalLM
from kimiserve.model.moe import STATIC_MOE_TOKENS
from kimiserve.ops.backend import DecodeOps

_PAD_ROW = ("pad",)
"""A mirror row holding the padding pages (`DecodeGraphs._written`)."""

MIN_CONTEXT_BUCKET = 2048  # K3.1's index top-k: shorter contexts run dense MLA, without the scan
FIELDS = 6  # per-row inputs: ids, positions, write pages, write offsets, context lengths, LoRA slots


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def fill_page_rows(chunks, tables: np.ndarray, states: np.ndarray) -> None:
    """Row i of `tables` [n, cols] gets chunks[i].block_table (its first cols pages when longer; the rest
    of the row is left as it is) and row i of `states` [n, S] chunks[i].state_pages, in a few numpy calls
    (one pass over the pages, no per-row numpy call)."""
    n, cols = tables.shape
    lens = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=n)
    if n and lens.max() > cols:
        pages = (c.block_table[:cols] for c in chunks)
        np.minimum(lens, cols, out=lens)
    else:
        pages = (c.block_table for c in chunks)
    flat = np.fromiter(itertools.chain.from_iterable(pages), dtype=np.int64, count=int(lens.sum()))
    tables[np.arange(cols) < lens[:, None]] = flat  # row-major order: each row's pages in turn
    if states.size:
        states[:] = np.fromiter(itertools.chain.from_iterable(c.state_pages for c in chunks), dtype=np.int64,
                                count=states.size).reshape(states.shape)


class GraphSet:
    """What the decode, verify and draft-loop graph sets share: the shapes they capture for (padded
    batch sizes `sizes`, ascending; context buckets up to `max_model_len`) and the warm-up before a
    capture, on a side stream, with the one private memory pool of the set's graphs."""

    sizes: list[int]
    max_model_len: int
    memory_pool: tuple | None
    graphs: dict
    inputs: torch.Tensor

    def warm_up(self, *runs) -> None:
        """Run each of `runs` once eagerly on a side stream (kernels compiled, allocator settled), as a
        capture must be preceded by; creates the set's memory pool on first use."""
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for run in runs:
                run()
        torch.cuda.current_stream().wait_stream(stream)

    def release(self) -> None:
        """Drop every graph of the set and their memory pool: the next capture starts a new pool. (Capturing
        into the old one after its last graph is gone trips the CUDA caching allocator's `use_count > 0` assert.)"""
        if self.graphs and self.inputs.device.type == "cuda":
            torch.cuda.synchronize(self.inputs.device)  # no replay still reading the pool
        self.graphs.clear()
        self.memory_pool = None

    def record(self, fn):
        """Capture fn() (no arguments, on the set's static buffers; after `warm_up`) as a CUDA graph in the
        set's memory pool; returns (the graph, fn's outputs, static tensors every replay rewrites)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            out = fn()
        return graph, out

    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def context_bucket(self, max_context: int) -> int:
        """A power of two >= MIN_CONTEXT_BUCKET and >= max_context, capped at max_model_len."""
        bucket = MIN_CONTEXT_BUCKET
        while bucket < max_context:
            bucket *= 2
        return min(bucket, self.max_model_len)


class DecodeGraphs(GraphSet):
    """Captures and replays decode-only steps of `model` on `pool`.

    pad_page: an attention page no sequence owns; pad_state_pages: int64 [num_kda_layers] state
    pages no sequence owns (both reserved by the engine outside the allocator's pages). forward:
    what a graph records, `(input_ids, batch, logits_rows) -> logits` (default the model's
    `forward_batch`; batch-invariant mode: `InvariantForward.forward_batch`, whose decode rows do not
    depend on the padding rows either).
    """

    def __init__(self, model: KimiForCausalLM, pool: PagePool, ops: DecodeOps, max_num_seqs: int,
                 max_model_len: int, pad_page: int, pad_state_pages: torch.Tensor, forward=None):
        self.model, self.pool, self.ops = model, pool, ops
        self.forward = forward or model.forward_batch
        self.sizes = capture_sizes(max(1, min(max_num_seqs, STATIC_MOE_TOKENS)))
        self.max_batch, self.max_model_len = self.sizes[-1], max_model_len
        self.pad_page = pad_page
        dev = pool.data.device
        B, width = self.max_batch, math.ceil(max_model_len / pool.block_size)
        num_state = pad_state_pages.numel()
        long = dict(dtype=torch.int64, device=dev)
        # every input lives in one device buffer, filled by one host-to-device copy per step from a
        # pinned host mirror: the per-row fields at a stride of B rows, then the block tables of the
        # graph about to run, packed [size, its context bucket's pages] (each graph reads its own view)
        self._head = (FIELDS + num_state) * B
        self.inputs = torch.zeros(self._head + B * width, **long)
        fields = self.inputs[: FIELDS * B].view(FIELDS, B)
        self.input_ids, self.positions, self.write_pages, self.write_offsets, self.context_lens, self.lora_slots = fields
        self.state_pages = self.inputs[FIELDS * B : self._head].view(B, num_state)
        self.lora = None
        """The engine's `kimiserve.lora.serving.ServingLoRA` when it serves adapters: each row's slot is
        an input (`lora_slots`, 0 on padding rows) and the graphs capture again when its buffers change."""
        self._lora_version = None
        self.pad_state_pages = pad_state_pages.to(dev)
        self._pad_states_host = pad_state_pages.cpu().numpy()
        self._pad_fields = np.array([[0], [0], [pad_page], [0], [1], [0]], dtype=np.int64)
        self._on_cuda = dev.type == "cuda"
        self._mirrors: list[torch.Tensor] = []
        """Two mirrors on CUDA, used in turn: one can still be copying while the next step fills the other."""
        self._mirror_events: list = []
        self._mirror_arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        """Per mirror, views made once (not per step): its numpy array, the per-row fields [FIELDS, B] and the
        state pages [B, num_state] in it."""
        self._written: list = []
        """Per mirror: ((rows, table width) of its layout, per row the (block table, state pages) it holds,
        or _PAD_ROW, or None when unknown), so that `_fill_pages` writes only the rows that changed."""
        for _ in range(2 if self._on_cuda else 1):
            self._add_mirror()
        self._turn = 0
        self._row_index = np.arange(B)
        self.rows = torch.arange(B, **long)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_pool = None  # one private pool shared by every graph (never replayed concurrently)
        self.disabled: str | None = None
        """Why graphs are off (a capture failed), else None."""
        self.replays = 0

    def _add_mirror(self) -> None:
        """One more host mirror of `inputs` (pinned on CUDA), used in turn with the others."""
        B = self.max_batch
        mirror = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=self._on_cuda)
        host = mirror.numpy()
        self._mirrors.append(mirror)
        self._mirror_events.append(None)
        self._mirror_arrays.append((host, host[: FIELDS * B].reshape(FIELDS, B),
                                    host[FIELDS * B : self._head].reshape(B, self.state_pages.shape[1])))
        self._written.append(None)

    def run(self, input_ids, chunks, lora_slots: list[int] | None = None) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode-only step (one token per chunk), or None when no graph can
        run it (too large a batch, or graphs disabled): the caller runs it eagerly. input_ids: a host
        list, or an int64 device tensor [n] (tokens the device sampled and the host has not seen).
        chunks: the sequences' `StepChunk`s (or anything with context_start, block_table, state_pages).
        lora_slots: each chunk's LoRA slot (with `self.lora`; None: all base)."""
        n = len(chunks)
        size = self.padded_size(n)
        if self.disabled or size is None or n == 0:
            return None
        if self.lora is not None and self.lora.version != self._lora_version:
            self.release()  # captured before a projection got LoRA buffers: they do not read them
            self._lora_version = self.lora.version
        bucket = self.context_bucket(max(c.context_start for c in chunks) + 1)
        key = (size, bucket)
        if key not in self.graphs and not self._capture(size, bucket):
            return None
        self._fill(input_ids, chunks, size, bucket, lora_slots)
        graph, logits = self.graphs[key]
        graph.replay()
        self.replays += 1
        return logits[:n]

    def _cols(self, bucket: int) -> int:
        return math.ceil(bucket / self.pool.block_size)

    def _tables(self, size: int, bucket: int) -> torch.Tensor:
        cols = self._cols(bucket)
        return self.inputs[self._head : self._head + size * cols].view(size, cols)

    def _fill(self, input_ids, chunks, size: int, bucket: int, lora_slots: list[int] | None = None) -> None:
        """Real rows from the chunks, padding rows on the reserved pages; one host-to-device copy."""
        n, bs = len(chunks), self.pool.block_size
        cols = self._cols(bucket)
        turn = self._turn
        self._turn = (turn + 1) % len(self._mirrors)
        if self._mirror_events[turn] is not None:
            self._mirror_events[turn].synchronize()  # its previous copy is done (at once, in practice)
        host, all_fields, states = self._mirror_arrays[turn]
        fields = all_fields[:, :size]
        ids, positions, write_pages, write_offsets, context_lens, slots = fields
        tables = host[self._head : self._head + size * cols].reshape(size, cols)
        self._fill_pages(turn, chunks, tables, states[:size])
        fields[:, n:] = self._pad_fields  # ids 0, position 0, the pad page, offset 0, context 1, LoRA slot 0
        if n:
            pos = positions[:n]
            pos[:] = np.fromiter((c.context_start for c in chunks), dtype=np.int64, count=n)
            write_pages[:n] = tables[self._row_index[:n], pos // bs]
            np.remainder(pos, bs, out=write_offsets[:n])
            np.add(pos, 1, out=context_lens[:n])
            slots[:n] = 0 if lora_slots is None else lora_slots
        on_device = isinstance(input_ids, torch.Tensor)
        if not on_device and n:
            ids[:n] = np.asarray(input_ids, dtype=np.int64).reshape(n)
        end = self._head + size * cols
        self.inputs[:end].copy_(self._mirrors[turn][:end], non_blocking=True)
        if self._on_cuda:
            event = torch.cuda.Event()
            event.record()
            self._mirror_events[turn] = event
        if on_device and n:
            self.input_ids[:n].copy_(input_ids)

    def _fill_pages(self, turn: int, chunks, tables: np.ndarray, states: np.ndarray) -> None:
        """The block tables and state pages of mirror `turn`: rows of chunks, then padding rows. The mirror
        keeps what an earlier step wrote into it (a persistent batch: `_written`), so only rows whose pages
        differ from those are written (a decode step adds a page to a sequence every block_size tokens)."""
        size, cols = tables.shape
        n = len(chunks)
        written = self._written[turn]
        if written is None or written[0] != (size, cols):
            written = ((size, cols), [None] * size)  # another graph's layout: every row is unknown
            self._written[turn] = written
        rows = written[1]
        changed = []
        for i, c in enumerate(chunks):
            known = rows[i]
            table = c.block_table if len(c.block_table) <= cols else c.block_table[:cols]
            if known is None or known[0] != table or known[1] != c.state_pages:
                changed.append(i)
                rows[i] = (list(table), list(c.state_pages))
        if changed:
            k = len(changed)
            new_tables = np.full((k, cols), self.pad_page, dtype=np.int64)
            new_states = np.empty((k, states.shape[1]), dtype=np.int64)
            fill_page_rows([chunks[i] for i in changed], new_tables, new_states)
            tables[changed] = new_tables
            states[changed] = new_states
        pad = [i for i in range(n, size) if rows[i] is not _PAD_ROW]
        if pad:
            tables[pad] = self.pad_page
            states[pad] = self._pad_states_host
            for i in pad:
                rows[i] = _PAD_ROW

    def _batch(self, size: int, bucket: int) -> ForwardBatch:
        return ForwardBatch(
            pool=self.pool, positions=self.positions[:size], write_pages=self.write_pages[:size],
            write_offsets=self.write_offsets[:size], chunks=[], decode_rows=self.rows[:size],
            decode_block_tables=self._tables(size, bucket), decode_context_lens=self.context_lens[:size],
            decode_state_pages=self.state_pages[:size], decode_max_context=bucket, ops=self.ops,
        )

    def _capture(self, size: int, bucket: int) -> bool:
        """Warm up and record the forward of `size` padding rows; False (graphs off, with a warning) on failure."""
        self._fill([], [], size, bucket)
        self.pool.zero_state(self.pad_state_pages)
        batch = self._batch(size, bucket)
        ids, rows = self.input_ids[:size], self.rows[:size]
        lora = contextlib.nullcontext
        if self.lora is not None:
            from kimiserve.lora.serving import LoRARows

            lora = lambda: self.lora.active(LoRARows(self.lora_slots[:size]))  # noqa: E731
        try:
            forward = lambda: self.forward(ids, batch, rows)  # noqa: E731
            with lora():
                self.warm_up(forward)
                graph, logits = self.record(forward)
        except Exception as e:  # a capture failure must not take the engine down: run eagerly instead
            self.disabled = f"capturing batch {size}, context {bucket} failed: {type(e).__name__}: {e}"
            warnings.warn(f"CUDA graphs disabled, decode runs eagerly ({self.disabled})")
            return False
        self.graphs[(size, bucket)] = (graph, logits)
        return True
