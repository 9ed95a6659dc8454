"""Where a long prefill's time goes: the whole engine (`LLMEngine`, `small` preset by default) prefills a
warm-up prompt (compiles), then one prompt of --tokens timed, then the same length again under
torch.profiler. Prints the profiled wall time against the GPU kernels' total and the kernels by name.

    python benchmarks/prefill_profile.py [--tokens 32768] [--preset small] [--out PATH]

Kernel totals count device time per profiler key: an op (aten::mm) and the kernel it launches both
appear, so read the kernel rows, not the sum of every row.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


def prefill(engine: LLMEngine, tokens: int, request_id: str) -> float:
    generator = torch.Generator().manual_seed(tokens + len(request_id))
    prompt = torch.randint(0, engine.config.vocab_size, (tokens,), generator=generator).tolist()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--warmup-tokens", type=int, default=9000)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--cache-gib", type=float, default=60.0)
    p.add_argument("--out", default="benchmarks/results/prefill_profile.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_profile.py needs a CUDA GPU")
    engine = LLMEngine(EngineArgs(
        model=args.preset, dtype="bfloat16", kv_cache_dtype="fp8", device="cuda", max_model_len=args.tokens + 64,
        max_num_seqs=4, enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
        kv_cache_memory_gib=args.cache_gib))
    warm_s = prefill(engine, args.warmup_tokens, "warm")
    timed_s = prefill(engine, args.tokens, "timed")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled_s = prefill(engine, args.tokens, "profiled")
    device_s, calls = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            device_s[event.key] += event.self_device_time_total / 1e6
            calls[event.key] += event.count
    result = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "command": " ".join(sys.argv),
              "preset": args.preset, "tokens": args.tokens, "warmup_s": warm_s, "timed_s": timed_s,
              "profiled_wall_s": profiled_s,
              "top": [{"name": n, "device_s": t, "calls": calls[n]} for n, t in device_s.most_common(80)]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"prefill {args.tokens}: warm-up {warm_s:.2f} s, timed {timed_s:.3f} s, profiled {profiled_s:.3f} s")
    for name, t in device_s.most_common(30):
        print(f"  {t:8.3f} s {calls[name]:6d}x  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
