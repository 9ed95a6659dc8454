"""CUDA graphs for speculative verify steps (fixed K): one graph per (padded batch size, context bucket)
for the verify forward, and one for the KDA replay that commits the accepted tokens after sampling.

A verify graph runs `size` sequences of T = K + 1 rows each, laid out as a grid: row j * T + t is
position t of sequence j. Every sequence of the step is a chunk of at most T tokens: a verify chunk
(the pending token plus up to K drafts) or a one-token decode chunk. Rows past a chunk's tokens, and
the sequences past the real batch, are padding: they write one reserved attention page, read the
reserved state pages (as `cuda_graphs.DecodeGraphs` pads), and their logits are dropped. MLA attends
each real row as a decode row over its sequence up to its own position; KDA runs position t of every
sequence through the decode step's op on copies of the state pages (`KimiDeltaAttention.verify_steps`),
so padding rows after a chunk's tokens only touch the copies.

Every sequence, decode chunks included, leaves its state pages at the committed state; `commit`
fills a device buffer with each sequence's tokens to keep (a decode chunk's one token, a verify
chunk's accepted ones) and replays the replay graph: per KDA layer and position t, the decode op on
the real pages of the sequences keeping token t and on the reserved pages for the others, so one
graph serves any acceptance pattern. With `DecodeOps.kda_verify_steps` (and slots for the graph's size), KDA
runs each layer's positions in one op that saves the states after every position (`verify_slots`), and the
replay graph is the copy of each sequence's slot after its last kept token into its pages (slot items and pages
worked out on the host, from the kept counts).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from kimiserve.cache.pool import PagePool
from kimiserve.engine.cuda_graphs import GraphSet, capture_sizes
from kimiserve.engine.spec_decode.device_drafts import write_drafts
from kimiserve.engine.spec_decode.verify import kda_layers
from kimiserve.model.batch import ForwardBatch
from kimiserve.model.moe import STATIC_MOE_TOKENS
from kimiserve.ops.backend import DecodeOps


class VerifyGraphs(GraphSet):
    """Captures and replays verify steps of `model` on `pool`, `num_tokens` (K + 1) rows per sequence;
    pad_page and pad_state_pages as for `DecodeGraphs` (they may be the same reserved pages)."""

    def __init__(self, model, pool: PagePool, ops: DecodeOps, max_num_seqs: int, max_model_len: int,
                 pad_page: int, pad_state_pages: torch.Tensor, num_tokens: int):
        self.model, self.pool, self.ops = model, pool, ops
        self.T = num_tokens
        self.sizes = capture_sizes(max(1, min(max_num_seqs, STATIC_MOE_TOKENS // num_tokens)))
        self.max_batch, self.max_model_len = self.sizes[-1], max_model_len
        self.pad_page = pad_page
        dev = pool.data.device
        B, R, width = self.max_batch, self.max_batch * num_tokens, math.ceil(max_model_len / pool.block_size)
        num_state = pad_state_pages.numel()
        long = dict(dtype=torch.int64, device=dev)
        # every input lives in one device buffer, filled by one host-to-device copy per step from a
        # pinned host mirror (as `DecodeGraphs`): the per-row fields at a stride of R rows, the state
        # pages, the real rows' grid indices (which logits rows to return), then the block tables of the
        # graph about to run, packed [size * T, its context bucket's pages] (each graph reads its own view)
        self._head = 6 * R + B * num_state
        self.inputs = torch.zeros(self._head + R * width, **long)
        fields = self.inputs[: 5 * R].view(5, R)
        self.input_ids, self.positions, self.write_pages, self.write_offsets, self.context_lens = fields
        self.state_pages = self.inputs[5 * R : 5 * R + B * num_state].view(B, num_state)
        self.logit_rows = self.inputs[5 * R + B * num_state : self._head]
        self.rows = torch.arange(R, **long)
        self.pad_state_pages = pad_state_pages.to(dev)
        self._pad_states_host = pad_state_pages.cpu().numpy()
        self._pad_fields = np.array([0, 0, pad_page, 0, 1], dtype=np.int64)[:, None]
        self._arange = np.arange(R, dtype=np.int64)
        pin = dev.type == "cuda"
        self._mirror = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=pin)
        self._kept_mirror = torch.zeros(B * (1 + num_state), dtype=torch.int64, pin_memory=pin)
        self._copied: list = [None, None]
        """CUDA events of the latest copies out of the two mirrors (the host waits on one before refilling it)."""
        self.kept = torch.zeros(B * (1 + num_state), **long)
        """The replay graph's input: the tokens each sequence keeps [size] (position by position), or with slots
        (`uses_slots`) the slot items to copy [size] and the state pages they go to, layer-major [layers, size]."""
        self.empty = torch.zeros(0, **long)
        self.graphs: dict[tuple[int, int], tuple] = {}
        """(size, bucket) -> (verify graph, its logits [size * T, vocab], replay graph)."""
        self.memory_pool = None
        self.disabled: str | None = None
        """Why graphs are off (a capture failed), else None."""
        self.pending: tuple[int, int, int] | None = None
        """(size, bucket, sequences) of the latest verify replay, until `commit`."""
        self.replays = 0
        self.slots = None
        """The runner's `verify_slots.KDAVerifySlots` (`ModelRunner.plan_verify_slots`), or None."""

    def uses_slots(self, size: int) -> bool:
        """Whether graphs of `size` sequences save per-position KDA states (`ops.kda_verify_steps`) and commit
        by copying them, rather than running position by position and replaying the kept ones."""
        return self.ops.kda_verify_steps is not None and self.slots is not None and self.slots.fits(size, self.T)

    def fits(self, chunks) -> bool:
        """Whether a step of these chunks (each sampled at every row) can run here: verify chunks and
        one-token chunks without prompt snapshots, at least one verify chunk, at most T tokens each.
        chunks: `SequenceChunk`s or the runner's `StepChunk`s (start, end, context_start, page lists)."""
        return (not self.disabled and any(c.verify for c in chunks) and self.padded_size(len(chunks)) is not None
                and all((c.verify or c.end - c.start == 1) and c.end - c.start <= self.T
                        and c.snapshot_state_pages is None for c in chunks))

    def run(self, input_ids: list[int], chunks, device_drafts=None) -> torch.Tensor | None:
        """Logits [N, vocab] of the step's packed rows (every row), or None when no graph can run it.
        device_drafts: drafts on the device over placeholders of input_ids (`StepInput.device_drafts`)."""
        if not self.fits(chunks):
            return None
        n = len(chunks)
        size = self.padded_size(n)
        bucket = self.context_bucket(max(c.context_start + c.end - c.start for c in chunks))
        if (size, bucket) not in self.graphs and not self._capture(size, bucket):
            return None
        rows = self._fill(input_ids, chunks, size, bucket)
        if device_drafts is not None:
            write_drafts(self.input_ids, device_drafts, lambda j: j * self.T)
        graph, logits, _ = self.graphs[(size, bucket)]
        graph.replay()
        self.replays += 1
        self.pending = (size, bucket, n)
        return logits[self.logit_rows[:rows]]

    def commit(self, kept: list[int]) -> None:
        """After the latest `run`: advance each sequence's state pages over its first kept[j] tokens
        (j: its chunk's index in the step; a one-token decode chunk keeps its token)."""
        if self.pending is None:
            return
        size, bucket, n = self.pending
        self.pending = None
        if not any(kept):
            return
        self._wait(1)
        host = self._kept_mirror.numpy()
        host[:n] = kept
        host[n:size] = 0
        end = size
        if self.uses_slots(size):  # which slot of each sequence goes to which pages, worked out here
            keeps = host[:size] > 0
            host[:size] = (np.maximum(host[:size], 1) - 1) * size + self._arange[:size]
            end = size * (1 + self._pad_states_host.size)
            pages = np.where(keeps[:, None], self._host_state_pages(size), self._pad_states_host[None, :])
            host[size:end].reshape(-1, size)[:] = pages.T
        self.kept[:end].copy_(self._kept_mirror[:end], non_blocking=True)
        self._record(1)
        self.graphs[(size, bucket)][2].replay()

    def _host_state_pages(self, size: int) -> np.ndarray:
        """The state pages [size, layers] the latest `_fill` wrote into the host mirror."""
        start, L = 5 * self.max_batch * self.T, self._pad_states_host.size
        return self._mirror.numpy()[start : start + size * L].reshape(size, L)

    def _wait(self, i: int) -> None:
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # its previous copy is done (at once, in practice)

    def _record(self, i: int) -> None:
        if self.inputs.device.type == "cuda":
            self._copied[i] = torch.cuda.Event()
            self._copied[i].record()

    def _tables(self, size: int, bucket: int) -> torch.Tensor:
        """The block tables [size * T, pages of the bucket] that graph (size, bucket) reads."""
        cols = math.ceil(bucket / self.pool.block_size)
        return self.inputs[self._head : self._head + size * self.T * cols].view(size * self.T, cols)

    def _fill(self, input_ids: list[int], chunks, size: int, bucket: int) -> int:
        """Grid rows from the chunks, padding rows on the reserved pages, one host-to-device copy;
        returns the number of real rows (their grid indices lead `logit_rows`)."""
        n, T, bs = len(chunks), self.T, self.pool.block_size
        cols = math.ceil(bucket / bs)
        R, RB = size * T, self.max_batch * T
        self._wait(0)
        host = self._mirror.numpy()
        fields = host[: 5 * RB].reshape(5, RB)[:, :R]
        fields[:] = self._pad_fields  # ids 0, position 0, the reserved page, offset 0, context 1
        ids, positions, write_pages, write_offsets, context_lens = fields
        states = host[5 * RB : 5 * RB + self.max_batch * self._pad_states_host.size].reshape(self.max_batch, -1)
        rows_out = host[5 * RB + states.size : self._head]
        tables = host[self._head : self._head + R * cols].reshape(size, T, cols)
        tables.fill(self.pad_page)
        real = 0
        for j, c in enumerate(chunks):  # chunk j's rows: grid rows j * T .. j * T + its tokens
            L, first, row = c.end - c.start, c.start, j * T
            table = c.block_table if len(c.block_table) <= cols else c.block_table[:cols]
            tables[j, :L, : len(table)] = table
            pos = self._arange[:L] + c.context_start
            ids[row : row + L] = input_ids[first : first + L]
            positions[row : row + L] = pos
            write_pages[row : row + L] = tables[j, 0, pos // bs]
            write_offsets[row : row + L] = pos % bs
            context_lens[row : row + L] = pos + 1
            rows_out[real : real + L] = self._arange[row : row + L]
            real += L
        if n:
            states[:n] = [c.state_pages for c in chunks]
        states[n:size] = self._pad_states_host
        end = self._head + R * cols
        self.inputs[:end].copy_(self._mirror[:end], non_blocking=True)
        self._record(0)
        return real

    def _batch(self, size: int, bucket: int) -> ForwardBatch:
        R = size * self.T
        return ForwardBatch(
            pool=self.pool, positions=self.positions[:R], write_pages=self.write_pages[:R],
            write_offsets=self.write_offsets[:R], chunks=[], decode_rows=self.empty,
            decode_block_tables=self.empty.view(0, 1), decode_context_lens=self.empty,
            decode_state_pages=self.state_pages[:0], decode_max_context=0, ops=self.ops,
            verify_rows=self.rows[:R], verify_block_tables=self._tables(size, bucket),
            verify_context_lens=self.context_lens[:R], verify_max_context=bucket, verify_inputs={},
            verify_grid=self.rows[:R].view(size, self.T), verify_active=[None] * self.T,
            verify_state_pages=self.state_pages[:size], verify_slots=self.slots if self.uses_slots(size) else None,
        )

    def _replay_kept(self, size: int, inputs: dict[int, tuple]) -> None:
        """The replay graph's body: position t of every sequence on its real state pages where it keeps
        token t, else on the reserved ones. (One where for every layer and position into an int32 [layers, T,
        size] tensor, 6e2b0ef, gave wrong tokens on the H200 in session 4 and was reverted; see BENCHMARKS.md.)"""
        pages, kept = self.state_pages[:size], self.kept[:size]
        for layer in kda_layers(self.model):
            i = layer.cache_index
            steps = [(slice(None), torch.where(kept > t, pages[:, i], self.pad_state_pages[i])) for t in range(self.T)]
            layer.replay_verified(self.pool, self.ops, inputs[i], steps)

    def _forwards(self, size: int, bucket: int):
        """(the verify forward, the replay) of this shape, as functions of no arguments on the static buffers."""
        batch = self._batch(size, bucket)
        ids, rows = self.input_ids[: size * self.T], self.rows[: size * self.T]
        if batch.verify_slots is not None:
            items, pages = self.kept[:size], self.kept[size : size * (1 + self.pad_state_pages.numel())].view(-1, size)
            commit = lambda: self.slots.commit(self.pool, items, pages)  # noqa: E731
        else:
            commit = lambda: self._replay_kept(size, batch.verify_inputs)  # noqa: E731
        return (lambda: self.model.forward_batch(ids, batch, rows)), commit

    def _padding_inputs(self, size: int, bucket: int) -> None:
        """The static inputs of a capture: padding rows only, nothing kept (so the replay writes the reserved
        pages alone: with slots, slot 0 of each sequence copied to them), the reserved state pages zeroed."""
        self._fill([], [], size, bucket)
        self.kept.zero_()
        if self.uses_slots(size):
            self.slots.allocate()  # before the capture: once
            L = self.pad_state_pages.numel()
            self.kept[size : size * (1 + L)].view(L, size).copy_(self.pad_state_pages[:, None].expand(L, size))
        self.pool.zero_state(self.pad_state_pages)

    def _capture(self, size: int, bucket: int) -> bool:
        """Warm up and record both graphs on `_padding_inputs`; False (graphs off, with a warning) on failure."""
        self._padding_inputs(size, bucket)
        forward, replay = self._forwards(size, bucket)
        try:
            self.warm_up(forward, replay)
            graph, logits = self.record(forward)
            replay_graph, _ = self.record(replay)
        except Exception as e:  # a capture failure must not take the engine down: run eagerly instead
            self.disabled = f"capturing verify batch {size}, context {bucket} failed: {type(e).__name__}: {e}"
            warnings.warn(f"CUDA graphs for verify steps disabled, they run eagerly ({self.disabled})")
            return False
        self.graphs[(size, bucket)] = (graph, logits, replay_graph)
        return True
