"""CUDA graphs emulated on the CPU for tests: the engine builds its graph sets (decode, verify, draft loop)
as on CUDA, and a "captured graph" re-runs the captured function at each replay, writing its outputs into
the tensors the capture returned. What this checks is the graph path's host side and data flow (the
static buffers' fills, padding, which rows come back, the KDA replay's inputs), not a real capture."""

from __future__ import annotations

import torch


class EagerGraph:
    """Stands in for a captured CUDA graph: `replay` runs fn again into the capture's output tensor."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)


def emulate_cuda_graphs(monkeypatch) -> None:
    """Engines built after this (within the test) run their graph paths on the CPU."""
    from kimiserve.engine import cuda_graphs, worker

    monkeypatch.setattr(worker, "uses_cuda_graphs", lambda device, args: not args.enforce_eager)
    monkeypatch.setattr(cuda_graphs.GraphSet, "warm_up", lambda self, *runs: [run() for run in runs] and None)

    def record(self, fn):
        out = fn()
        return EagerGraph(fn, out), out

    monkeypatch.setattr(cuda_graphs.GraphSet, "record", record)
