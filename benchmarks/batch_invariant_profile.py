"""Where the batch-invariant forward spends its time against the default forward: for each mode, torch.profiler
over one prefill step of `--batch` prompts of `--prompt-len` tokens and over one steady decode step of those
sequences (after warm-up steps that compile every kernel, so no compile or first-call cost is in the figures),
the kernels with the most device time printed and written as text, with each step's total device time. Steps run
eagerly (`enforce_eager`) so the profiler sees every kernel; the graph-replayed step launches the same kernels.
Run beside benchmarks/batch_invariant.py (which times both modes with graphs).

Per shape (`--per-shape`, on by default): each profiled step's linears grouped by input shape (the
profiler's `group_by_input_shape` over aten::mm / addmm / bmm and the invariant ops), and on CUDA in the
invariant modes every call of the batch-invariant matmuls timed with CUDA events around it: per
(B, M, N, K, dtypes, tiles, split-K chunks, spread or not) the calls and device time. Mode
`invariant-split` is the invariant mode with split-K (`--split-k-programs`).

    PYTHONPATH=. python benchmarks/batch_invariant_profile.py --model small --device cuda --batch 4 --prompt-len 512 \
        --modes default,invariant,invariant-split
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams


LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "_InvariantLinear", "_HeadLinear",
              "_GroupedMatmul", "_MXFP4Linear")


def _shape_table(prof, cuda: bool, rows: int) -> str:
    """The linear ops' calls and time grouped by input shapes, most time first."""
    attr = "device_time_total" if cuda else "cpu_time_total"
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in LINEAR_OPS]
    events.sort(key=lambda e: -getattr(e, attr, getattr(e, "cuda_time_total", 0.0)))
    lines = [f"{'op':<18} {'calls':>5} {'total ms':>9} {'avg us':>8}  input shapes"]
    for e in events[:rows]:
        total = getattr(e, attr, getattr(e, "cuda_time_total", 0.0))
        lines.append(f"{e.key:<18} {e.count:>5} {total / 1e3:>9.3f} {total / max(e.count, 1):>8.1f}  {e.input_shapes}")
    return "\n".join(lines)


