"""Where the batch-invariant forward spends its time against the default forward: for each mode, torch.profiler
over one prefill step of `--batch` prompts of `--prompt-len` tokens and over one steady decode step of those
sequences (after warm-up steps that compile every kernel, so no compile or first-call cost is in the figures),
the kernels with the most device time printed and written as text, with each step's total device time. Steps run
eagerly (`enforce_eager`) so the profiler sees every kernel; the graph-replayed step launches the same kernels.
Run beside benchmarks/batch_invariant.py (which times both modes with graphs).

    PYTHONPATH=. python benchmarks/batch_invariant_profile.py --model small --device cuda --batch 4 --prompt-len 512
"""

from __future__ import annotations

import argparse
import gc
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams


def _profiled(engine: LLMEngine, cuda: bool, rows: int) -> tuple[str, float]:
    """(table, total self device time in ms; CPU time on the CPU) of one engine step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        engine.step()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)
    found = re.search(rf"Self {'CUDA' if cuda else 'CPU'} time total: ([0-9.]+)(us|ms|s)", table)  # the table's own sum
    total_ms = float(found.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[found.group(2)] if found else float("nan")
    return table, total_ms


def profile_mode(args, invariant: bool, cuda: bool) -> list[str]:
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
    name = "batch-invariant" if invariant else "default"
    text = []
    for phase in ("prefill", "decode"):
        if phase == "decode":
            engine.step()  # the first decode step after a prefill, unprofiled: the second is the steady one
        table, total = _profiled(engine, cuda, args.rows)
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
    parser.add_argument("--modes", default="default,invariant", help="comma-separated: default, invariant")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or any(m not in ("default", "invariant") for m in modes):
        parser.error(f"--modes takes default and/or invariant, got {args.modes!r}")
    cuda = args.device.startswith("cuda")
    text = []
    for mode in modes:
        text += profile_mode(args, mode == "invariant", cuda)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
