"""One CUDA graph for a draft model's whole drafting loop: after the catch-up forward gives d_1, the
K - 1 one-token steps that feed d_1..d_{K-1} and take each next draft as the argmax of the step's
logits, on the device, with no host round trip between the steps (one graph per padded batch size
and context bucket, as `cuda_graphs.DecodeGraphs`).

The host fills, once per round: each sequence's first draft (a device-to-device copy), the position
of d_1, its block table and its work state pages. Inside the graph, step s writes position p + s,
attends up to it and advances the work pages in place; padding rows run on the reserved pages.
Greedy drafts only, without per-request token masks (rounds with allowed_token_ids run step by step).
After step s the work pages' state (after d_1..d_{s+1}) is copied to that step's save pages: the next
round starts from the state after the drafts the target accepted instead of feeding them again.
"""

from __future__ import annotations

import math
import warnings

import torch

from kimiserve.cache.pool import PagePool
from kimiserve.engine.cuda_graphs import GraphSet, capture_sizes
from kimiserve.model.batch import ForwardBatch
from kimiserve.model.moe import STATIC_MOE_TOKENS
from kimiserve.ops.backend import DecodeOps


class DraftLoopGraphs(GraphSet):
    """`steps` (K - 1) greedy one-token steps of `model` on `pool` per replay; pad pages as `DecodeGraphs`'."""

    def __init__(self, model, pool: PagePool, ops: DecodeOps, max_num_seqs: int, max_model_len: int,
                 pad_page: int, pad_state_pages: torch.Tensor, steps: int):
        self.model, self.pool, self.ops, self.steps = model, pool, ops, steps
        self.sizes = capture_sizes(max(1, min(max_num_seqs, STATIC_MOE_TOKENS)))
        self.max_batch, self.max_model_len = self.sizes[-1], max_model_len
        self.pad_page = pad_page
        dev = pool.data.device
        B, width = self.max_batch, math.ceil(max_model_len / pool.block_size)
        long = dict(dtype=torch.int64, device=dev)
        num_state = pad_state_pages.numel()
        self.first_tokens = torch.zeros(B, **long)
        # the per-round inputs live in one device buffer, filled by one host-to-device copy from a pinned
        # mirror (a pageable copy would make the host wait for the device): start positions, work state
        # pages, the pages that keep the state after each step, then the block tables [B, width]
        self._head = B * (1 + num_state * (1 + steps))
        self.inputs = torch.full((self._head + B * width,), pad_page, **long)
        self.start_positions = self.inputs[:B]
        self.state_pages = self.inputs[B : B * (1 + num_state)].view(B, num_state)
        self.save_pages = self.inputs[B * (1 + num_state) : self._head].view(B, steps, num_state)
        """Step s's state (after d_1..d_{s+1}) is copied to save_pages[:, s] (the next round starts from it)."""
        self.block_tables = self.inputs[self._head :].view(B, width)
        self.pad_state_pages = pad_state_pages.to(dev)
        self._pad_states_host = pad_state_pages.cpu().numpy()
        self._mirror = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._copied = None
        """CUDA event of the latest copy out of the mirror (the host waits on it before refilling)."""
        self.rows = torch.arange(B, **long)
        self.step_offsets = torch.arange(steps, **long)[:, None]
        self.graphs: dict[tuple[int, int], tuple] = {}
        """(size, bucket) -> (graph, its drafts [size, steps])."""
        self.memory_pool = None
        self.disabled: str | None = None
        self.replays = 0

    def run(self, first_tokens: torch.Tensor, starts: list[int], block_tables: list[list[int]],
            state_pages: list[list[int]], save_pages: list[list[list[int]]]) -> torch.Tensor | None:
        """Drafts d_2..d_K [n, steps] on the device after first_tokens (d_1, [n] on the device) at
        positions starts[j], on work state pages state_pages[j], the state after step s copied to
        save_pages[j][s]; or None when no graph can run them (the caller steps eagerly)."""
        n = len(starts)
        size = self.padded_size(n)
        if self.disabled or size is None or n == 0:
            return None
        bucket = self.context_bucket(max(starts) + self.steps)
        if (size, bucket) not in self.graphs and not self._capture(size, bucket):
            return None
        self._fill(starts, block_tables, state_pages, size, bucket, save_pages)
        self.first_tokens[:n].copy_(first_tokens)
        graph, drafts = self.graphs[(size, bucket)]
        graph.replay()
        self.replays += 1
        return drafts[:n]

    def _fill(self, starts, block_tables, state_pages, size: int, bucket: int, save_pages=()) -> None:
        n, cols, B = len(starts), math.ceil(bucket / self.pool.block_size), self.max_batch
        if self._copied is not None:
            self._copied.synchronize()  # the previous round's copy is done (at once, in practice)
        host = self._mirror.numpy()
        num_state = self._pad_states_host.size
        positions, states = host[:B], host[B : B * (1 + num_state)].reshape(B, -1)
        saves = host[B * (1 + num_state) : self._head].reshape(B, self.steps, num_state)
        tables = host[self._head :].reshape(B, -1)[:size]
        tables.fill(self.pad_page)
        for j, table in enumerate(block_tables):
            used = min(len(table), cols)
            tables[j, :used] = table[:used]
        positions[:n] = starts
        positions[n:size] = 0
        if n:
            states[:n] = state_pages
            saves[:n] = save_pages
        states[n:size] = self._pad_states_host
        saves[n:size] = self._pad_states_host
        end = self._head + size * tables.shape[1]
        self.inputs[:end].copy_(self._mirror[:end], non_blocking=True)
        if self.inputs.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.first_tokens[n:size].zero_()

    def _loop(self, size: int, bucket: int) -> torch.Tensor:
        """The graph's body: the steps, each next token the argmax of the last (smallest id among ties)."""
        bs, cols = self.pool.block_size, math.ceil(bucket / self.pool.block_size)
        tables, rows = self.block_tables[:size], self.rows[:size]
        token, drafts = self.first_tokens[:size], []
        # every step's positions, pages, offsets and context lengths at once ([steps, size], a step's row contiguous)
        positions = self.start_positions[:size][None, :] + self.step_offsets
        pages = tables.gather(1, (positions // bs).clamp(max=cols - 1).T).T.contiguous()
        offsets, context_lens = positions % bs, positions + 1
        for s in range(self.steps):
            batch = ForwardBatch(pool=self.pool, positions=positions[s], write_pages=pages[s],
                                 write_offsets=offsets[s], chunks=[], decode_rows=rows,
                                 decode_block_tables=tables, decode_context_lens=context_lens[s],
                                 decode_state_pages=self.state_pages[:size], decode_max_context=bucket, ops=self.ops)
            token = torch.argmax(self.model.forward_batch(token, batch, rows), dim=-1)
            drafts.append(token)
            work, save = self.state_pages[:size], self.save_pages[:size, s]
            for state in (self.pool.recurrent, self.pool.conv):
                if state is not None:
                    state[save] = state[work]
        return torch.stack(drafts, dim=1)

    def _capture(self, size: int, bucket: int) -> bool:
        """Warm up and record the loop on padding rows only; False (graphs off, with a warning) on failure."""
        self._fill([], [], [], size, bucket)
        self.pool.zero_state(self.pad_state_pages)
        try:
            self.warm_up(lambda: self._loop(size, bucket))
            self.first_tokens.zero_()
            graph, drafts = self.record(lambda: self._loop(size, bucket))
        except Exception as e:  # a capture failure must not take the engine down: step eagerly instead
            self.disabled = f"capturing the draft loop, batch {size}, context {bucket} failed: {type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph of the draft loop disabled, drafts run step by step ({self.disabled})")
            return False
        self.graphs[(size, bucket)] = (graph, drafts)
        return True
