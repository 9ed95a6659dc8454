"""Run functions on W gloo ranks, one process each (one torch thread per process), for the
multi-process tests.

    def check(rank, world_size, x):            # module level, so that spawn can import it
        ...; return something picklable
    def test_check(ranks):                     # `ranks`: conftest's session-wide RankPools
        results = ranks.run(3, check, 42)      # [rank 0's result, rank 1's, rank 2's]

The ranks of each world size are spawned once per session and run one call after another: a spawn
and torch import per rank cost ~5 s of CPU each, more than most of the calls. Each call starts from
a fresh process's torch state (the initial seed, one thread); the process group stays up between
calls. A rank that raises fails the call with its traceback; ranks still running past `timeout`
seconds fail the call (never a silent hang); either way that world's ranks are killed and the next
call spawns new ones.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import traceback
from datetime import timedelta


def _ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port() -> int:
    """A loopback port that is free now and outside the kernel's ephemeral range, drawn at random. A port
    the kernel hands out (bind to 0) can be handed out again, to a gloo connection or an HTTP client, in the
    seconds before the test's process binds it (seen in CI: a server's HTTP port taken while its ranks
    connected); a port below the ephemeral range is never handed out that way, only drawn by another test."""
    ephemeral = _ephemeral_ports()
    candidates = range(10000, ephemeral.start) if ephemeral.start > 12000 else range(ephemeral.stop, 65536)
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port found in {candidates}")


GROUP_TIMEOUT = 600.0
"""gloo's own collective timeout: a rank left waiting by a failed peer gives up after this (the parent
kills it much sooner); calls bound their own time by their `timeout`."""


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    seed = torch.initial_seed()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=GROUP_TIMEOUT))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((None, rank, False, traceback.format_exc()))
        return
    try:
        while (task := tasks.get()) is not None:
            call, fn, args = task
            torch.set_num_threads(1)
            torch.manual_seed(seed)
            try:
                out = fn(rank, world_size, *args)
                # pickled here by value: a queue would send tensors as shared memory that dies with this process
                results.put((call, rank, True, pickle.dumps(out)))
            except BaseException:  # noqa: BLE001 - reported to the parent
                results.put((call, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankGroup:
    """`world_size` spawned gloo ranks that run calls one after another."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.calls = 0

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        """fn(rank, world_size, *args) on every rank; their results in rank order. Raises AssertionError
        (after close()) when a rank raises or the ranks take longer than `timeout` seconds."""
        self.calls += 1
        call = self.calls
        for q in self.tasks:
            q.put((call, fn, args))
        out: dict[int, object] = {}
        try:
            while len(out) < self.world_size:
                try:
                    got, rank, ok, value = self.results.get(timeout=timeout)
                except queue.Empty:
                    raise AssertionError(f"ranks {sorted(set(range(self.world_size)) - set(out))} did not finish "
                                         f"in {timeout}s") from None
                if not ok:  # the other ranks fail or hang on their next collective
                    raise AssertionError(f"rank {rank}:\n{value}")
                if got == call:
                    out[rank] = pickle.loads(value)
        except BaseException:
            self.close(kill=True)
            raise
        return [out[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()


class RankPools:
    """One RankGroup per world size, spawned on first use and kept for the session (conftest's `ranks`)."""

    def __init__(self):
        self.groups: dict[int, RankGroup] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 120.0) -> list:
        group = self.groups.get(world_size)
        if group is None or not group.alive:
            group = self.groups[world_size] = RankGroup(world_size)
        return group.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) once on `world_size` newly spawned ranks (tests share conftest's `ranks`)."""
    group = RankGroup(world_size)
    try:
        return group.run(fn, *args, timeout=timeout)
    finally:
        group.close()