class MatmulTimer:
    """CUDA events around every call of the batch-invariant matmuls (`ops.batch_invariant.triton.matmul`,
    `grouped_matmul`; `reference` looks them up at each call), grouped by what decides their kernels."""

    def __init__(self):
        self.events: list[tuple[tuple, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def installed(self):
        from kimiserve.ops.batch_invariant import triton as bi_triton

        matmul, grouped = bi_triton.matmul, bi_triton.grouped_matmul

        def timed_matmul(x, w, out_dtype=torch.float32, spread=None):
            N, K = w.shape[-2], w.shape[-1]
            M, B = x.shape[-2], x.shape[0] if x.dim() == 3 else 1
            plan = bi_triton.matmul_plan(B, M, N, K, x.device, spread)
            c = plan.config
            key = ("matmul", B, M, N, K, str(x.dtype), str(w.dtype), f"BN{c['BN']} BK{c['BK']} w{c['num_warps']}",
                   plan.chunks, plan.spread)
            return self._timed(key, lambda: matmul(x, w, out_dtype, spread))

        def timed_grouped(x, weights, plan, out_dtype=torch.float32):
            w = weights[0] if isinstance(weights, tuple) else weights
            key = ("grouped", w.shape[0], x.shape[0], w.shape[1], x.shape[1], str(x.dtype), str(w.dtype), "", 1, False)
            return self._timed(key, lambda: grouped(x, weights, plan, out_dtype))

        bi_triton.matmul, bi_triton.grouped_matmul = timed_matmul, timed_grouped
        try:
            yield self
        finally:
            bi_triton.matmul, bi_triton.grouped_matmul = matmul, grouped

    def _timed(self, key, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        self.events.append((key, start, end))
        return out

    def table(self) -> str:
        torch.cuda.synchronize()
        calls, ms = defaultdict(int), defaultdict(float)
        for key, start, end in self.events:
            calls[key] += 1
            ms[key] += start.elapsed_time(end)
        self.events.clear()
        lines = [f"{'kind':<8} {'B':>3} {'M':>6} {'N':>7} {'K':>6} {'x dtype':<15} {'w dtype':<15} {'tiles':<16} "
                 f"{'chunks':>6} {'spread':>6} {'calls':>5} {'total ms':>9} {'avg us':>8}"]
        for key in sorted(ms, key=lambda k: -ms[k]):
            kind, B, M, N, K, xd, wd, tiles, chunks, spread = key
            lines.append(f"{kind:<8} {B:>3} {M:>6} {N:>7} {K:>6} {xd:<15} {wd:<15} {tiles:<16} {chunks:>6} "
                         f"{str(spread):>6} {calls[key]:>5} {ms[key]:>9.3f} {1e3 * ms[key] / calls[key]:>8.1f}")
        lines.append(f"all: {sum(calls.values())} calls, {sum(ms.values()):.3f} ms (event time: launch gaps included)")
        return "\n".join(lines)


def _profiled(engine: LLMEngine, cuda: bool, rows: int, per_shape: bool, timer: MatmulTimer | None) -> tuple[str, float]:
    """(table, total self device time in ms; CPU time on the CPU) of one engine step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=per_shape) as prof:
        with timer.installed() if timer is not None else contextlib.nullcontext():
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    found = re.search(rf"Self {'CUDA' if cuda else 'CPU'} time total: ([0-9.]+)(us|ms|s)", table)  # the table's own sum
    total_ms = float(found.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[found.group(2)] if found else float("nan")
    if per_shape:
        table += "\n-- linears by input shape (profiler)\n" + _shape_table(prof, cuda, rows)
    if timer is not None:
        table += "\n-- batch-invariant matmul calls (CUDA events)\n" + timer.table()
    return table, total_ms


def profile_mode(args, mode: str, cuda: bool) -> list[str]:
    invariant = mode != "default"
    split = contextlib.nullcontext()
    if mode == "invariant-split":
        from kimiserve.ops.batch_invariant import triton as bi_triton

        split = _split_k(bi_triton, args.split_k_programs)
    with split:
        return _profile_engine(args, mode, invariant, cuda)


@contextlib.contextmanager
def _split_k(bi_triton, programs: int):
    before = bi_triton.SPLIT_K_PROGRAMS
    bi_triton.SPLIT_K_PROGRAMS = programs
    try:
        yield
    finally:
        bi_triton.SPLIT_K_PROGRAMS = before


def _profile_engine(args, name: str, invariant: bool, cuda: bool) -> list[str]:
    timer = MatmulTimer() if invariant and cuda and args.per_shape else None
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, batch_invariant=invariant, enforce_eager=True,
                                  max_model_len=args.prompt_len + 32, enable_prefix_caching=False,
                                  max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                                  gpu_memory_utilization=args.gpu_memory_utilization))
    torch.manual_seed(0)
    prompts = [torch.randint(0, 768, (args.prompt_len,)).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):  # warm-up: the same shapes, every kernel compiled
        engine.add_request(f"warm{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    text = []
    for phase in ("prefill", "decode"):
        if phase == "decode":
            engine.step()  # the first decode step after a prefill, unprofiled: the second is the steady one
        table, total = _profiled(engine, cuda, args.rows, args.per_shape, timer)
        text.append(f"== {name}: {phase} ({args.model}, batch {args.batch}, prompt {args.prompt_len}): "
                    f"{total:.3f} ms of {'device' if cuda else 'CPU'} time\n{table}")
        print(text[-1], flush=True)
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--modes", default="default,invariant",
                        help="comma-separated: default, invariant, invariant-split")
    parser.add_argument("--split-k-programs", type=int, default=264, help="SPLIT_K_PROGRAMS of invariant-split")
    parser.add_argument("--per-shape", action=argparse.BooleanOptionalAction, default=True,
                        help="the linears per input shape (and per invariant matmul call on CUDA)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or any(m not in ("default", "invariant", "invariant-split") for m in modes):
        parser.error(f"--modes takes default, invariant and/or invariant-split, got {args.modes!r}")
    cuda = args.device.startswith("cuda")
    text = []
    for mode in modes:
        text += profile_mode(args, mode, cuda)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
