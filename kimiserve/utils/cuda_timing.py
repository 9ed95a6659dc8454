"""GPU timing for benchmarks and timing prints: medians of CUDA-event timings, eager or replayed
from a CUDA graph (how the engine will run decode steps, without the host's launch cost)."""

from __future__ import annotations

import time

import torch


def cuda_time(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `repeats` runs (after `warmup` untimed runs), by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn(), after 3 warm-up calls on a side stream (compiles, allocator)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_time(fn, repeats: int = 20, calls: int = 1) -> float:
    """Milliseconds per call of fn() replayed from a CUDA graph of `calls` calls (median of `repeats` replays)."""
    return cuda_time(capture_graph(fn, calls).replay, repeats) / calls


def wall_time(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Median milliseconds of fn() by the host clock (the CPU smoke run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
