"""CPU benchmark of the serving engine on the `tiny` preset, against the plain full-sequence forward.

    python benchmarks/cpu_engine.py [--threads N] [--quick] [--out PATH] [--profile]

What is measured (every figure is the median of `--repeats` timed runs, after a warm-up run):

* ceilings of this machine, measured in the same run: memory copy bandwidth (`dst.copy_(src)` of
  a large fp32 tensor; GB/s counts the bytes read plus the bytes written, as STREAM's copy does)
  and the fp32 matmul rate (an n x n @ n x n matmul, 2 n^3 flops).
* decode, batch B in (1, 16, 64): B requests of `prompt_len` random token ids (0..767), greedy,
  ignore_eos, `max_tokens = gen_len + 1`. The engine first prefills every prompt (those steps also
  sample each request's first token and are not timed); the timer then runs over the remaining
  `gen_len` steps, each of which feeds one token per request and samples the next. decode
  tokens/s = B * gen_len / (time of those steps). The script checks that the timed steps were
  exactly `gen_len` steps of B tokens each (engine.stats()).
* decode baseline: what the plain full-sequence forward costs for the same work: decode step k
  (k = 1..gen_len) recomputes the whole [B, prompt_len + k] batch, `model(ids)`, then takes the
  argmax of the last row and appends it. Running all gen_len steps at B = 64 would take minutes,
  so the forward is timed at `baseline_points` evenly spaced lengths between prompt_len + 1 and
  prompt_len + gen_len, the step time is interpolated linearly between them and summed over the
  gen_len steps. baseline tokens/s = B * gen_len / (that sum).
* prefill: a batch of prompts (8 x 512 tokens, max_num_batched_tokens 2048, so several chunked
  steps) and one 2048-token prompt, with max_tokens = 1. The timer covers add_request and the
  steps until every request is done (all prompt tokens computed and the first token sampled).
  prefill tokens/s = prompt tokens / time. Baseline: one full forward of the prompts as a
  [B, T] batch plus the argmax of the last rows.

Every timed engine run uses a fresh engine (and fresh random prompts), so no prefix-cache hit
makes it cheaper. The prefix cache itself stays on (the engine's default).

`--profile` runs the batch-64 decode phase once under cProfile instead of the benchmark and
prints the top entries inside kimiserve by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams
from kimiserve.utils.run_info import git_commit

REPO = Path(__file__).resolve().parent.parent
VOCAB_PROMPT = 768  # prompts use token ids 0..767 (the tiny tokenizer's ordinary tokens)

DEFAULT = dict(
    decode_batches=[1, 16, 64], prompt_len=32, gen_len=64, baseline_points=4,
    prefill_batch=8, prefill_len=512, prefill_single_len=2048, max_num_batched_tokens=2048,
    repeats=3, copy_mib=256, matmul_n=2048,
)
QUICK = dict(
    decode_batches=[1, 4], prompt_len=8, gen_len=4, baseline_points=2,
    prefill_batch=2, prefill_len=64, prefill_single_len=128, max_num_batched_tokens=64,
    repeats=1, copy_mib=16, matmul_n=256,
)


# machine facts -------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_dirty() -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                             capture_output=True, text=True, timeout=10)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def command_line() -> str:
    exe = Path(sys.executable)
    exe = exe.relative_to(REPO) if exe.is_relative_to(REPO) else Path(exe.name)
    return shlex.join([str(exe), *sys.argv])


# ceilings ------------------------------------------------------------------------------------
def measure_copy(mib: int, repeats: int) -> dict:
    n = mib * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: fault the pages in
    rates = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        rates.append(2 * src.numel() * 4 / dt / 1e9)
    return {"copy_gb_per_s": statistics.median(rates), "copy_gb_per_s_max": max(rates), "copy_bytes": n * 4,
            "copy_note": "dst.copy_(src), fp32; GB/s = (bytes read + bytes written) / time"}


def measure_matmul(n: int, repeats: int) -> dict:
    a, b = torch.rand(n, n), torch.rand(n, n)
    out = torch.empty(n, n)
    torch.matmul(a, b, out=out)  # warm-up
    rates = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        dt = time.perf_counter() - t0
        rates.append(2 * n**3 / dt / 1e9)
    return {"matmul_gflop_per_s": statistics.median(rates), "matmul_gflop_per_s_max": max(rates), "matmul_n": n,
            "matmul_note": "fp32 [n, n] @ [n, n]; 2 n^3 flops"}


# engine ---------------------------------------------------------------------------------------
def make_engine(max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int) -> LLMEngine:
    # enough pages that nothing is ever preempted: per sequence its attention pages, its KDA state
    # pages, the state copies made when a prompt snapshot is shared, plus the snapshots kept
    block = 64
    per_seq = -(-max_model_len // block) + 2 * 5 + 2
    num_pages = max(max_num_seqs, 8) * per_seq * 2 + 64
    return LLMEngine(EngineArgs(model="tiny", dtype="float32", kv_cache_dtype="bf16", max_model_len=max_model_len,
                                num_pages=num_pages, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens))


def random_prompts(batch: int, length: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(0, VOCAB_PROMPT, (batch, length), generator=gen).tolist()


def engine_decode_run(batch: int, prompt_len: int, gen_len: int, cfg: dict, gen: torch.Generator,
                      profiler: cProfile.Profile | None = None) -> dict:
    # the budget holds every prompt, so the prefill is one step and no step mixes the two phases
    engine = make_engine(prompt_len + gen_len + 8, max(batch, 1), max(2048, batch * prompt_len))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen_len + 1)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, gen)):
        engine.add_request(f"d{i}", prompt, params)
    # prefill: step until every prompt is computed (each request then holds its first token)
    while engine.stats()["computed_tokens"] < batch * prompt_len:
        engine.step()
    before = engine.stats()
    if before["computed_tokens"] != batch * prompt_len:
        raise RuntimeError("a prefill step also decoded: the budget mixes phases; raise max_num_batched_tokens")
    step_times = []
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - s)
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    after = engine.stats()
    steps, tokens = after["steps"] - before["steps"], after["computed_tokens"] - before["computed_tokens"]
    if steps != gen_len or tokens != batch * gen_len or after["preemptions"]:
        raise RuntimeError(f"decode phase was {steps} steps / {tokens} tokens / {after['preemptions']} preemptions, "
                           f"expected {gen_len} steps of {batch} tokens and none")
    return {"seconds": elapsed, "tokens": tokens, "median_step_s": statistics.median(step_times)}


def engine_prefill_run(batch: int, length: int, cfg: dict, gen: torch.Generator) -> dict:
    engine = make_engine(length + 8, max(batch, 1), cfg["max_num_batched_tokens"])
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    prompts = random_prompts(batch, length, gen)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - t0
    stats = engine.stats()
    if stats["computed_tokens"] != batch * length or stats["preemptions"]:
        raise RuntimeError(f"prefill computed {stats['computed_tokens']} tokens, expected {batch * length}")
    return {"seconds": elapsed, "tokens": batch * length, "steps": stats["steps"]}


# baseline -------------------------------------------------------------------------------------
def baseline_step(model, ids: torch.Tensor) -> torch.Tensor:
    """One step of generation by full recompute: forward of the whole [B, T] batch, argmax, append."""
    logits = model(ids)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat([ids, nxt], dim=1)


def time_baseline_forward(model, batch: int, length: int, gen: torch.Generator) -> float:
    ids = torch.randint(0, VOCAB_PROMPT, (batch, length), generator=gen)
    t0 = time.perf_counter()
    baseline_step(model, ids)
    return time.perf_counter() - t0


def baseline_decode_run(model, batch: int, prompt_len: int, gen_len: int, points: int, gen: torch.Generator) -> dict:
    lo, hi = prompt_len + 1, prompt_len + gen_len
    points = max(2, min(points, gen_len))
    lengths = sorted({round(lo + (hi - lo) * i / (points - 1)) for i in range(points)})
    times = [time_baseline_forward(model, batch, n, gen) for n in lengths]

    def interp(n):
        for (l0, t0), (l1, t1) in zip(zip(lengths, times), zip(lengths[1:], times[1:])):
            if l0 <= n <= l1:
                return t0 + (t1 - t0) * (n - l0) / (l1 - l0) if l1 > l0 else t0
        return times[-1]

    total = sum(interp(n) for n in range(lo, hi + 1))
    return {"seconds": total, "tokens": batch * gen_len, "lengths": lengths, "forward_s": times}


def baseline_prefill_run(model, batch: int, length: int, gen: torch.Generator) -> dict:
    prompts = random_prompts(batch, length, gen)
    t0 = time.perf_counter()
    baseline_step(model, torch.tensor(prompts))
    return {"seconds": time.perf_counter() - t0, "tokens": batch * length}


# driver ---------------------------------------------------------------------------------------
def repeat(fn, repeats: int) -> tuple[float, list[dict]]:
    """Run fn() once as a warm-up and `repeats` more times; returns (median tokens/s, timed runs)."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r["tokens"] / r["seconds"] for r in runs), runs


