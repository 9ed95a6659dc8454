"""Draft-model proposer: a kimiserve model with the target's vocabulary drafts K tokens greedily per
round, batched over the sequences, on its own page pool (its own attention pages and KDA state pages).

Per sequence the draft holds a block table, committed KDA state pages (the state after the sequence's
tokens [0, num_computed)) and work state pages. A round: one forward catches the draft up on the
sequence's tokens it has not seen (the first time the whole prompt, later the tokens the last round
kept: what the target accepted plus its own token) and drafts d_1 from the last row; then K - 1
one-token steps feed d_1..d_{K-1} on the work pages (a copy of the committed ones), so the committed
state never sees a draft and needs no rollback. Latents written for drafts are overwritten by the
next catch-up, which starts at the committed position. When the K - 1 steps ran as one graph
(`draft_graphs.DraftLoopGraphs`), it also kept the state after each of them in the sequence's saved
state pages, so the next catch-up starts from the state after the drafts the target accepted (a page
copy) and feeds only what follows them (mostly the target's own token: a decode step, not a chunk of
up to K + 1 tokens). Drafts are greedy (argmax within the
request's allowed_token_ids), i.e. one-hot draft distributions, which `verify.accept_drafts` is exact for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kimiserve.cache.allocator import PageAllocator
from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import resolve_model
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.engine import worker
from kimiserve.engine.runner import ModelRunner, StepChunk, StepInput, to_device
from kimiserve.engine.sampler import Sampler
from kimiserve.engine.spec_decode.device_drafts import DeviceDrafts, DraftRow
from kimiserve.model.loader import load_model


@dataclass(eq=False)
class DraftSequence:
    block_table: list[int] = field(default_factory=list)
    state_pages: list[int] = field(default_factory=list)
    work_pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    drafts: "list[int] | DraftRow" = field(default_factory=list)
    """The latest round's drafts (after num_computed tokens): reused when no token came since."""
    saved_pages: list[list[int]] = field(default_factory=list)
    """State pages per drafting-loop step s: the state after drafts d_1..d_{s+1} (loop graphs only)."""
    num_saved: int = 0
    """How many of saved_pages hold the state after the latest round's drafts (0: none)."""

    @property
    def pages(self) -> list[int]:
        return self.block_table + self.state_pages + self.work_pages + [p for s in self.saved_pages for p in s]

    def restore_accepted(self, tokens: list[int]) -> list[tuple[int, int]]:
        """Before a catch-up on `tokens` (the sequence's tokens after num_computed): start past the leading
        ones the drafting loop already fed (its drafts, whose state it saved), leaving at least one token
        to feed; returns the page copies that make that saved state the committed one."""
        if not self.num_saved:
            return []
        fed = self.drafts.values() if isinstance(self.drafts, DraftRow) else self.drafts
        m = 0
        while m < min(self.num_saved, len(tokens) - 1) and tokens[m] == fed[m]:
            m += 1
        self.num_saved = 0
        if not m:
            return []
        self.num_computed += m
        return list(zip(self.saved_pages[m - 1], self.state_pages))


