"""Executors: how the engine's steps reach the ranks (vLLM's executor interface).

`UniProcExecutor` (world size 1): the engine's one Worker in its own process. `MultiprocExecutor`:
the engine's process is rank 0 (a Worker of its own, which also samples); the other ranks of this
node are spawned processes, and ranks of other nodes are started there (`kimiserve serve
--node-rank R`, or torchrun), all joined in one torch.distributed group (NCCL between GPUs, gloo on
CPUs; a gloo group carries the control messages either way). Every step, rank 0 broadcasts the
step's `StepInput` (token ids, positions, page ids, state pages, page copies) over the control
group, every rank runs its shard's forward, and rank 0 samples from the full-vocabulary logits.

Failures: a worker process that exits, or a collective that fails or passes `distributed_timeout`
seconds, is fatal (`EngineFatalError`): ranks that went separate ways cannot be brought back in
step, so the engine stops and the server exits for its supervisor to restart it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kimiserve.distributed.parallel_state import LoneRankContext, ParallelConfig, ParallelContext
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.errors import EngineFatalError
from kimiserve.engine.worker import Worker

logger = logging.getLogger("kimiserve.executor")


class UniProcExecutor:
    """World size 1: the engine's one worker, in-process."""

    def __init__(self, args: EngineArgs, eos_token_id: int | None, config=None, parallel: ParallelContext | None = None):
        device = args.resolved_device()
        self.driver = Worker(args, parallel or ParallelContext.single(device), eos_token_id, config)
        self.world_size = 1

    def agree_num_pages(self, pages: int) -> int:
        return pages

    def init_cache(self, num_pages: int, max_model_len: int) -> None:
        self.driver.init_cache(num_pages, max_model_len)

    def execute(self, sched):
        return self.driver.runner.execute(sched)

    def commit_verified(self, accepted: dict[int, int]) -> None:
        """After a step with speculative verify chunks: `ModelRunner.commit_verified`."""
        self.driver.runner.commit_verified(accepted)

    def update_weights(self, tensors) -> None:
        """New values for the model's parameters, named and shaped as the one-process model's
        (`loader.load_tensors`; ValueError before anything is written)."""
        self.driver.update_weights(tensors)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _device_for(args: EngineArgs, local_rank: int) -> torch.device:
    device = args.resolved_device()
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    return device


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) when this process was started by torchrun, else None."""
    if not all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


def _init_method(args: EngineArgs) -> str:
    return "env://" if torchrun_rank() is not None else f"tcp://{args.master_addr}:{args.master_port}"


def _init_group(args: EngineArgs, rank: int, world_size: int, device: torch.device):
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=_init_method(args), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.distributed_timeout))
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return control


@dataclass
class WeightUpdate:
    """A control message: every rank loads its part of these one-process-named CPU tensors."""

    tensors: dict[str, torch.Tensor]


def _broadcast(obj, control) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def worker_main(rank: int, local_rank: int, args: EngineArgs, eos_token_id: int | None = None,
                threads: int = 1) -> None:
    """The loop of a rank other than 0: build the shard, agree on the pages, run each step's forward
    until rank 0 sends None. Any error ends the process (rank 0's next collective then fails fast)."""
    torch.set_num_threads(threads)
    config = args.parallel_config()
    device = _device_for(args, local_rank)
    control = _init_group(args, rank, config.world_size, device)
    try:
        ctx = ParallelContext.create(config, rank, device)
        worker = Worker(args, ctx, eos_token_id)
        pages = torch.tensor([worker.budget_pages()], dtype=torch.int64)
        dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=control)
        max_model_len = _broadcast(None, control)
        worker.init_cache(int(pages), max_model_len)
        while (message := _broadcast(None, control)) is not None:
            if isinstance(message, WeightUpdate):
                worker.update_weights(message.tensors)
            else:
                worker.runner.forward(message)
    finally:
        dist.destroy_process_group()


