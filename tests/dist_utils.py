"""Run a function on W gloo ranks, one process each (one torch thread per process), for the
multi-process tests.

    def check(rank, world_size, x):            # module level, so that spawn can import it
        ...; return something picklable
    results = run_ranks(3, check, 42)          # [rank 0's result, rank 1's, rank 2's]

A rank that raises fails the call with its traceback; ranks still running past `timeout` seconds are
killed and the call fails (never a silent hang).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn, args, results, timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # pickled here by value: a queue would send tensors as shared memory that dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on `world_size` spawned gloo ranks; their results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results, timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: list[str] = []
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in "
                                     f"{timeout}s") from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the other ranks fail or hang on their next collective: stop them
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