class DraftModelProposer:
    def __init__(self, config, engine):
        args = engine.args
        self.k = config.num_speculative_tokens
        draft_config = resolve_model(config.model)
        if draft_config.vocab_size != engine.config.vocab_size:
            raise ValueError(f"the draft model {config.model!r} has {draft_config.vocab_size} token ids, the target "
                             f"{engine.config.vocab_size}: a draft model needs the target's tokenizer and vocabulary")
        if draft_config.max_position_embeddings < engine.max_model_len:
            raise ValueError(f"the draft model {config.model!r} has a context of {draft_config.max_position_embeddings} "
                             f"tokens, less than max_model_len={engine.max_model_len}: lower max_model_len")
        device, dtype = engine.device, engine.dtype
        seed = args.seed if config.draft_seed is None else config.draft_seed
        self.model = load_model(config.model, dtype, seed, device, ParallelContext.single(device))
        self.layout = CacheLayout.from_config(self.model.cache_config, args.resolved_kv_cache_dtype(device), dtype, None,
                                              args.index_key_rotation)
        self.num_state = len(draft_config.kda_layers)
        bs = self.layout.block_size
        num_pages = config.draft_num_pages or math.ceil(engine.allocator.num_pages * engine.block_size / bs)
        use_graphs = worker.uses_cuda_graphs(torch.device(device), args)
        reserved = 1 + self.num_state if use_graphs else 0  # the graphs' padding pages, past the allocator's
        self.pool = PagePool(self.layout, num_pages + reserved, device)
        self.allocator = PageAllocator(num_pages, bs, self.num_state, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, self.pool, Sampler(args.seed), engine.eos_token_id)
        self.loop_graphs = None
        """`draft_graphs.DraftLoopGraphs` (CUDA graphs, K > 1): drafts d_2..d_K in one graph, or None."""
        if use_graphs:  # the drafting steps as decode graphs, the catch-up chunks as verify graphs
            from kimiserve.engine.cuda_graphs import DecodeGraphs
            from kimiserve.engine.spec_decode.verify_graphs import VerifyGraphs

            pad_states = torch.arange(num_pages + 1, num_pages + reserved, dtype=torch.int64)
            graph_args = (self.model, self.pool, self.runner.ops, args.max_num_seqs, engine.max_model_len, num_pages,
                          pad_states)
            self.runner.graphs = DecodeGraphs(*graph_args)
            self.runner.verify_graphs = VerifyGraphs(*graph_args, self.k + 1)
            if self.k > 1:
                from kimiserve.engine.spec_decode.draft_graphs import DraftLoopGraphs

                self.loop_graphs = DraftLoopGraphs(*graph_args, self.k - 1)
        self.runner.plan_verify_slots(self.k + 1, args.max_num_seqs)
        self.sequences: dict[object, DraftSequence] = {}
        self.num_forwards = 0

    def release(self, request) -> None:
        seq = self.sequences.pop(request, None)
        if seq is not None:
            self.allocator.decref(seq.pages)

    def check_idle(self) -> None:
        if self.sequences:
            raise RuntimeError(f"the draft model still holds {len(self.sequences)} sequence(s)")
        self.allocator.check_idle()

    def _reserve(self, request, k: int) -> DraftSequence | None:
        """The request's draft sequence with pages for its tokens plus k - 1 drafts; None if the pool is short."""
        seq = self.sequences.get(request)
        fresh = seq is None
        seq = seq or DraftSequence()
        end = request.num_tokens + k - 1
        blocks = -(-end // self.allocator.block_size) - len(seq.block_table)
        sets = 2 + (self.loop_graphs.steps if self.loop_graphs is not None else 0)  # committed, work, saved
        need = max(0, blocks) + (sets * self.num_state if fresh else 0)
        if not self.allocator.can_allocate(need):
            return None
        pages = self.allocator.allocate(need)
        if fresh:
            ns = self.num_state
            seq.state_pages, seq.work_pages = pages[:ns], pages[ns : 2 * ns]
            seq.saved_pages = [pages[i * ns : (i + 1) * ns] for i in range(2, sets)]
            pages = pages[sets * ns :]
            self.sequences[request] = seq
        seq.block_table += pages
        return seq

    def _loop_k(self, request, k: int) -> int:
        """The drafts to make room for: K when the drafting loop graph may run K steps for a request allowed k
        (its max_tokens limits it, not max_model_len: the positions past its drafts are inside the block table
        and the extra drafts are dropped), else k."""
        if self.loop_graphs is None or request.num_tokens + self.k - 1 > self.loop_graphs.max_model_len:
            return k
        return self.k

    def _pick(self, logits: torch.Tensor, requests: list) -> list[int]:
        """Greedy drafts: the argmax within each request's allowed_token_ids (one host transfer)."""
        return self._argmax(logits, requests).tolist()

    @staticmethod
    def _argmax(logits: torch.Tensor, requests: list) -> torch.Tensor:
        """Greedy drafts on the device: the argmax within each request's allowed_token_ids."""
        masked = [i for i, r in enumerate(requests) if r.params.allowed_token_ids]
        if masked:
            logits = logits.clone()
            for i in masked:
                keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                keep[torch.tensor(requests[i].params.allowed_token_ids, device=logits.device)] = True
                logits[i].masked_fill_(~keep, float("-inf"))
        return torch.argmax(logits, dim=-1)

    @torch.inference_mode()
    def propose(self, requests: list, limits: list[int], on_device: bool = False) -> list:
        """Up to limits[i] drafts per request: a list of ids, or (on_device, when the drafting loop ran as one
        graph) a `DraftRow` of drafts left on the device, their copy to the host queued."""
        drafts = [[] for _ in requests]
        active = []  # (index, request, seq, k)
        for i, (r, limit) in enumerate(zip(requests, limits)):
            k = min(self.k, limit)
            seq = self.sequences.get(r)
            if k > 0 and seq is not None and seq.num_computed == r.num_tokens:
                # not verified last step (the budget): nothing new to see
                drafts[i] = (seq.drafts.values() if isinstance(seq.drafts, DraftRow) else seq.drafts)[:k]
            elif k > 0 and (seq := self._reserve(r, self._loop_k(r, k))) is not None:
                active.append((i, r, seq, k))
        if not active:
            return drafts
        # catch up on the tokens the draft has not seen; d_1 from each chunk's last row. A catch-up of
        # 2..K + 1 tokens (the last round's kept ones) runs as a verify chunk keeping all its tokens, so
        # it takes a verify graph (every row's logits computed) and leaves a decode step's KDA state
        ids, chunks, rows, last, fresh, restores, row = [], [], [], [], [], [], 0
        for _, r, seq, _ in active:
            restores += seq.restore_accepted(r.all_ids[seq.num_computed : r.num_tokens])
            new = r.all_ids[seq.num_computed : r.num_tokens]
            if seq.num_computed == 0:
                fresh += seq.state_pages
            verify = seq.num_computed > 0 and 1 < len(new) <= self.k + 1
            chunks.append(StepChunk(row, row + len(new), seq.num_computed, list(seq.block_table), list(seq.state_pages),
                                    verify=verify))
            rows += range(row, row + len(new)) if verify or len(new) == 1 else [row + len(new) - 1]
            ids += new
            row += len(new)
            last.append(len(rows) - 1)
            seq.num_computed = r.num_tokens
        logits = self.runner.forward(StepInput(ids, chunks, rows, restores, fresh))
        self.runner.commit_verified({j: c.end - c.start for j, c in enumerate(chunks) if c.verify})
        self.num_forwards += 1
        first = self._argmax(logits[to_device(last, logits.device)], [a[1] for a in active])
        # the other drafts on the work pages (a copy of the committed state): in one graph when every
        # sequence can draft K tokens (those allowed fewer keep their first k) without token masks, else one
        # step at a time
        rest = None
        if self.loop_graphs is not None and all(self._loop_k(r, k) == self.k for _, r, _, k in active) and not any(
                r.params.allowed_token_ids for _, r, _, _ in active):
            copies = [(s, w) for _, _, seq, _ in active for s, w in zip(seq.state_pages, seq.work_pages)]
            self.pool.copy_pages([s for s, _ in copies], [d for _, d in copies])
            rest = self.loop_graphs.run(first, [seq.num_computed for _, _, seq, _ in active],
                                        [seq.block_table for _, _, seq, _ in active],
                                        [seq.work_pages for _, _, seq, _ in active],
                                        [seq.saved_pages for _, _, seq, _ in active])
            for _, _, seq, k in active if rest is not None else ():
                seq.num_saved = min(self.k - 1, k)  # the states after drafts this round shows
        copies = [(s, w) for _, _, seq, k in active if k > 1 for s, w in zip(seq.state_pages, seq.work_pages)]
        if rest is not None and on_device:
            self.num_forwards += self.k - 1
            source = DeviceDrafts.of(torch.cat([first[:, None], rest], dim=1))
            for row, (i, _, _, k) in enumerate(active):
                drafts[i] = DraftRow(source, row, k)
        elif rest is not None:
            self.num_forwards += self.k - 1
            for (i, _, _, k), tokens in zip(active, torch.cat([first[:, None], rest], dim=1).tolist()):
                drafts[i] += tokens[:k]
        else:
            for (i, *_), token in zip(active, first.tolist()):
                drafts[i].append(token)
        for step in range(1, max(k for *_, k in active) if rest is None else 1):
            going = [a for a in active if a[3] > step]
            chunks = [StepChunk(j, j + 1, seq.num_computed + step - 1, list(seq.block_table), list(seq.work_pages))
                      for j, (_, _, seq, _) in enumerate(going)]
            logits = self.runner.forward(StepInput([drafts[i][-1] for i, *_ in going], chunks, list(range(len(going))),
                                                   copies if step == 1 else []))
            self.num_forwards += 1
            for (i, *_), token in zip(going, self._pick(logits, [a[1] for a in going])):
                drafts[i].append(token)
        for i, _, seq, _ in active:
            seq.drafts = drafts[i] if isinstance(drafts[i], DraftRow) else list(drafts[i])
        return drafts
