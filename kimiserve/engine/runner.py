"""Model runner: a scheduled step in, sampled token ids (and logprobs) out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kimiserve.cache.pool import PagePool
from kimiserve.engine.cuda_graphs import fill_page_rows
from kimiserve.engine.errors import is_fatal_error
from kimiserve.engine.request import sample_seed
from kimiserve.engine.sampler import SampleRequest, Sampler, TokenLogprobs, prompt_logprobs_chunk
from kimiserve.engine.scheduler import SchedulerOutput
from kimiserve.engine.spec_decode.device_drafts import write_drafts
from kimiserve.model.batch import ForwardBatch, SequenceChunk
from kimiserve.model.expert_layout import apply_moe_layout
from kimiserve.model.model import KimiForCausalLM
from kimiserve.ops.backend import DecodeOps, select_decode_ops
from kimiserve.ops.moe.dispatch import fused_moe_for
from kimiserve.utils.host_copy import queue_device_copy, queue_host_copy


MIN_PCP_TOKENS_PER_RANK = 2
"""Fewest prompt tokens per PCP rank for a chunk to run token-sharded (shorter ones run whole)."""


@dataclass
class ChunkResult:
    samples: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    """One (token, logprobs) per sample drawn: none for a prefill chunk that does not finish the
    sequence, one for a decode, `params.n` for a first sample that forks the request."""
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    error: BaseException | None = None
    """Set when sampling this chunk's rows raised (the other chunks of the step are unaffected)."""


@dataclass
class StepChunk:
    """One sequence's new tokens in a step, as plain data (sent to every rank)."""

    start: int
    end: int
    context_start: int
    block_table: list[int]
    state_pages: list[int]
    snapshot_state_pages: list[int] | None = None
    verify: bool = False
    """A speculative verify chunk (`SequenceChunk.verify`)."""
    lora_id: int = 0
    """The LoRA adapter its rows run with (the engine's id; 0: the base model)."""

    def to_sequence_chunk(self) -> SequenceChunk:
        snapshot = None if self.snapshot_state_pages is None else torch.tensor(self.snapshot_state_pages)
        return SequenceChunk(self.start, self.end, self.context_start, torch.tensor(self.block_table),
                             torch.tensor(self.state_pages), snapshot, self.verify)


@dataclass
class StepInput:
    """Everything a rank needs to run one step's forward: the packed token ids, each sequence's chunk
    and pages, the logits rows wanted, the page copies and fresh state pages to apply first."""

    token_ids: list[int] | torch.Tensor
    """Host ids, or (async scheduling, one rank) an int64 device tensor: the tokens the step before
    sampled, not yet seen by the host."""
    chunks: list[StepChunk]
    logit_rows: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)
    fresh_state_pages: list[int] = field(default_factory=list)
    device_drafts: tuple | None = None
    """Drafts on the device written over the placeholders of `token_ids` (`device_drafts.write_drafts`):
    (a round's draft tokens flattened, [(chunk index, index of its first draft, count)]), or None."""