def entry(engine_tps: float, engine_runs: list[dict], base_tps: float, base_runs: list[dict], **extra) -> dict:
    return {**extra, "engine_tok_per_s": engine_tps, "baseline_tok_per_s": base_tps,
            "speedup": engine_tps / base_tps, "engine_runs": engine_runs, "baseline_runs": base_runs}


def run_benchmark(cfg: dict, log) -> dict:
    gen = torch.Generator().manual_seed(0)
    reps = cfg["repeats"]
    log(f"ceilings: copy {cfg['copy_mib']} MiB, matmul n={cfg['matmul_n']}")
    ceilings = {**measure_copy(cfg["copy_mib"], reps), **measure_matmul(cfg["matmul_n"], reps)}
    model = make_engine(64, 1, 64).model  # the same weights every engine loads (seed 0)

    decode = {}
    P, G = cfg["prompt_len"], cfg["gen_len"]
    for B in cfg["decode_batches"]:
        log(f"decode batch {B}: engine")
        e_tps, e_runs = repeat(lambda: engine_decode_run(B, P, G, cfg, gen), reps)
        log(f"decode batch {B}: baseline")
        b_tps, b_runs = repeat(lambda: baseline_decode_run(model, B, P, G, cfg["baseline_points"], gen), reps)
        decode[str(B)] = entry(e_tps, e_runs, b_tps, b_runs, batch=B, prompt_len=P, gen_len=G,
                               engine_median_step_ms=1e3 * statistics.median(r["median_step_s"] for r in e_runs))

    prefill = {}
    for name, B, T in (("batch", cfg["prefill_batch"], cfg["prefill_len"]), ("single", 1, cfg["prefill_single_len"])):
        log(f"prefill {name} {B}x{T}: engine")
        e_tps, e_runs = repeat(lambda: engine_prefill_run(B, T, cfg, gen), reps)
        log(f"prefill {name} {B}x{T}: baseline")
        b_tps, b_runs = repeat(lambda: baseline_prefill_run(model, B, T, gen), reps)
        prefill[name] = entry(e_tps, e_runs, b_tps, b_runs, batch=B, prompt_len=T,
                              max_num_batched_tokens=cfg["max_num_batched_tokens"],
                              engine_steps=e_runs[0]["steps"])
    return {"ceilings": ceilings, "decode": decode, "prefill": prefill}


