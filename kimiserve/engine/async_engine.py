"""AsyncLLMEngine: the engine in its own thread, streaming outputs to asyncio consumers.

The engine thread is the only caller of the `LLMEngine` (one engine call at a time). The event
loop hands it commands (add, abort) through a locked list and a condition variable; the thread
applies them between steps, runs a step, and posts the step's outputs back to the loop with one
`loop.call_soon_threadsafe` per step, where each request's output lands in its consumer's sink
(an `OutputSink`, or any queue with `put_nowait`). A streaming consumer gets DELTA outputs (only
what is new); a `final_only` consumer gets one output, the whole result, when the request
finishes (the deltas are folded in the engine thread). An `OutputSink` holds at most `max_bytes`
of unread output: past that its requests are aborted (their pages freed) and the consumer gets
an `OutputOverflowError` item, so a client that stops reading costs bounded memory and never stalls
the engine or the other requests. With nothing to do the thread waits on the condition variable.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model="tiny"))
    engine.start()                                  # inside the running event loop
    async for out in engine.generate("r1", "Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text)                  # DELTA: the new text of this step
    await engine.shutdown()

Leaving a `generate` loop early (break, cancellation, client disconnect) aborts the request: its
pages are freed before the next step. A request that fails inside the engine (`LLMEngine.step`
blames it) ends alone with a `RequestFailedError`. A fatal error ends the engine: `errored` is
True, `dead_error` holds the exception, every consumer receives an `EngineDeadError` (whose
message has no internal details), new requests are refused with it, and the callbacks given to
`add_dead_callback` run on the event loop (the server exits so that its supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.engine.errors import EngineFatalError
from kimiserve.engine.outputs import RequestOutput, RequestOutputKind, merge_deltas
from kimiserve.sampling_params import SamplingParams

logger = logging.getLogger("kimiserve.engine")

DEAD_MESSAGE = ("the engine stopped after an internal error and the server is restarting; retry the request "
                "shortly")
SHUTDOWN_MESSAGE = "the server is shutting down"


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a fatal error, or the engine was shut down); the message is fit
    for clients."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; the engine goes on. The message is fit for clients."""


class OutputOverflowError(RuntimeError):
    """A consumer left more than its sink's bound of output unread; its requests were aborted."""


def output_bytes(out: RequestOutput) -> int:
    """Rough bytes of Python objects one output holds (text, token ids, logprob entries)."""
    def logprob_bytes(entries) -> int:
        return sum(120 + 72 * len(e.top) for e in entries if e is not None) if entries else 0

    total = 200 + logprob_bytes(out.prompt_logprobs)
    for c in out.outputs:
        total += 150 + len(c.text) + len(c.delta_text) + 36 * (len(c.token_ids) + len(c.delta_token_ids))
        total += logprob_bytes(c.logprobs)
    return total


class OutputSink:
    """An asyncio queue of engine outputs for one consumer (one HTTP request), holding at most
    `max_bytes` (estimated by `output_bytes`) of unread output. On overflow the queued outputs are
    dropped, `on_overflow` runs once (the server aborts the sink's requests there), later outputs
    are dropped and the consumer's next `get` returns an `OutputOverflowError`. Event-loop only."""

    def __init__(self, max_bytes: int | None = None, on_overflow: Callable[[], None] | None = None):
        self.max_bytes = max_bytes
        self.on_overflow = on_overflow
        self.pending_bytes = 0
        self.overflowed = False
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Any) -> None:
        if self.overflowed:
            return
        size = output_bytes(item) if isinstance(item, RequestOutput) else 0
        self._items.append((item, size))
        self.pending_bytes += size
        if self.max_bytes is not None and self.pending_bytes > self.max_bytes and not isinstance(item, BaseException):
            self.overflowed = True
            unread = self.pending_bytes
            self._items.clear()
            self.pending_bytes = 0
            self._items.append((OutputOverflowError(
                f"the client did not read its output: about {unread:,} bytes were waiting, more than the server's "
                f"limit of {self.max_bytes:,} (--max-queued-output-bytes); the request was aborted"), 0))
            if self.on_overflow is not None:
                self.on_overflow()
        self._ready.set()

    async def get(self) -> Any:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, size = self._items.popleft()
        self.pending_bytes -= size
        return item