@dataclass
class LaunchedStep:
    """A decode-only step whose forward and sampling are queued on the device (async scheduling):
    `tokens` [n] on the device, one per chunk, and their copy to the host, in flight."""

    tokens: torch.Tensor
    host: torch.Tensor
    copied: "torch.cuda.Event | None" = None

    def results(self) -> list[int]:
        """Wait for the tokens (this step's work only, not the steps queued after it): one per chunk."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, pool: PagePool, sampler: Sampler, eos_token_id: int | None,
                 batch_invariant: bool = False):
        self.model, self.pool, self.sampler = model, pool, sampler
        self.invariant = None
        """The batch-invariant forward (`kimiserve.rl.forward.InvariantForward`) in that mode, else None."""
        if batch_invariant:
            from kimiserve.rl.forward import InvariantForward

            self.invariant = InvariantForward(model)
        self.lora = None
        """The engine's `kimiserve.lora.registry.LoRARegistry` when it serves adapters."""
        self.device = next(model.parameters()).device
        self.graphs = None
        """DecodeGraphs replaying decode-only steps (CUDA), or None: every step runs eagerly."""
        self.verify_graphs = None
        """`spec_decode.verify_graphs.VerifyGraphs` replaying verify steps (CUDA, speculation on), or None."""
        self.verify_slots = None
        """`spec_decode.verify_slots.KDAVerifySlots` (speculation on, `plan_verify_slots`): where verify steps save
        the KDA states after each position when `ops.kda_verify_steps` is set (allocated on first use)."""
        self.ops = select_decode_ops(self.device)
        self.eos_token_id = eos_token_id
        self._plain_rows: tuple[int, list[SampleRequest]] | None = None
        """(pending, rows) of the latest `plain_sample_requests` that found every row plain (a persistent
        batch's sampling rows: the next step of the same requests reuses them)."""
        self.verified: tuple | None = None
        """(ForwardBatch, step chunk indices of its verify chunks) of the latest step with verify chunks,
        until `commit_verified` replays the accepted tokens into the KDA state pages; (None, each step
        chunk's verify flag) when that step ran as a verify graph."""
        parallel = getattr(model, "parallel", None)
        self.parallel = parallel
        self.dcp = None
        """The DCP group when the sequences' tokens are split over ranks (`ForwardBatch.dcp`)."""
        if parallel is not None and parallel.dcp_size > 1:
            from kimiserve.distributed.dcp import DcpGroup

            self.dcp = DcpGroup.of(parallel)

    @property
    def ops(self) -> DecodeOps:
        """The step's ops (`ops.backend`). Setting them also re-lays the MXFP4 routed experts' codes as
        `ops.moe_layout` says where this device runs the fused MoE kernel (else the checkpoint layout), and
        hands them to the decode and verify graph sets, whose graphs capture again with them."""
        return self._ops

    @ops.setter
    def ops(self, ops: DecodeOps) -> None:
        self._ops = ops
        layout = ops.moe_layout if fused_moe_for(self.device.type) is not None else "checkpoint"
        apply_moe_layout(self.model, layout)
        for graph_set in (getattr(self, "graphs", None), getattr(self, "verify_graphs", None)):
            if graph_set is not None:
                graph_set.release()
                graph_set.ops = ops

    def plan_verify_slots(self, num_tokens: int, max_num_seqs: int) -> None:
        """Speculative verify steps of up to `num_tokens` positions: per-position KDA state slots for as many
        chunks as the largest verify graph runs (within `verify_slots.MAX_SLOT_BYTES`), shared with the verify
        graphs; used only while `ops.kda_verify_steps` is set."""
        from kimiserve.engine.spec_decode.verify import kda_layers
        from kimiserve.engine.spec_decode.verify_slots import KDAVerifySlots, max_verify_chunks

        layers = len(kda_layers(self.model))
        if layers and self.pool.recurrent is not None:
            self.verify_slots = KDAVerifySlots(self.pool, layers, num_tokens, max_verify_chunks(max_num_seqs, num_tokens))
            if self.verify_graphs is not None:
                self.verify_graphs.slots = self.verify_slots

    def forget_graphs(self) -> None:
        """Drop the captured decode and verify graphs (they capture again on next use): after a change
        they did not capture (the routed experts' code layout)."""
        for graph_set in (self.graphs, self.verify_graphs):
            if graph_set is not None:
                graph_set.release()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[ChunkResult]:
        """One step on this process alone: `prepare`, `forward`, `sample`."""
        step, plans = self.prepare(sched)
        return self.sample(sched, plans, self.forward(step))

    def prepare(self, sched: SchedulerOutput) -> tuple["StepInput", list[tuple]]:
        """What every rank needs to run the step's forward (plain data), and the driver's plan of which
        logits rows are prompt logprobs and samples (per chunk: first row, first prompt position,
        prompt rows, samples?)."""
        ids, chunks, logit_rows, row = [], [], [], 0
        plans, on_device, source = [], [], None
        for j, chunk in enumerate(sched.chunks):
            r, n = chunk.request, chunk.num_tokens
            start = r.num_computed
            drafts = chunk.draft_token_ids
            if chunk.draft_row is not None:
                if source is None or chunk.draft_row.source is source:
                    source = chunk.draft_row.source
                    on_device.append((j, chunk.draft_row.row * source.tokens.shape[1], len(drafts)))
                else:  # drafts of another round (not met in practice): their values, from the host
                    drafts = chunk.draft_row.values()[: len(drafts)]
            ids.extend(r.token_slice(start, start + n - len(drafts)) + drafts)
            snapshot = list(chunk.snapshot_state_pages) if n > 1 and chunk.snapshot_state_pages else None
            chunks.append(StepChunk(row, row + n, start, list(r.block_table), list(r.state_pages), snapshot,
                                    bool(drafts), r.lora_id))
            first = len(logit_rows)
            if drafts:  # every row is sampled: row i as if drafts[:i] had been generated
                logit_rows.extend(range(row, row + n))
                plans.append((first, start, 0, True))
                row += n
                continue
            # prompt logprobs: the row at position p predicts prompt token p + 1; entry 0 is None, so
            # positions below len(r.prompt_logprobs) - 1 were reported before (e.g. before a preemption)
            lo, n_prompt = max(start, len(r.prompt_logprobs) - 1), 0
            if r.params.prompt_logprobs is not None:
                n_prompt = max(0, min(start + n, len(r.prompt_ids) - 1) - lo)
                logit_rows.extend(range(row + lo - start, row + lo - start + n_prompt))
            samples = start + n == r.num_tokens
            if samples:
                logit_rows.append(row + n - 1)
            plans.append((first, lo, n_prompt, samples))
            row += n
        step = StepInput(ids, chunks, logit_rows, [pair for c in sched.chunks for pair in c.copies],
                         [p for c in sched.chunks for p in c.fresh_state_pages],
                         (source.tokens.view(-1), on_device) if on_device else None)
        return step, plans

    def plain_sample_requests(self, requests: list, pending: int) -> list[SampleRequest] | None:
        """The sampler's rows of a decode-only step of `requests` (one sample each, `pending` tokens not
        yet appended to their outputs), if every row is plain (`SampleRequest.is_plain`) and the sampler
        can sample them on the device (`Sampler.sample_plain`); else None."""
        if not hasattr(self.sampler, "sample_plain"):
            return None
        cached = self._plain_rows
        if cached is not None and cached[0] == pending and len(cached[1]) == len(requests):
            # the same requests as the latest call: their rows hold the same values (a plain row stays
            # plain as its output grows), unless a thinking budget could force a token now
            for row, r in zip(cached[1], requests):
                if row.output_ids is not r.output_ids or row.params is not r.params or r.thinking is not None:
                    break
            else:
                return cached[1]
        rows = []
        for r in requests:
            row = SampleRequest(r.params, r.prompt_ids, r.output_ids, r.seed, self.eos_token_id, r.grammar,
                                r.forced_token_id, pending)
            if not row.is_plain or (r.params.prompt_logprobs is not None and not r.prompt_logprobs):
                return None
            rows.append(row)
        self._plain_rows = (pending, rows)
        return rows

    def prepare_ahead(self, sched: SchedulerOutput, tokens: torch.Tensor) -> "StepInput":
        """The StepInput of a decode-only step scheduled while the step before it runs (`Scheduler.reserve_ahead`):
        each chunk's request feeds the token that step samples for it, `tokens[i]` on the device, at
        position num_computed + 1."""
        # the requests' own page lists (not copies): `launch` reads them before anything changes them
        chunks = [StepChunk(i, i + 1, c.request.num_computed + 1, c.request.block_table, c.request.state_pages,
                            None, False, c.request.lora_id) for i, c in enumerate(sched.chunks)]
        return StepInput(tokens, chunks, list(range(len(chunks))), [pair for c in sched.chunks for pair in c.copies],
                         [p for c in sched.chunks for p in c.fresh_state_pages])

    @torch.inference_mode()
    def launch(self, step: "StepInput", rows: list[SampleRequest]) -> LaunchedStep:
        """Queue a decode-only step's forward and sampling (rows from `plain_sample_requests`) on the device
        and the copy of its tokens to the host; returns without waiting for any of them."""
        tokens = self.sampler.sample_plain(self.forward(step), rows, checked=True)
        if tokens is None:
            raise RuntimeError("launch() needs plain rows (plain_sample_requests)")
        return LaunchedStep(tokens, *queue_host_copy(tokens))

    @torch.inference_mode()
    def forward(self, step: "StepInput") -> torch.Tensor:
        """This rank's part of the step: page copies, fresh state, the model's forward through the pool
        (a CUDA graph for a decode-only step when one can run it). Returns the logits rows [M, vocab]."""
        self.verified = None
        if step.copies:
            self.pool.copy_pages([s for s, _ in step.copies], [d for _, d in step.copies])
        if step.fresh_state_pages:
            self.pool.zero_state(to_device(step.fresh_state_pages, self.device))
        if self._token_sharded(step):
            return self._forward_token_sharded(step)
        n = len(step.chunks)
        every_row = step.logit_rows == list(range(len(step.token_ids)))
        serving = self.lora.serving if self.lora is not None else None
        # batch-invariant LoRA rows run eagerly (their adapters' stacked weights are made per step)
        invariant_lora = self.invariant is not None and any(c.lora_id for c in step.chunks)
        if self.graphs is not None and every_row and len(step.token_ids) == n and not invariant_lora:
            slots = None if serving is None else self.lora.slot_list([c.lora_id for c in step.chunks])
            logits = self.graphs.run(step.token_ids, step.chunks, slots)  # one token per sequence, each sampled
            if logits is not None:
                return logits
        if serving is not None:
            rows = self.lora.rows([c.lora_id for c in step.chunks], [c.end - c.start for c in step.chunks], self.device)
            with serving.active(rows):
                return self._forward_eager(step, every_row)
        return self._forward_eager(step, every_row)

    def _forward_eager(self, step: "StepInput", every_row: bool) -> torch.Tensor:
        n = len(step.chunks)
        if every_row and len(step.token_ids) == n and self.dcp is None and not any(c.verify for c in step.chunks):
            batch = self._decode_batch(step.chunks)  # one token per sequence: no per-sequence tensors
            ids, rows = to_device(step.token_ids, self.device), to_device(step.logit_rows, self.device)
            if self.invariant is not None:
                return self.invariant.forward_batch(ids, batch, rows, self._lora_batch(step))
            return self.model.forward_batch(ids, batch, rows)
        if self.verify_graphs is not None and every_row:
            logits = self.verify_graphs.run(step.token_ids, step.chunks, step.device_drafts)
            if logits is not None:
                self.verified = (None, [c.verify for c in step.chunks])
                return logits
        seq_chunks = [c.to_sequence_chunk() for c in step.chunks]
        batch = ForwardBatch.build(self.pool, seq_chunks, self.device, self.ops, self.dcp)
        slots = self.verify_slots
        if (batch.verify_grid is not None and self.ops.kda_verify_steps is not None and slots is not None
                and slots.fits(*batch.verify_grid.shape)):
            batch.verify_slots = slots
        input_ids = to_device(step.token_ids, self.device)
        if step.device_drafts is not None:
            write_drafts(input_ids, step.device_drafts, lambda j: step.chunks[j].start)
        rows = to_device(step.logit_rows, self.device)
        if self.invariant is not None:
            return self.invariant.forward_batch(input_ids, batch, rows, self._lora_batch(step))
        logits = self.model.forward_batch(input_ids, batch, rows)
        if batch.verify_inputs is not None:
            self.verified = (batch, [j for j, c in enumerate(step.chunks) if c.verify])
        return logits

    def _lora_batch(self, step: "StepInput"):
        """The step's `LoRABatch` (each row's adapter), or None when no row runs one."""
        if self.lora is None:
            return None
        return self.lora.batch([c.lora_id for c in step.chunks for _ in range(c.end - c.start)], self.device)

    def _decode_batch(self, chunks: list[StepChunk]) -> ForwardBatch:
        """A decode-only step's batch (one token per chunk) from the chunks' page lists in one host buffer (one
        host-to-device copy); it lists no chunks: the layers read its decode_* rows only, as in a captured
        decode graph's batch."""
        n, bs = len(chunks), self.pool.block_size
        width = max(len(c.block_table) for c in chunks)
        num_state = len(chunks[0].state_pages)
        host = np.zeros((5 + num_state + width) * n, dtype=np.int64)
        positions, write_pages, write_offsets, context_lens, rows = host[: 5 * n].reshape(5, n)
        states = host[5 * n : (5 + num_state) * n].reshape(n, num_state)
        tables = host[(5 + num_state) * n :].reshape(n, width)
        positions[:] = np.fromiter((c.context_start for c in chunks), dtype=np.int64, count=n)
        fill_page_rows(chunks, tables, states)
        write_pages[:] = tables[np.arange(n), positions // bs]
        np.remainder(positions, bs, out=write_offsets)
        np.add(positions, 1, out=context_lens)
        rows[:] = np.arange(n)
        dev = to_device(torch.from_numpy(host), self.device)
        fields = dev[: 5 * n].view(5, n)
        return ForwardBatch(pool=self.pool, positions=fields[0], write_pages=fields[1], write_offsets=fields[2],
                            chunks=[], decode_rows=fields[4], decode_block_tables=dev[(5 + num_state) * n :].view(n, width),
                            decode_context_lens=fields[3], decode_state_pages=dev[5 * n : (5 + num_state) * n].view(n, num_state),
                            decode_max_context=int(context_lens.max()), ops=self.ops)

    @torch.inference_mode()
    def commit_verified(self, accepted: dict[int, int]) -> None:
        """After the latest step's verification: for each verify chunk (by its index in the step) whose
        sequence goes on, replay its first `accepted[j]` tokens (the pending token and the accepted
        drafts) into its KDA state pages; the other chunks' pages stay at their committed state. After
        a verify graph, whose decode chunks left their pages committed too, those keep their token."""
        if self.verified is None:
            return
        from kimiserve.engine.spec_decode.verify import replay_verified

        batch, order = self.verified
        self.verified = None
        if batch is None:
            self.verify_graphs.commit([accepted.get(j, 0) if verify else 1 for j, verify in enumerate(order)])
            return
        replay_verified(self.model, batch, order, accepted)

    def _token_sharded(self, step: "StepInput") -> bool:
        """Prefill context parallel: a step made of one prefill chunk of at least MIN_PCP_TOKENS_PER_RANK
        tokens per rank is split over the PCP ranks; any other step runs whole on every PCP rank."""
        p = self.parallel
        return (p is not None and p.pcp_size > 1 and len(step.chunks) == 1
                and step.chunks[0].end - step.chunks[0].start >= MIN_PCP_TOKENS_PER_RANK * p.pcp_size)

    def _forward_token_sharded(self, step: "StepInput") -> torch.Tensor:
        """This rank's contiguous share of the step's one prefill chunk; the layers exchange what
        crosses the shares (`ForwardBatch.pcp`) and every rank gets every logits row."""
        from kimiserve.distributed.prefill_cp import PrefillShard

        c = step.chunks[0]
        b0 = c.context_start
        shard = PrefillShard.from_context(self.parallel, b0, b0 + c.end - c.start)
        lo, hi = shard.start - b0, shard.end - b0
        snapshot = None if c.snapshot_state_pages is None else torch.tensor(c.snapshot_state_pages)
        local = SequenceChunk(0, hi - lo, shard.start, torch.tensor(c.block_table), torch.tensor(c.state_pages),
                              snapshot)
        batch = ForwardBatch.build(self.pool, [local], self.device, self.ops, self.dcp)
        batch.pcp = shard
        input_ids = torch.tensor(step.token_ids[lo:hi], device=self.device)
        return self.model.forward_batch(input_ids, batch, torch.tensor(step.logit_rows, device=self.device))

    def sample(self, sched: SchedulerOutput, plans: list[tuple], logits: torch.Tensor) -> list[ChunkResult]:
        """The driver's part: prompt logprobs and one token per sample, per chunk."""
        tokens = self._sample_plain_decodes(sched, plans, logits)
        if tokens is not None:
            return [ChunkResult([(t, None)]) for t in tokens]
        results, sample_rows, sample_reqs, owners = [], [], [], []
        for chunk, (first, lo, n_prompt, samples) in zip(sched.chunks, plans):
            r, res = chunk.request, ChunkResult()
            if r.params.prompt_logprobs is not None and not r.prompt_logprobs:
                res.prompt_logprobs.append(None)  # the first prompt token has no logprob
            if n_prompt:
                nxt = r.prompt_ids[lo + 1 : lo + 1 + n_prompt]
                res.prompt_logprobs += prompt_logprobs_chunk(logits[first : first + n_prompt], nxt, r.params.prompt_logprobs,
                                                             getattr(self.sampler, "log_softmax", torch.log_softmax))
            if chunk.draft_token_ids:
                for i, (grammar, forced) in enumerate(_draft_states(r, chunk.draft_token_ids)):
                    sample_rows.append(first + i)
                    sample_reqs.append(SampleRequest(r.params, r.prompt_ids, r.output_ids + chunk.draft_token_ids[:i],
                                                     r.seed, self.eos_token_id, grammar, forced))
                    owners.append(res)
            elif samples:
                fork = r.params.n if not r.output_ids and r.sample_index == 0 and r.params.n > 1 else 1
                for i in range(fork):
                    seed = r.seed if i == 0 else sample_seed(r.params.seed, i)
                    sample_rows.append(first + n_prompt)
                    sample_reqs.append(SampleRequest(r.params, r.prompt_ids, r.output_ids, seed, self.eos_token_id,
                                                     r.grammar, r.forced_token_id))
                    owners.append(res)
            results.append(res)
        if sample_rows:
            for res, sample in zip(owners, self._sample(logits, sample_rows, sample_reqs)):
                if isinstance(sample, BaseException):
                    res.error = res.error or sample
                else:
                    res.samples.append(sample)
        return results

    def _sample_plain_decodes(self, sched: SchedulerOutput, plans: list[tuple], logits: torch.Tensor) -> list[int] | None:
        """The tokens of a step of decodes only (logits row i: chunk i's one sample) whose rows are all plain, sampled
        on their `plain_sample_requests` rows (kept from the step before when the same requests ran it); else
        None, as when sampling raises: `sample` then builds each chunk's rows and attributes a failure to its row."""
        for chunk, (_, _, n_prompt, samples) in zip(sched.chunks, plans):
            if n_prompt or not samples or chunk.draft_token_ids or not chunk.request.output_ids:
                return None
        rows = self.plain_sample_requests([c.request for c in sched.chunks], 0)
        if rows is None:
            return None
        try:
            return self.sampler.sample_plain(logits, rows, checked=True).tolist()
        except Exception as exc:  # noqa: BLE001 - sampled again row by row, each failure attributed to its row
            if is_fatal_error(exc):
                raise
            return None

    def _sample(self, logits: torch.Tensor, rows: list[int], requests: list[SampleRequest]) -> list:
        """One (token, logprobs) per row, batched; if the batch raises, row by row, so a row that
        cannot be sampled gets its exception in place of a token and the others still sample."""
        try:
            picked = logits if rows == list(range(logits.shape[0])) else logits[to_device(rows, logits.device)]
            return self.sampler(picked, requests)
        except Exception as exc:  # noqa: BLE001 - attributed row by row below
            if is_fatal_error(exc):
                raise
            out = []
            for row, request in zip(rows, requests):
                try:
                    out += self.sampler(logits[row : row + 1], [request])
                except Exception as row_exc:  # noqa: BLE001 - this row's request fails alone
                    if is_fatal_error(row_exc):
                        raise
                    out.append(row_exc)
            return out


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 device tensor of a host list or tensor (through pinned memory on CUDA: the host does not
    wait), or a device tensor as it is."""
    return queue_device_copy(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64),
                             device)


def _draft_states(request, drafts: list[int]):
    """(grammar, forced token) of each verify row i: the request's grammar and thinking budget as they
    are after drafts[:i] (forks; the request's own advance with the tokens kept). A draft the grammar
    refuses can never be kept (the mask of the row before it excludes it), so the rows after it keep
    the state before it."""
    grammar = request.grammar.fork() if request.grammar is not None else None
    thinking = request.thinking.copy() if request.thinking is not None else None
    for i in range(len(drafts) + 1):
        if i:
            token = drafts[i - 1]
            if thinking is not None:
                thinking.advance(token)
            if grammar is not None and valid:
                try:
                    grammar.accept(token)
                except ValueError:
                    valid = False
        else:
            valid = True
        forced = thinking.forced_token_id if thinking is not None else None
        yield (grammar.fork() if grammar is not None and i < len(drafts) else grammar) if forced is None else None, forced