def profile_decode(cfg: dict, batch: int, top: int = 10) -> str:
    gen = torch.Generator().manual_seed(0)
    engine_decode_run(batch, cfg["prompt_len"], min(cfg["gen_len"], 4), cfg, gen)  # warm-up
    prof = cProfile.Profile()
    res = engine_decode_run(batch, cfg["prompt_len"], cfg["gen_len"], cfg, gen, profiler=prof)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats("kimiserve", top)
    tottime = io.StringIO()
    pstats.Stats(prof, stream=tottime).sort_stats("tottime").print_stats(top)
    return (f"batch {batch} decode, {cfg['gen_len']} steps, {res['seconds']:.3f} s under the profiler\n"
            + buf.getvalue() + "\nTop by own time (all code):\n" + tottime.getvalue())


def table(results: dict) -> str:
    rows = [("case", "engine tok/s", "baseline tok/s", "speedup")]
    for B, r in results["decode"].items():
        rows.append((f"decode B={B} ({r['prompt_len']}+{r['gen_len']})", f"{r['engine_tok_per_s']:.1f}",
                     f"{r['baseline_tok_per_s']:.1f}", f"{r['speedup']:.1f}x"))
    for r in results["prefill"].values():
        rows.append((f"prefill {r['batch']}x{r['prompt_len']}", f"{r['engine_tok_per_s']:.1f}",
                     f"{r['baseline_tok_per_s']:.1f}", f"{r['speedup']:.2f}x"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    c = results["ceilings"]
    lines.append(f"ceilings: copy {c['copy_gb_per_s']:.1f} GB/s (read+write), "
                 f"fp32 matmul {c['matmul_gflop_per_s']:.1f} GFLOP/s (n={c['matmul_n']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke configuration (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="write the full results as JSON here")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median reported)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the batch-64 decode phase with cProfile instead of benchmarking")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else DEFAULT)
    if args.repeats is not None:
        cfg["repeats"] = max(1, args.repeats)

    def log(msg):
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    if args.profile:
        print(profile_decode(cfg, max(cfg["decode_batches"])))
        return 0

    load_before = os.getloadavg()
    results = run_benchmark(cfg, log)
    load_after = os.getloadavg()
    out = {
        "benchmark": "cpu_engine",
        "model": "tiny",
        "device": "cpu",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "command": command_line(),
        "quick": args.quick,
        "config": cfg,
        "dtype": "float32",
        "kv_cache_dtype": "bf16",
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "wall_seconds": time.perf_counter() - start,
        **results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        log(f"wrote {args.out}")
    if max(load_before[0], load_after[0]) > 1.5 * args.threads + 0.5:
        log(f"warning: the machine was busy (load {load_before[0]:.2f} -> {load_after[0]:.2f}); "
            "the figures may be low: run again")
    print(f"kimiserve CPU engine benchmark, tiny preset, {out['cpu_model']}, {args.threads} thread(s), "
          f"torch {out['torch_version']}, commit {out['git_commit']}")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
