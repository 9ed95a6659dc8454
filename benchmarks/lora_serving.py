"""Throughput of LoRA adapters in the default (fast) forward, in one run, against the same engine without them.

Cases (each a fresh engine from the same weights; `--batch` prompts of `--prompt-len` tokens):
- `no_lora`: an engine without LoRA;
- `lora_base`: a LoRA engine with `--adapters` adapters loaded, every request on the base model;
- `lora_one`: every request on one adapter;
- `lora_mixed`: the requests spread over the adapters and the base (round robin);
- `invariant_mixed` (`--invariant`): `lora_mixed` in batch-invariant mode, for contrast.
Each case: prefill (one output token per prompt, prompt tokens/s), then `--decode-steps` decode steps of
the batch past its prompts (tokens/s; on CUDA the decode graphs); after a warm-up, `--repeats` runs with
the cases interleaved (so load changes hit them alike), medians reported, every run in the JSON. Adapters: rank `--rank` on every
default target (attention / KDA projections, MLPs, experts; `--skip-experts`: not the routed experts), random B.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lora_serving.py                 # tiny, CPU
    PYTHONPATH=. python benchmarks/lora_serving.py --model small --device cuda --batch 32 --prompt-len 512 \
        --kv-cache-memory-gib 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.lora import DEFAULT_TARGETS, LoRAAdapter
from kimiserve.sampling_params import SamplingParams


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def targets(args) -> tuple[str, ...]:
    return tuple(t for t in DEFAULT_TARGETS if not (args.skip_experts and t in ("w1", "w2", "w3")))


def build(args, lora: bool, batch_invariant: bool = False) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, batch_invariant=batch_invariant,
                                  max_model_len=args.prompt_len + args.decode_steps + 8, enable_prefix_caching=False,
                                  max_num_batched_tokens=max(2048, args.prompt_len), num_pages=args.num_pages,
                                  kv_cache_memory_gib=args.kv_cache_memory_gib, enable_lora=lora, max_loras=max(1, args.adapters), max_lora_rank=args.rank))
    if lora:
        for i in range(args.adapters):
            engine.load_lora_adapter(f"a{i}", LoRAAdapter.init(engine.model, f"a{i}", rank=args.rank, random_b=True,
                                                               seed=i, targets=targets(args)))
    return engine


def measure(args, engine: LLMEngine, prompts, names, tag: str) -> dict:
    """One timed prefill of the prompts (one token each) and `--decode-steps` decode steps of the batch."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync(args.device)
    t = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, names)):
        engine.add_request(f"{tag}p{i}", p, one, lora_name=n)
    run_to_end(engine)
    sync(args.device)
    prefill_s = time.perf_counter() - t
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=args.decode_steps + 1, ignore_eos=True)
    for i, (p, n) in enumerate(zip(prompts, names)):
        engine.add_request(f"{tag}d{i}", p, params, lora_name=n)
    while any(not engine.groups[f"{tag}d{i}"].samples[0].output_ids for i in range(len(prompts))):
        engine.step()
    sync(args.device)
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync(args.device)
    decode_s = time.perf_counter() - t
    return {"prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s, "decode_tokens_per_s": steps * len(prompts) / decode_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=None,
                        help="cache per engine (the cases' engines live at once: give it on CUDA)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (medians reported)")
    parser.add_argument("--skip-experts", action="store_true", help="adapters without the routed experts")
    parser.add_argument("--invariant", action="store_true", help="also the mixed batch in batch-invariant mode")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lora_serving_<device>.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    vocab = 768 if args.model == "tiny" else 100_000
    prompts = [torch.randint(0, vocab, (args.prompt_len,)).tolist() for _ in range(args.batch)]
    names = {"base": [None] * args.batch, "one": ["a0"] * args.batch,
             "mixed": [None if i % (args.adapters + 1) == args.adapters else f"a{i % (args.adapters + 1)}"
                       for i in range(args.batch)]}
    cases = [("no_lora", names["base"], False, False), ("lora_base", names["base"], True, False),
             ("lora_one", names["one"], True, False), ("lora_mixed", names["mixed"], True, False)]
    if args.invariant:
        cases.append(("invariant_mixed", names["mixed"], True, True))
    engines = {case: build(args, lora, invariant) for case, _, lora, invariant in cases}
    for case, case_names, _, _ in cases:  # warm-up (first-call costs; CUDA: graph capture)
        measure(args, engines[case], prompts, case_names, "warm")
    runs: dict[str, list[dict]] = {case: [] for case, *_ in cases}
    for r in range(args.repeats):  # the cases interleaved, so load changes hit them alike
        for case, case_names, _, _ in cases:
            runs[case].append(measure(args, engines[case], prompts, case_names, f"r{r}"))
    results = {}
    for case, case_names, _, _ in cases:
        graphs = engines[case].runner.graphs
        results[case] = {k: statistics.median(m[k] for m in runs[case]) for k in runs[case][0]}
        results[case]["runs"] = runs[case]
        results[case]["graph_replays"] = graphs.replays if graphs is not None else 0
        print(case, {k: round(v, 1) for k, v in results[case].items() if k != "runs"}, flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    base = results["no_lora"]
    record = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)",
        "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "command": " ".join(["python", *sys.argv]),
        "model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
        "adapters": args.adapters, "rank": args.rank, "targets": list(targets(args)), **results,
        "slowdown_vs_no_lora": {case: {"prefill": base["prefill_tokens_per_s"] / r["prefill_tokens_per_s"],
                                       "decode": base["decode_tokens_per_s"] / r["decode_tokens_per_s"]}
                                for case, r in results.items() if case != "no_lora"},
    }
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"lora_serving_{args.device.split(':')[0]}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record["slowdown_vs_no_lora"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