@dataclass
class RequestRecord:
    """What the engine thread knows about one request beyond the engine itself (for metrics)."""

    request_id: str
    sink: Any
    """Where its outputs go: an OutputSink or anything with `put_nowait`."""
    arrival: float
    """time.monotonic() when the request was submitted."""
    final_only: bool = False
    """Deliver one output, the whole result, when it finishes (folded from the engine's deltas)."""
    deltas: list[RequestOutput] = field(default_factory=list)
    """final_only: the outputs so far, folded when it finishes."""
    lora_name: str | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class EngineObserver(Protocol):
    """Called in the engine thread (keep it quick and thread-safe, e.g. prometheus_client)."""

    def on_output(self, record: RequestRecord, output: RequestOutput, now: float) -> None: ...

    def on_abort(self, record: RequestRecord) -> None: ...


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None):
        self.engine = engine
        self.observer = observer
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._records: dict[str, RequestRecord] = {}  # engine thread only
        self._dead: BaseException | None = None
        self._dead_callbacks: list[Callable[[], None]] = []
        self._stats: dict[str, Any] = engine.stats()
        if hasattr(engine.executor, "on_failure"):  # a rank that dies while the engine idles ends it too
            engine.executor.on_failure = lambda why: self._submit(("fatal", why))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, observer: EngineObserver | None = None) -> "AsyncLLMEngine":
        return cls(LLMEngine(args), observer)

    # properties read by the HTTP side ------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def stats(self) -> dict[str, Any]:
        """`LLMEngine.stats()` as of the engine thread's latest loop (the engine is never read from here)."""
        return self._stats

    # lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kimiserve-engine", daemon=True)
        self._thread.start()

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        """Run `callback()` on the event loop once the engine has died of a fatal error (after its
        consumers were sent their EngineDeadError)."""
        self._dead_callbacks.append(callback)

    def stop(self) -> None:
        """Tell the thread to stop (never blocks): unfinished requests are aborted between steps and
        their consumers get EngineDeadError; new requests are refused."""
        with self._cv:
            self._stopping = True
            self._cv.notify()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread and wait for it (see `stop`)."""
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # requests ------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          sink: Any, arrival: float | None = None, final_only: bool = False,
                          lora_name: str | None = None) -> None:
        """Queue a request whose outputs go to `sink` (a DELTA RequestOutput per step it progresses,
        or with `final_only` one whole RequestOutput when it finishes; or an exception: EngineDeadError,
        RequestFailedError). Returns once the engine accepted it; the engine's ValueError is raised here."""
        self._check_alive()
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() was not called")
        accepted = self._loop.create_future()
        record = RequestRecord(request_id, sink, arrival if arrival is not None else time.monotonic(), final_only,
                               lora_name=lora_name)
        self._submit(("add", record, prompt, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still happen: this abort follows it
            raise

    async def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache snapshot between two steps (running requests are untouched); returns
        the pages that became free."""
        self._check_alive()
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() was not called")
        done = self._loop.create_future()
        self._submit(("reset_prefix_cache", done))
        return await done

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between two steps (LoRA loading, weight updates); returns its
        result or raises its exception here."""
        self._check_alive()
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() was not called")
        done = self._loop.create_future()
        self._submit(("call", fn, done))
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request between steps and free its pages; idempotent, thread-safe, never blocks."""
        self._submit(("abort", request_id))

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (DELTA: each holds what is new); the last has `finished=True`.
        Closing early aborts it."""
        sink = OutputSink()
        await self.add_request(request_id, prompt, params, sink)
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    # internals -----------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(DEAD_MESSAGE) from self._dead
        if self._stopping:
            raise EngineDeadError(SHUTDOWN_MESSAGE)

    def _submit(self, command: tuple) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _post(self, callback, *args) -> None:
        """Run callback(*args) on the event loop (from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    self._apply(command)
                if stopping:
                    self._stop(EngineDeadError(SHUTDOWN_MESSAGE))
                    self.engine.shutdown()
                    return
                if engine.has_unfinished_requests():
                    before = engine.num_steps
                    outputs = engine.step()
                    if not outputs and engine.num_steps == before and not engine.num_compiling:  # would spin forever
                        raise RuntimeError("the engine scheduled nothing while requests wait")
                    self._dispatch(outputs)
                self._stats = engine.stats()
        except BaseException as exc:  # noqa: BLE001 - the engine is dead; tell everyone (no internals)
            logger.critical("the engine hit a fatal error and stopped", exc_info=exc)
            self._dead = exc
            self._stop(EngineDeadError(DEAD_MESSAGE))
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - already dying
                logger.exception("stopping the other ranks failed")
            for callback in self._dead_callbacks:
                self._post(callback)

    def _apply(self, command: tuple) -> None:
        if command[0] == "fatal":
            raise EngineFatalError(command[1])
        if command[0] == "reset_prefix_cache":
            freed = self.engine.reset_prefix_cache()
            self._stats = self.engine.stats()
            self._post(_settle, command[1], None, freed)
            return
        if command[0] == "call":
            try:
                result = command[1](self.engine)
            except Exception as exc:  # noqa: BLE001 - the caller's error, raised on its side
                self._post(_settle, command[2], exc)
            else:
                self._post(_settle, command[2], None, result)
            self._stats = self.engine.stats()
            return
        if command[0] == "abort":
            record = self._records.pop(command[1], None)
            if record is not None:
                self.engine.abort_request(record.request_id)
                if self.observer is not None:
                    self.observer.on_abort(record)
            return
        _, record, prompt, params, accepted = command
        try:
            self.engine.add_request(record.request_id, prompt, params, RequestOutputKind.DELTA, lora_name=record.lora_name)
        except Exception as exc:  # noqa: BLE001 - refused requests are the caller's error, not the engine's
            self._post(_settle, accepted, exc)
            return
        record.num_prompt_tokens = len(self.engine.groups[record.request_id].prompt_ids)
        self._records[record.request_id] = record
        self._post(_settle, accepted, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            record = self._records.get(out.request_id)
            if record is None:
                continue
            if out.finished:
                del self._records[out.request_id]
            if self.observer is not None:
                try:
                    self.observer.on_output(record, out, now)
                except Exception:  # noqa: BLE001 - metrics must never kill the engine
                    logger.exception("metrics observer failed")
            if out.error is not None:
                deliveries.append((record.sink, RequestFailedError(out.error)))
            elif record.final_only:
                record.deltas.append(out)
                if out.finished:
                    deliveries.append((record.sink, merge_deltas(record.deltas)))
            else:
                deliveries.append((record.sink, out))
        if deliveries:
            self._post(_deliver, deliveries)

    def _stop(self, error: EngineDeadError) -> None:
        """Abort everything the engine still holds and fail the consumers (engine thread)."""
        records, self._records = self._records, {}
        for request_id in list(records):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - already dying
                pass
        with self._cv:
            commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add":
                self._post(_settle, command[4], error)
            elif command[0] == "reset_prefix_cache":
                self._post(_settle, command[1], error)
            elif command[0] == "call":
                self._post(_settle, command[2], error)
        self._post(_deliver, [(r.sink, error) for r in records.values()])
        try:
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            pass


def _settle(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for sink, item in deliveries:
        sink.put_nowait(item)
