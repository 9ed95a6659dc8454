"""The engine: requests in, one step at a time (schedule, run, postprocess), outputs out."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import time
from dataclasses import dataclass, field

from kimiserve.cache.allocator import PageAllocator
from kimiserve.distributed.executor import make_executor
from kimiserve.engine.args import EngineArgs, tokenizer_source
from kimiserve.engine.detokenizer import IncrementalDetokenizer
from kimiserve.engine.errors import REQUEST_FAILED_MESSAGE, EngineFatalError, is_fatal_error
from kimiserve.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind, RequestTimes
from kimiserve.engine.request import Request, Status
from kimiserve.engine.runner import LaunchedStep, to_device
from kimiserve.engine.scheduler import Scheduler, SchedulerOutput
from kimiserve.engine.spec_decode import check_request, make_proposer
from kimiserve.engine.spec_decode.device_drafts import PLACEHOLDER, DraftRow
from kimiserve.engine.spec_decode.metrics import SpecDecodeStats
from kimiserve.engine.spec_decode.verify import accept_drafts
from kimiserve.engine.thinking import THINK_END, THINK_START, ThinkingBudget
from kimiserve.engine.worker import pages_needed
from kimiserve.sampling_params import SamplingParams
from kimiserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("kimiserve.engine")

MAX_CONSECUTIVE_ISOLATED_FAILURES = 3
"""This many steps in a row that each ran one request alone and failed: the engine itself is broken."""


@dataclass
class RequestGroup:
    """A request and its n samples (sample 0 runs the prompt; the others fork from it)."""

    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[Request] = field(default_factory=list)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    error: str | None = None
    """Set when the request failed inside the engine (its samples end with finish_reason "error")."""
    prompt_logprobs_sent: bool = False
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))

    @property
    def finished(self) -> bool:
        # an aborted group is dropped by abort_request and never reported again
        if self.error is not None:
            return True
        if len(self.samples) != self.params.n:
            return False
        for s in self.samples:  # (a loop, not all() over a generator: this runs per request per step)
            if s.status is not Status.FINISHED:
                return False
        return True


@dataclass
class Suspect:
    """A request of a step whose forward failed: it runs alone until it gets past that step."""

    request: Request
    target: int
    """The `num_computed` the failed step would have brought it to."""


@dataclass
class InFlightStep:
    """A launched decode-only step (async scheduling) whose tokens the host has not read yet."""

    sched: SchedulerOutput
    launched: LaunchedStep
    failed: list[str]
    """Requests failed before it was launched (their outputs go out with its results)."""


class _LaunchFailed(Exception):
    """Launching the step after an in-flight one raised (the cause); `sched` is the step's."""

    def __init__(self, sched):
        super().__init__("launching the following step failed")
        self.sched = sched