class MultiprocExecutor:
    """Rank 0 in this process; ranks 1 .. of this node spawned here (`--nnodes` > 1: the other nodes
    run their own ranks, see `run_node`)."""

    def __init__(self, args: EngineArgs, eos_token_id: int | None, config=None):
        pconfig: ParallelConfig = args.parallel_config()
        self.world_size = pconfig.world_size
        per_node = self.world_size // args.nnodes
        self.procs: list[mp.Process] = []
        self.failed: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        launched = torchrun_rank()
        if launched is not None and launched[2] != self.world_size:
            raise ValueError(f"torchrun started {launched[2]} processes, the layout needs {self.world_size} "
                             f"(tensor_parallel_size x prefill_context_parallel_size)")
        if launched is None and args.node_rank == 0:
            threads = max(1, torch.get_num_threads() // per_node)
            ctx = mp.get_context("spawn")
            for local in range(1, per_node):
                proc = ctx.Process(target=worker_main, args=(local, local, args, eos_token_id, threads),
                                   name=f"kimiserve-rank{local}", daemon=True)
                proc.start()
                self.procs.append(proc)
        device = _device_for(args, 0)
        self.control = _init_group(args, 0, self.world_size, device)
        self.driver = Worker(args, ParallelContext.create(pconfig, 0, device), eos_token_id, config)
        self._monitor = threading.Thread(target=self._watch, name="kimiserve-worker-monitor", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        if not sentinels:
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        proc = sentinels[ready[0]]
        if getattr(self, "_closing", False):
            return
        self.failed = f"worker {proc.name} exited with code {proc.exitcode}"
        logger.critical("%s: the engine cannot run steps without it", self.failed)
        if self.on_failure is not None:
            self.on_failure(self.failed)

    def agree_num_pages(self, pages: int) -> int:
        t = torch.tensor([pages], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def init_cache(self, num_pages: int, max_model_len: int) -> None:
        _broadcast(max_model_len, self.control)
        self.driver.init_cache(num_pages, max_model_len)

    def check_health(self) -> None:
        if self.failed is not None:
            raise EngineFatalError(self.failed)

    def update_weights(self, tensors) -> None:
        """Every rank loads its part of the one-process-named tensors: checked on rank 0 first (a worker's
        error would end it), then sent over the control group as CPU tensors."""
        from kimiserve.model.loader import check_tensors

        self.check_health()
        check_tensors(self.driver.model, tensors)
        message = WeightUpdate({name: t.detach().cpu() for name, t in tensors.items()})
        try:
            _broadcast(message, self.control)
        except Exception as exc:
            self.failed = self.failed or f"sending a weight update failed ({type(exc).__name__}: {exc})"
            raise EngineFatalError(f"{self.failed}; the ranks are out of step") from exc
        self.driver.update_weights(message.tensors)

    def commit_verified(self, accepted: dict[int, int]) -> None:
        raise NotImplementedError("speculative decoding runs on one rank for now (EngineArgs.speculative refuses more)")

    def execute(self, sched):
        self.check_health()
        runner = self.driver.runner
        step, plans = runner.prepare(sched)
        try:
            _broadcast(step, self.control)
            logits = runner.forward(step)
        except Exception as exc:  # ranks are out of step: nothing can continue
            self.failed = self.failed or f"a distributed step failed ({type(exc).__name__}: {exc})"
            raise EngineFatalError(f"{self.failed}; the ranks are out of step") from exc
        return runner.sample(sched, plans, logits)

    def shutdown(self) -> None:
        if getattr(self, "_closing", False):
            return
        self._closing = True
        if self.failed is None:
            try:
                _broadcast(None, self.control)
            except Exception:  # noqa: BLE001 - a worker is gone already
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def make_executor(args: EngineArgs, eos_token_id: int | None, config=None):
    if args.run_one_rank:  # benchmarks: rank 0's shard alone, no communication
        lone = LoneRankContext.of(args.parallel_config(), args.resolved_device())
        return UniProcExecutor(args, eos_token_id, config, lone)
    if args.parallel_config().world_size == 1:
        return UniProcExecutor(args, eos_token_id, config)
    return MultiprocExecutor(args, eos_token_id, config)


def run_node(args: EngineArgs, eos_token_id: int | None) -> int:
    """`kimiserve serve --node-rank R` for R > 0: run this node's ranks until rank 0 ends; exit code."""
    pconfig = args.parallel_config()
    per_node = pconfig.world_size // args.nnodes
    first = args.node_rank * per_node
    threads = max(1, (os.cpu_count() or 1) // per_node)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(first + i, i, args, eos_token_id, threads),
                         name=f"kimiserve-rank{first + i}") for i in range(per_node)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max((p.exitcode or 0) for p in procs)


def run_if_worker(args: EngineArgs) -> int | None:
    """For the CLI: run this process as ranks other than 0 and return the exit code once rank 0 ended
    (torchrun ranks > 0; `--node-rank R` > 0), or None when this process is rank 0's (the engine)."""
    launched = torchrun_rank()
    if launched is not None:
        rank, local_rank, world = launched
        if world != args.parallel_config().world_size:
            raise ValueError(f"torchrun started {world} processes, the layout needs "
                             f"{args.parallel_config().world_size} (tensor_parallel_size x prefill_context_parallel_size)")
        if rank == 0:
            return None
        worker_main(rank, local_rank, args, None, max(1, torch.get_num_threads()))
        return 0
    if args.node_rank > 0:
        return run_node(args, None)
    return None

