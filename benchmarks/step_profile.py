"""Where the long-context sparse decode step's time goes, kernel by kernel: the step of
decode_attention.py (index scan, top-k, sparse MLA on the engine's pages, `small` preset sizes)
replayed from a CUDA graph under torch.profiler, per cache format. Prints each kernel's mean device
time per step, their sum, and the step's graph time (the difference is the gaps between kernels).

    python benchmarks/step_profile.py [--context 1048576] [--batch 1] [--kv-cache-dtypes fp8,fp4] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("step_profile.py needs a CUDA GPU (and Triton)")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_attention import build_case, triton_ops  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.utils.cuda_timing import capture_graph, graph_time  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


def sparse_step(ops, c, context: int, topk: int):
    pool, tables, lens = c["pool"], c["tables"], c["lens"]
    def step():
        s = ops.scan(c["iq"], c["iw"], pool.index_key[0], pool.index_scale[0], tables, lens, torch.bfloat16,
                     max_context=context, rotation=c["rotation"])
        i = ops.topk(s, topk, lens)
        return ops.sparse(c["q_latent"], c["q_pe"], pool.latent[0], pool.latent_scales[0], tables, i, c["scale"],
                          torch.bfloat16)

    return step


def profile(step, replays: int = 20) -> list[dict]:
    graph = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels.setdefault(e.name, []).append(e.device_time)
    rows = [dict(kernel=name, calls_per_step=len(t) / replays, us_per_step=sum(t) / replays)
            for name, t in kernels.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1048576)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kv-cache-dtypes", default="fp8,fp4")
    parser.add_argument("--out", default="benchmarks/results/step_profile.json")
    args = parser.parse_args()
    config = load_preset("small")
    ops = triton_ops()
    results = []
    for kv in args.kv_cache_dtypes.split(","):
        c = build_case(config, args.batch, args.context, kv=kv)
        step = sparse_step(ops, c, args.context, config.index_topk)
        rows = profile(step)
        step_ms = graph_time(step)
        total = sum(r["us_per_step"] for r in rows)
        print(f"{kv} context {args.context} batch {args.batch}: step {step_ms * 1e3:.1f} us (graph), "
              f"kernels {total:.1f} us, gaps {step_ms * 1e3 - total:.1f} us")
        for r in rows:
            print(f"  {r['us_per_step']:7.1f} us  x{r['calls_per_step']:.0f}  {r['kernel'][:90]}")
        results.append(dict(kv_cache_dtype=kv, context=args.context, batch=args.batch, step_us=step_ms * 1e3,
                            kernels_us=total, kernels=rows, device=torch.cuda.get_device_name(),
                            date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=git_commit()))
        del c
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