class LLMEngine:
    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype(self.device)
        self.config = args.model_config()
        source = tokenizer_source(args)
        if source is not None:
            from kimiserve.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(source)
        else:
            self.tokenizer = None
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model only "
                             f"{self.config.vocab_size}: give a matching --tokenizer")
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else self.config.eos_token_id
        self.max_model_len = args.max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} is longer than the model's context of "
                             f"{self.config.max_position_embeddings} tokens")
        args.parallel_config().check_model(self.config)  # before any rank starts: sizes that do not divide
        self.executor = make_executor(args, self.eos_token_id, self.config)
        driver = self.executor.driver  # rank 0's worker: its model shard, pool and runner (the sampler)
        self.layout = driver.layout
        num_state = len(self.config.kda_layers)
        num_pages = self.executor.agree_num_pages(driver.budget_pages())
        self.block_size = driver.block_size  # of the block tables (DCP: dcp pages of layout.block_size)
        needed = pages_needed(self.max_model_len, self.block_size, num_state)
        if num_pages < needed:
            self.executor.shutdown()
            raise ValueError(
                f"the cache has {num_pages} pages of {self.layout.page_bytes} bytes, but one sequence of "
                f"max_model_len={self.max_model_len} tokens needs {needed}: lower max_model_len or give more "
                f"cache (num_pages, kv_cache_memory_gib, gpu_memory_utilization)"
            )
        self.executor.init_cache(num_pages, self.max_model_len)
        self.model, self.pool, self.runner = driver.model, driver.pool, driver.runner
        self.allocator = PageAllocator(num_pages, self.block_size, num_state, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, num_state, args.max_num_seqs, args.max_num_batched_tokens,
                                   args.enable_prefix_caching)
        self.speculative_config = args.speculative()
        self.proposer = None
        """Drafts tokens for the running decodes after each step (speculative decoding), or None."""
        self.spec_stats = SpecDecodeStats(self.speculative_config.num_speculative_tokens
                                          if self.speculative_config else 0)
        if self.speculative_config is not None:
            self.proposer = make_proposer(self.speculative_config, self)
            self.scheduler.on_finish = self.proposer.release
        self.lora = None
        """The loaded LoRA adapters (`kimiserve.lora.registry.LoRARegistry`) when LoRA is enabled."""
        if args.enable_lora or args.lora_modules:
            from kimiserve.lora.registry import LoRARegistry

            self.lora = self.runner.lora = LoRARegistry(self.model, args.max_loras, args.max_lora_rank,
                                                        args.batch_invariant)
            if self.runner.graphs is not None:
                self.runner.graphs.lora = self.lora.serving
            for name, path in args.lora_module_paths().items():
                self.lora.load(name, path)
        self.groups: dict[str, RequestGroup] = {}
        self._arrivals = itertools.count()
        self._suspects: list[Suspect] = []
        self._isolated_failures = 0
        self.num_computed_tokens = 0
        self.num_steps = 0
        self.num_failed_requests = 0
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_id)
        """Guided decoding's grammar cache and compile thread (llguidance is imported on first use;
        `compile` may be called from other threads, e.g. the server's, to check a spec)."""
        self._compiling: list[Request] = []
        """Requests whose grammar is compiling (they wait in the scheduler until it is resolved)."""
        self.async_scheduling = args.resolved_async_scheduling(self.device) and self.executor.world_size == 1
        """Launch each plain decode step while the one before runs (`EngineArgs.async_scheduling`)."""
        self._in_flight: InFlightStep | None = None
        """The launched step whose tokens the next `step()` reads (async scheduling)."""
        self.num_overlapped_steps = 0
        """Steps launched while the step before them ran (async scheduling)."""

    # requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, lora_name: str | None = None) -> None:
        """Queue a request; every check runs before anything is allocated (ValueError on bad input).
        `output_kind`: whether its outputs hold everything so far, only what is new (DELTA), or come once, at
        the end (FINAL_ONLY).
        `lora_name`: a loaded LoRA adapter to run it with (None: the base model)."""
        lora_id = self._lora_id(lora_name)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {type(output_kind).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.args.model!r} has no tokenizer: give the prompt as token ids")
            text, prompt = prompt, self.tokenizer.encode(prompt)
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.config.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in 0..{self.config.vocab_size - 1}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, but max_model_len is {self.max_model_len}: the prompt plus at "
                f"least one generated token must fit (shorten the prompt or raise max_model_len)"
            )
        params.validate_vocab(self.config.vocab_size)
        params.update_from_tokenizer(self.tokenizer)  # bad_words -> token sequences
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none: use stop_token_ids")
        if params.n > self.args.max_num_seqs:
            raise ValueError(f"n={params.n} is more than max_num_seqs={self.args.max_num_seqs}")
        if self.proposer is not None:
            check_request(params)
        thinking = self._thinking_budget(prompt, params)
        grammar_future = None
        if params.structured_outputs is not None:
            grammar_future = self.structured_outputs.submit(params.structured_outputs)
        group = RequestGroup(text, prompt, params, output_kind=output_kind)
        self.groups[request_id] = group
        first = Request(request_id, prompt, params, next(self._arrivals), lora_id=lora_id, thinking=thinking,
                        grammar_future=grammar_future)
        if grammar_future is not None:
            self._compiling.append(first)
        self._attach_detokenizer(first)
        group.samples.append(first)
        self.scheduler.add(first)

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache snapshot (vLLM's reset_prefix_cache; call between steps); returns the
        pages that became free. Pages the running requests hold keep their references: they are untouched."""
        free = self.allocator.num_free
        self.allocator.evict_all()
        return self.allocator.num_free - free

    # LoRA adapters ------------------------------------------------------------------------------
    def _lora_id(self, name: str | None) -> int:
        if name is None:
            return 0
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r} asked for, but this engine serves none (enable_lora)")
        return self.lora.id_of(name)

    def lora_names(self) -> list[str]:
        """The loaded adapters' names (empty without LoRA)."""
        return [] if self.lora is None else self.lora.names()

    def load_lora_adapter(self, name: str, source) -> None:
        """Load an adapter (a PEFT folder, or a `kimiserve.lora.LoRAAdapter`, copied) under `name`."""
        if self.lora is None:
            raise ValueError("this engine does not serve LoRA adapters: start it with enable_lora (--enable-lora)")
        self.lora.load(name, source)

    def _lora_in_use(self, name: str) -> bool:
        lora_id = self.lora.id_of(name)
        return any(s.lora_id == lora_id and not s.finished for g in self.groups.values() for s in g.samples)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter no running request uses (ValueError otherwise)."""
        if self.lora is None:
            raise ValueError("this engine does not serve LoRA adapters")
        if self._lora_in_use(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by running requests: unload it when they finish")
        self.lora.unload(name)

    def update_lora_adapter(self, adapter) -> None:
        """New values for the loaded adapter of adapter.name (between requests: RL weight sync). It gets a new
        prefix-cache salt, so nothing computed with the old values is reused."""
        if self.lora is None:
            raise ValueError("this engine does not serve LoRA adapters")
        if self._lora_in_use(adapter.name):
            raise RuntimeError(f"LoRA adapter {adapter.name!r} is in use by running requests: update it between steps")
        self.lora.update(adapter)

    def _thinking_budget(self, prompt: list[int], params: SamplingParams) -> ThinkingBudget | None:
        if params.thinking_token_budget is None:
            return None
        ids = [self.tokenizer.token_to_id(t) if self.tokenizer is not None else None for t in (THINK_START, THINK_END)]
        if None in ids:
            raise ValueError(f"thinking_token_budget needs a tokenizer with {THINK_START} and {THINK_END} tokens; "
                             f"model {self.args.model!r} has none")
        return ThinkingBudget.for_prompt(prompt, ids[0], ids[1], params.thinking_token_budget)

    def _resolve_grammars(self) -> list[str]:
        """Requests whose grammar finished compiling get their matcher (and can be scheduled); one whose
        grammar failed fails alone. Returns the ids of the failed ones."""
        failed, still = [], []
        for request in self._compiling:
            future = request.grammar_future
            if request.finished or future is None:
                continue
            if not future.done():
                still.append(request)
                continue
            request.grammar_future = None
            exc = future.exception()
            if exc is None:
                try:
                    request.grammar = self.structured_outputs.new_grammar(request.params.structured_outputs,
                                                                          future.result(), request.prompt_ids)
                except Exception as new_exc:  # noqa: BLE001 - this request fails alone
                    exc = new_exc
            if exc is not None:
                message = str(exc) if isinstance(exc, ValueError) else "its grammar could not be built"
                self._fail(request.request_id, exc, message)
                failed.append(request.request_id)
        self._compiling = still
        return failed

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (between steps) and free its pages; unknown ids are ignored."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for sample in group.samples:
            if not sample.finished:
                self.scheduler.finish(sample, "abort")

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile (a step may then schedule nothing)."""
        return len(self._compiling)

    @property
    def step_in_flight(self) -> bool:
        """A launched step's tokens are still to be read: the next `step()` postprocesses them (async scheduling)."""
        return self._in_flight is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess; returns an output for each request that progressed (or failed).

        A step that raises does not end the engine (unless the error is fatal: `errors.is_fatal_error`).
        An error traced to one request (its sampling, detokenising, stop checks) fails that request
        alone. A forward that fails for a batch of several requests is undone: they free their pages
        and are recomputed later, each alone until it is past the failed step, so the request the
        error comes from fails alone and the others go on (their tokens unchanged: seeded sampling
        is batch-independent, and greedy decoding deterministic).
        """
        failed = []
        if self._in_flight is not None:
            if any(not c.request.finished for c in self._in_flight.sched.chunks):
                return self._finish_launched()
            failed, self._in_flight = self._in_flight.failed, None  # all its requests were aborted since
        failed += self._resolve_grammars() if self._compiling else []
        suspect = self._current_suspect()
        sched = self.scheduler.schedule(only=suspect.request if suspect else None)
        if not sched.chunks:
            if not failed and self._compiling:  # nothing to run until a grammar is ready: wait for one
                concurrent.futures.wait([r.grammar_future for r in self._compiling], timeout=0.05,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return [out for out in map(self._output, failed) if out is not None]
        scheduled_at = time.monotonic()
        for chunk in sched.chunks:
            group = self.groups.get(chunk.request.request_id)
            if group is not None and group.times.first_scheduled is None:
                group.times.first_scheduled = scheduled_at
        self.num_steps += 1
        try:
            rows = self._launchable(sched) if suspect is None else None
            if rows is not None:
                step, _ = self.runner.prepare(sched)
                self._in_flight = InFlightStep(sched, self.runner.launch(step, rows), failed)
                return self._finish_launched()
            results = self.executor.execute(sched)
        except Exception as exc:  # noqa: BLE001 - blamed on a request below, or fatal
            if is_fatal_error(exc):
                raise
            failed = self._after_failed_forward(sched, exc)
            return [out for out in map(self._output, failed) if out is not None]
        self._isolated_failures = 0
        touched = dict.fromkeys(failed)
        touched.update(self._postprocess(sched, results))
        self._propose()
        if suspect is not None and (suspect.request.finished or suspect.request.num_computed >= suspect.target):
            self._suspects.remove(suspect)
        return [out for out in map(self._output, touched) if out is not None]

    # async scheduling -------------------------------------------------------------------------
    def _launchable(self, sched) -> list | None:
        """The sampler rows of a step that may run launched (async scheduling: plain decodes only), else None."""
        if not self.async_scheduling or self.proposer is not None:
            return None
        if any(c.num_tokens != 1 or c.draft_token_ids or not c.request.is_decode for c in sched.chunks):
            return None
        return self.runner.plain_sample_requests([c.request for c in sched.chunks], 0)

    def _finish_launched(self) -> list[RequestOutput]:
        """The step of a launched step N: launch N + 1 (the same decodes, fed N's tokens from the device)
        when it may run, then wait for N's tokens and postprocess them while N + 1 runs. A request that
        ends at N has its row of N + 1 discarded (its pages, the one reserved for N + 1 included, are
        freed now; the device's writes to them come before any later step's)."""
        done, self._in_flight = self._in_flight, None
        for chunk in done.sched.chunks:
            chunk.request.fed_ahead = False
        following, failed_launch = None, None
        try:
            following = self._launch_following(done)
        except _LaunchFailed as exc:  # its requests are undone after this step's postprocess
            failed_launch = exc
        later = following.sched if following is not None else failed_launch.sched if failed_launch else None
        try:
            results = done.launched.results()
        except Exception as exc:  # noqa: BLE001 - as a failed forward of the synchronous step
            if is_fatal_error(exc):
                raise
            for chunk in later.chunks if later is not None else []:
                chunk.request.fed_ahead = False
            return [out for out in map(self._output, done.failed + self._after_failed_forward(done.sched, exc))
                    if out is not None]
        self._isolated_failures = 0
        touched = dict.fromkeys(done.failed)
        touched.update(self._postprocess_decodes(done.sched, results))
        if failed_launch is not None:
            alive = [c for c in later.chunks if not c.request.finished]
            for chunk in later.chunks:
                chunk.request.fed_ahead = False
            if alive:
                touched.update(dict.fromkeys(self._after_failed_forward(SchedulerOutput(alive),
                                                                        failed_launch.__cause__)))
        elif following is not None and any(not c.request.finished for c in following.sched.chunks):
            self._in_flight = following  # its rows of requests that ended now are skipped by its postprocess
        return [out for out in map(self._output, touched) if out is not None]

    def _postprocess_decodes(self, sched, tokens: list[int]) -> dict[str, None]:
        """`_postprocess` of a launched step: one token per chunk, each a plain decode (no prompt logprobs,
        drafts, prompt snapshot or sampling error), so only its decode branch."""
        touched: dict[str, None] = {}
        for chunk, token in zip(sched.chunks, tokens):
            request = chunk.request
            if request.finished:  # ended since the launch (aborted, or another sample of its request failed)
                self.scheduler.drop_prompt_snapshot(chunk)
                continue
            request.num_computed += 1
            self.num_computed_tokens += 1
            self._append_or_fail(request, token, None)
            touched[request.request_id] = None
        return touched

    def _append_or_fail(self, request: Request, token: int, logprobs) -> None:
        """`_append_token`; an error it raises (a grammar rejecting the token, a detokenizer) fails this request alone."""
        try:
            self._append_token(request, token, logprobs)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            if is_fatal_error(exc):
                raise
            self._fail(request.request_id, exc)

    def _launch_following(self, done: "InFlightStep") -> "InFlightStep | None":
        """Launch the step after `done` (still running) when it would be the same plain decodes: every
        running request, less those `done` brings to max_tokens or max_model_len, none waiting that the
        synchronous scheduler would admit now, pages for all without preempting."""
        if self._compiling or self._suspects:
            return None
        requests, keep, alive = [], [], 0  # rows of requests that ended since its launch: skipped
        last_position = self.max_model_len - 1
        for i, chunk in enumerate(done.sched.chunks):  # (one loop: this runs per request per step)
            r = chunk.request
            requests.append(r)
            if r.status is Status.FINISHED:
                continue
            alive += 1
            if (len(r.output_ids) + 1 < r.params.max_tokens and r.num_tokens < last_position and r.thinking is None
                    and r.grammar is None):
                keep.append(i)
        if len(self.scheduler.running) != alive:
            return None
        if not keep or len(keep) > self.args.max_num_batched_tokens:
            return None
        ready = next((r for r in self.scheduler.waiting if r.ready), None)
        if ready is not None:
            need = ready.params.n if not ready.output_ids and ready.sample_index == 0 else 1
            if len(self.scheduler.running) + need <= self.args.max_num_seqs:
                return None  # the synchronous step admits it now
        survivors = [requests[i] for i in keep]
        rows = self.runner.plain_sample_requests(survivors, 1)
        if rows is None:
            return None
        sched = self.scheduler.reserve_ahead(survivors)
        if sched is None:
            return None
        tokens = done.launched.tokens
        if len(keep) < len(requests):
            tokens = tokens[to_device(keep, tokens.device)]
        for r in survivors:
            r.fed_ahead = True
        self.num_steps += 1
        self.num_overlapped_steps += 1
        try:
            return InFlightStep(sched, self.runner.launch(self.runner.prepare_ahead(sched, tokens), rows), [])
        except Exception as exc:
            if is_fatal_error(exc):
                raise
            raise _LaunchFailed(sched) from exc

    def _current_suspect(self) -> Suspect | None:
        self._suspects = [s for s in self._suspects if not s.request.finished]
        return self._suspects[0] if self._suspects else None

    def _after_failed_forward(self, sched, exc: Exception) -> list[str]:
        """Blame the request when the step ran only one; else undo the step and isolate its requests."""
        ids = list(dict.fromkeys(c.request.request_id for c in sched.chunks))
        if len(ids) == 1:
            for chunk in sched.chunks:
                self.scheduler.drop_prompt_snapshot(chunk)
            self._isolated_failures += 1
            if self._isolated_failures >= MAX_CONSECUTIVE_ISOLATED_FAILURES:
                raise EngineFatalError(f"{self._isolated_failures} steps in a row failed, each running a single "
                                       f"request: the engine cannot run requests") from exc
            self._fail(ids[0], exc)
            return ids
        logger.warning("a step of %d requests failed (%s: %s); recomputing them one at a time to find the request "
                       "it comes from", len(ids), type(exc).__name__, exc)
        known = {id(s.request) for s in self._suspects}
        for chunk in sched.chunks:
            if id(chunk.request) not in known:
                self._suspects.append(Suspect(chunk.request, chunk.request.num_computed + chunk.num_tokens))
        self._suspects.sort(key=lambda s: s.request.arrival)
        self.scheduler.retry_later(sched)
        return []

    def _fail(self, request_id: str, exc: BaseException, message: str | None = None) -> None:
        """End a request because of an error inside the engine: its samples finish with "error", its
        pages are freed (no prefix-cache snapshot of it is kept), its next output carries the error."""
        group = self.groups.get(request_id)
        if group is None or group.error is not None:
            return
        if message is None:
            logger.error("request %s failed inside the engine; the other requests go on", request_id, exc_info=exc)
        else:
            logger.warning("request %s failed: %s", request_id, message.splitlines()[0] if message else "")
        group.error = message or REQUEST_FAILED_MESSAGE.format(request_id=request_id)
        self.num_failed_requests += 1
        for sample in group.samples:
            if not sample.finished:
                self.scheduler.finish(sample, "error")

    def _postprocess(self, sched, results) -> dict[str, None]:
        """Advance each chunk's request, keep prompt snapshots, fork n > 1 samples, append tokens, check stops."""
        touched: dict[str, None] = {}
        committed: dict[int, int] = {}  # verify chunk (index in the step) -> tokens committed
        for chunk in sched.chunks:
            if chunk.draft_row is not None:  # the drafts were on the device: their values, copied since
                chunk.draft_token_ids = chunk.draft_row.values()[: len(chunk.draft_token_ids)]
        for index, (chunk, result) in enumerate(zip(sched.chunks, results)):
            request = chunk.request
            if request.finished:  # another sample of its request failed earlier in this loop
                self.scheduler.drop_prompt_snapshot(chunk)
                continue
            if not chunk.draft_token_ids:
                request.num_computed += chunk.num_tokens
                self.num_computed_tokens += chunk.num_tokens
            if result.prompt_logprobs:
                request.prompt_logprobs += result.prompt_logprobs
            if chunk.snapshot_state_pages:
                self.scheduler.keep_prompt_snapshot(chunk)
            if result.error is not None:
                self._fail(request.request_id, result.error)
                touched[request.request_id] = None
                continue
            if chunk.draft_token_ids:
                touched[request.request_id] = None
                kept = self._append_verified(chunk, result)
                if kept and not request.finished:
                    request.num_computed += kept  # the fed pending token and the kept drafts before the last token
                    self.num_computed_tokens += kept
                    committed[index] = kept
                continue
            if not result.samples:
                continue
            if len(result.samples) == 1:  # a decode (the common case): one token for the chunk's sample
                self._append_or_fail(request, *result.samples[0])
                touched[request.request_id] = None
                continue
            group = self.groups[request.request_id]
            samples = [request]
            for index in range(1, len(result.samples)):
                child = self.scheduler.fork(request, index, next(self._arrivals))
                child.grammar = request.grammar.fork() if request.grammar is not None else None
                child.thinking = request.thinking.copy() if request.thinking is not None else None
                self._attach_detokenizer(child)
                group.samples.append(child)
                samples.append(child)
            try:
                for sample, (token, logprobs) in zip(samples, result.samples):
                    self._append_token(sample, token, logprobs)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                if is_fatal_error(exc):
                    raise
                self._fail(request.request_id, exc)
            touched[request.request_id] = None
        if any(c.draft_token_ids for c in sched.chunks):
            self._commit_verified(sched, committed)
        return touched

    def _append_verified(self, chunk, result) -> int:
        """Keep a verify chunk's accepted drafts and the target's next token (until a stop); returns the
        tokens kept. A failure in appending fails the request alone."""
        request = chunk.request
        drafts = chunk.draft_token_ids
        accepted = accept_drafts(drafts, [t for t, _ in result.samples])
        self.spec_stats.record(len(drafts), accepted)
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += accepted
        kept = 0
        try:
            for token, logprobs in result.samples[: accepted + 1]:
                self._append_token(request, token, logprobs)
                kept += 1
                if request.finished:
                    break
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            if is_fatal_error(exc):
                raise
            self._fail(request.request_id, exc)
        return kept

    def _commit_verified(self, sched, committed: dict[int, int]) -> None:
        """Replay the kept tokens of the step's verify chunks into their KDA state, release the pages
        of rejected drafts. A failed replay fails the requests it was for (their state is unknown)."""
        try:
            self.executor.commit_verified(committed)
        except Exception as exc:  # noqa: BLE001 - blamed on the requests whose state it was replaying
            if is_fatal_error(exc):
                raise
            for index in committed:
                self._fail(sched.chunks[index].request.request_id, exc)
        for index in committed:
            request = sched.chunks[index].request
            if not request.finished:
                self.scheduler.after_verify(request)

    def _propose(self) -> None:
        """Draft tokens for every running decode (speculative decoding), verified by the next step."""
        if self.proposer is None:
            return
        decodes = [r for r in self.scheduler.running if r.is_decode]
        for r in self.scheduler.running:
            r.spec_token_ids, r.spec_draft_row = [], None
        if not decodes:
            return
        # room for the drafts plus the target's bonus token within max_tokens and max_model_len
        limits = [min(r.params.max_tokens - len(r.output_ids), self.max_model_len - r.num_tokens) - 1 for r in decodes]
        # drafts may stay on the device when no verify row needs their values on the host (device_drafts.py)
        on_device = (all(r.grammar is None and r.thinking is None for r in decodes)
                     and self.runner.plain_sample_requests(decodes, 0) is not None)
        try:
            drafts = self.proposer.propose(decodes, limits, on_device)
        except Exception as exc:  # noqa: BLE001 - no drafts this round; the requests decode as usual
            if is_fatal_error(exc):
                raise
            logger.warning("the speculative proposer failed (%s: %s); decoding without drafts this step",
                           type(exc).__name__, exc)
            return
        for r, d in zip(decodes, drafts):
            if isinstance(d, DraftRow):
                r.spec_token_ids, r.spec_draft_row = [PLACEHOLDER] * d.count, d
            else:
                r.spec_token_ids = list(d)

    def _attach_detokenizer(self, request: Request) -> None:
        if self.tokenizer is not None:
            p = request.params
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output,
                p.min_tokens)

    def _append_token(self, request: Request, token: int, logprobs) -> None:
        if request.grammar is not None:
            request.grammar.accept(token)  # a token the grammar refuses fails the request
        if request.thinking is not None:
            request.thinking.advance(token)
        request.output_ids.append(token)
        if len(request.output_ids) == 1:  # a sample's first token (the group's first is the first of these)
            group = self.groups.get(request.request_id)
            if group is not None and group.times.first_token is None:
                group.times.first_token = time.monotonic()
        if logprobs is not None:
            request.logprobs.append(logprobs)
        stop_str = request.detokenizer.add(token) if request.detokenizer else None
        p = request.params
        reason, stop_reason = None, None
        if token == self.eos_token_id and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif stop_str is not None:
            reason, stop_reason = "stop", stop_str
        elif len(request.output_ids) >= p.max_tokens or request.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)

    def _output(self, request_id: str) -> RequestOutput | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        out = None
        if group.error is None:
            if group.output_kind is RequestOutputKind.FINAL_ONLY and not group.finished:
                return None
            try:
                out = self._progress_output(request_id, group)
            except Exception as exc:  # noqa: BLE001 - detokenising this request failed: it fails alone
                if is_fatal_error(exc):
                    raise
                self._fail(request_id, exc)
        if out is None:
            out = RequestOutput(request_id, group.prompt, group.prompt_ids,
                                [CompletionOutput(s.sample_index, "", [], None, "error") for s in group.samples],
                                True, None, group.samples[0].num_cached_tokens, group.error, group.times)
        if out.finished:
            if group.times.finished is None:
                group.times.finished = time.monotonic()
            del self.groups[request_id]
        return out

    def _progress_output(self, request_id: str, group: RequestGroup) -> RequestOutput:
        delta_kind = group.output_kind is RequestOutputKind.DELTA
        outputs = []
        for s in group.samples:
            text, delta = "", ""
            if s.detokenizer is not None:
                delta = s.detokenizer.stream_delta(finished=s.finished)
                if not delta_kind:  # (a DELTA output holds only the delta: the whole text is not joined)
                    text = s.detokenizer.text
            new_ids = s.output_ids[s.streamed_tokens:]
            logprobs = None
            if s.params.logprobs is not None:
                if delta_kind:
                    logprobs, s.logprobs = s.logprobs, []  # reported once: the engine keeps no copy
                else:
                    logprobs = list(s.logprobs)
            if delta_kind:
                outputs.append(CompletionOutput(s.sample_index, delta, new_ids, logprobs, s.finish_reason,
                                                s.stop_reason, delta, new_ids))
            else:
                outputs.append(CompletionOutput(s.sample_index, text, list(s.output_ids), logprobs, s.finish_reason,
                                                s.stop_reason, delta, new_ids))
            s.streamed_tokens = len(s.output_ids)
        prompt_logprobs = group.samples[0].prompt_logprobs if group.params.prompt_logprobs is not None else None
        if delta_kind:
            prompt_logprobs = None if group.prompt_logprobs_sent else prompt_logprobs
            group.prompt_logprobs_sent = True
        return RequestOutput(request_id, group.prompt, group.prompt_ids, outputs, group.finished, prompt_logprobs,
                             group.samples[0].num_cached_tokens, times=group.times)

    # introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            **self.allocator.stats(),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "computed_tokens": self.num_computed_tokens,
            "steps": self.num_steps,
            "overlapped_steps": self.num_overlapped_steps,
            "failed_requests": self.num_failed_requests,
            **self.spec_stats.as_dict(),
        }

    def cache_summary(self) -> str:
        """The cache's capacity in one line (printed when a server starts, as vLLM logs its KV cache
        size and maximum concurrency)."""
        bs, pages, state = self.block_size, self.allocator.num_pages, self.allocator.num_state_pages_per_seq
        per_request = math.ceil(self.max_model_len / bs) + state
        return (f"KV cache: {pages} pages of {self.layout.page_bytes / 2**20:.2f} MiB ({self.layout.kv_cache_dtype}, "
                f"{bs} tokens per page) = {pages * bs:,} tokens, each sequence also holding {state} KDA state "
                f"pages; {pages / per_request:.2f} requests of max_model_len={self.max_model_len:,} tokens fit at once")

    def shutdown(self) -> None:
        """Stop the other ranks (world size > 1); idempotent. The engine cannot step afterwards."""
        self.structured_outputs.shutdown()
        self.executor.shutdown()

    def check_idle(self) -> None:
        """Raise RuntimeError if the engine is idle but holds pages other than the prefix cache's."""
        if self.scheduler.has_work:
            raise RuntimeError("the engine still has requests")
        self.allocator.check_idle()
        if self.proposer is not None:
            self.proposer.check_idle()
