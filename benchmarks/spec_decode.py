"""Speculative decoding: acceptance length and tokens/s per user, speculation off beside it in the same run.

    python benchmarks/spec_decode.py [--model tiny] [--device cpu] [--batch-sizes 1,4,16] [--k 3]
                                     [--methods off,ngram,draft] [--draft-model MODEL] [--quick] [--out PATH]

One engine per method (prefix caching off) serves every run. For each prompt kind, batch size B and
method, `--repeats` times (methods interleaved; the median run is reported), the engine runs B
requests of the kind (greedy, ignore_eos, max_tokens = gen_len + 1). Under CUDA graphs an untimed run
of the same configuration first captures its graphs. Prefill steps (and the step that samples each
request's first token) are not timed; the timer runs over the remaining steps until every request
is done. `--budget-s` bounds the wall time: configurations not started by then are listed as skipped.
Kinds run in the order given, and the first configuration also pays the engines' first kernel compiles
and graph captures: name the kind that must fit a short budget first (e.g. `--kinds repetitive,demo`).
`--profile` adds, per configuration and method, untimed runs that give the device time of each graph
replay and a cProfile of the host (printed and in the JSON). The end prints a table (also in the JSON, with every run's seconds and the CUDA-graph replays of the
target's decode and verify graphs and the draft model's).
tokens/s per user = generated tokens in the timed steps / B / time; speedup = that / the same figure
with speculation off. Acceptance length = 1 + accepted drafts / verify rounds (vLLM's mean acceptance
length); `steps` counts engine steps in the timed phase.

Prompt kinds (token ids 0..767, seeded):
* repetitive: a 32-token span repeated 6 times (plus a 5-token head): the continuation is in the prompt;
* agentic: a tool-use turn as token spans: system span, a 96-token "file" returned by a tool call, a
  tool-call span, the file again with two 8-token edits, a JSON-like span repeated twice, the request;
* demo: held-out prompts of the demo corpus (kimiserve/demo/corpus.py, chat template, the demo models'
  tokenizer), word problems, tool use, arithmetic and multi-turn in turn: what kimi-demo and
  kimi-demo-draft were trained on (`--model kimi-demo --draft-model kimi-demo-draft`). Replies past
  their end (ignore_eos) continue as the model likes.
* edit: held-out file edits of the demo corpus (a settings file in the prompt, one change asked for,
  the whole file written back: 96-200 reply tokens, most of them a repeat of the prompt's file), the
  repeated spans of an agent's file rewrite in text the demo model was trained on (`--model kimi-demo`).

With random weights (the presets) the model's greedy continuation does not copy its prompt, so n-gram
drafts are rarely right; a draft model with other random weights almost never; a draft that IS the
target (the default --draft-model: the target's preset and seed) accepts every greedy draft, which
bounds what the verify path can give at this K. Trained models (the demo model) are needed for
representative acceptance. Under CUDA, verify steps replay CUDA graphs (`spec_decode.verify_graphs`)
as decode steps do, and so do the draft model's steps.

    PYTHONPATH=. python benchmarks/spec_decode.py --model small --device cuda --methods off,ngram --budget-s 150
    PYTHONPATH=. python benchmarks/spec_decode.py --model kimi-demo --device cuda --draft-model kimi-demo-draft \
        --methods off,ngram,ngram:5,draft --kinds repetitive,demo --batch-sizes 1 --repeats 1 --budget-s 130
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.gc_heap import freeze_startup_heap  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = 768


DEMO_KINDS = ("word_problem", "tool_use", "arithmetic", "multi_turn")


def demo_prompts(batch: int, seed: int) -> list[list[int]]:
    from kimiserve.demo import corpus
    from kimiserve.demo.train import TOKENIZER_DIR
    from kimiserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    rng = random.Random(20_000 + seed)  # demo_eval.py's held-out stream, not the training's
    return [corpus.prompt_ids(tokenizer, corpus.GENERATORS[DEMO_KINDS[b % len(DEMO_KINDS)]](rng)) for b in range(batch)]


def edit_prompts(batch: int, seed: int) -> list[list[int]]:
    from kimiserve.demo import corpus
    from kimiserve.demo.train import TOKENIZER_DIR
    from kimiserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER_DIR)
    rng = random.Random(20_011 + seed)  # demo_eval.py's held-out edits
    return [corpus.prompt_ids(tokenizer, corpus.edit(rng)) for _ in range(batch)]


def prompts_of(kind: str, batch: int, seed: int) -> list[list[int]]:
    if kind == "demo":
        return demo_prompts(batch, seed)
    if kind == "edit":
        return edit_prompts(batch, seed)
    out = []
    for b in range(batch):
        g = torch.Generator().manual_seed(seed * 1000 + b)
        span = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
        if kind == "repetitive":
            unit = span(32)
            out.append(span(5) + unit * 6)
        else:
            system, file, call, js, ask = span(40), span(96), span(12), span(16), span(20)
            edited = file[:30] + span(8) + file[38:70] + span(8) + file[78:]
            out.append(system + call + file + call + edited + js + js + ask)
    return out


def method_k(args, method: str) -> tuple[str, int]:
    """("off" | "ngram" | "draft", K) of a --methods entry: a name, or name:K for another K than --k; either
    with "+fewer" after it for the engine with `backend.fewer_kernel_ops` (target and draft model; a CUDA
    engine's default), "+separate" for `backend.separate_kernel_ops` (each projection apart), "+slots" for
    `backend.kda_verify_slot_ops` (the KDA verify positions in one op saving a state slot per position, the commit a
    slot copy) or "+noslots" for the per-position KDA verify and its replay."""
    name, _, k = method.partition("+")[0].partition(":")
    if name not in ("off", "ngram", "draft"):
        raise SystemExit(f"unknown method {method!r}: off, ngram or draft (optionally :K)")
    return name, 0 if name == "off" else int(k) if k else args.k


def make_engine(args, method: str) -> LLMEngine:
    spec, entry = None, method
    method, k = method_k(args, method)
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.lookup_max}
    elif method == "draft":
        spec = {"method": "draft_model", "model": args.draft_model or args.model, "num_speculative_tokens": k}
        if args.draft_seed is not None:
            spec["draft_seed"] = args.draft_seed
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                  num_pages=args.num_pages, kv_cache_memory_gib=args.kv_cache_memory_gib,
                                  enforce_eager=args.enforce_eager, enable_prefix_caching=False,
                                  speculative_config=spec))
    if entry.endswith("+fewer"):
        if not args.device.startswith("cuda"):
            if os.environ.get("KIMISERVE_TRITON_INTERPRET") != "1":
                raise SystemExit(f"{entry}: fewer_kernel_ops runs Triton kernels: --device cuda, or set "
                                 "KIMISERVE_TRITON_INTERPRET=1 for Triton's CPU interpreter")
            sys.path.insert(0, str(REPO / "tests"))
            import triton_interpreter_shims

            triton_interpreter_shims.enable()
        from kimiserve.ops.backend import fewer_kernel_ops

        use_ops(engine, fewer_kernel_ops)
    elif entry.endswith("+separate"):
        from kimiserve.ops.backend import separate_kernel_ops

        use_ops(engine, separate_kernel_ops)
    elif entry.endswith("+slots"):
        from kimiserve.ops.backend import kda_verify_slot_ops

        use_ops(engine, kda_verify_slot_ops)
    elif entry.endswith("+noslots"):
        use_ops(engine, lambda ops: dataclasses.replace(ops, kda_verify_steps=None))
    return engine


def use_ops(engine: LLMEngine, transform) -> None:
    """The target's and the draft model's runners and graph sets on `transform(ops)` (graphs captured before
    are dropped: they capture again on next use)."""
    proposer = getattr(engine, "proposer", None)
    for runner in (engine.runner, getattr(proposer, "runner", None)):
        if runner is None:
            continue
        runner.ops = transform(runner.ops)
        for kind in ("graphs", "verify_graphs"):
            graphs = getattr(runner, kind, None)
            if graphs is not None:
                graphs.release()
                graphs.ops = runner.ops
    loop = getattr(proposer, "loop_graphs", None)
    if loop is not None:
        loop.release()
        loop.ops = proposer.runner.ops


def graph_replays(engine) -> dict[str, int]:
    """CUDA-graph replays so far: the target's decode and verify graphs, the draft model's."""
    out = {}
    for name, runner in (("target", engine.runner), ("draft", getattr(engine.proposer, "runner", None))):
        for kind in ("graphs", "verify_graphs"):
            graphs = getattr(runner, kind, None) if runner is not None else None
            if graphs is not None:
                out[f"{name}_{kind}"] = graphs.replays
    loop = getattr(engine.proposer, "loop_graphs", None)
    if loop is not None:
        out["draft_loop_graphs"] = loop.replays
    return out


def run_one(args, engine: LLMEngine, kind: str, batch: int, method: str, profiler=None) -> dict:
    """One run of B requests; `profiler` (a cProfile.Profile) runs over its timed steps only."""
    params = SamplingParams(max_tokens=args.gen_len + 1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts_of(kind, batch, args.seed)):
        engine.add_request(f"{kind}-{i}", p, params)
    outputs = {}

    def step():
        for out in engine.step():
            outputs[out.request_id] = out

    while engine.has_unfinished_requests() and not (len(outputs) == batch and all(
            len(o.outputs[0].token_ids) >= 1 for o in outputs.values())):
        step()
    before = {k: len(o.outputs[0].token_ids) for k, o in outputs.items()}
    steps0, stats0, replays0 = engine.num_steps, engine.stats(), graph_replays(engine)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    while engine.has_unfinished_requests():
        step()
    sync()
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) - before[k] for k, o in outputs.items())
    stats = engine.stats()
    row = {"kind": kind, "batch": batch, "method": method, "k": method_k(args, method)[1], "seconds": elapsed,
           "generated_tokens": generated, "steps": engine.num_steps - steps0,
           "tokens_per_s_per_user": generated / batch / elapsed, "tokens_per_s": generated / elapsed,
           "graph_replays": {k: v - replays0.get(k, 0) for k, v in graph_replays(engine).items()},
           "tokens": {k: list(o.outputs[0].token_ids) for k, o in outputs.items()}}
    if method_k(args, method)[0] != "off":
        delta = lambda key: stats[key] - stats0.get(key, 0)  # noqa: E731
        drafts, accepted, drafted = (delta(f"spec_decode_num_{n}") for n in ("drafts", "accepted_tokens", "draft_tokens"))
        per_pos0 = stats0.get("spec_decode_num_accepted_tokens_per_pos") or [0] * len(stats["spec_decode_num_accepted_tokens_per_pos"])
        row.update(verify_rounds=drafts, draft_tokens=drafted, accepted_tokens=accepted,
                   acceptance_length=1 + accepted / drafts if drafts else 1.0,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   accepted_per_pos=[a - b for a, b in zip(stats["spec_decode_num_accepted_tokens_per_pos"], per_pos0)])
    engine.check_idle()
    return row


def graph_sets(engine) -> dict[str, object]:
    """The engine's CUDA graph sets by name (target decode / verify, draft decode / verify / loop)."""
    out = {}
    for name, runner in (("target", engine.runner), ("draft", getattr(engine.proposer, "runner", None))):
        for kind in ("graphs", "verify_graphs"):
            graphs = getattr(runner, kind, None) if runner is not None else None
            if graphs is not None:
                out[f"{name}_{kind}"] = graphs
    if getattr(engine.proposer, "loop_graphs", None) is not None:
        out["draft_loop_graphs"] = engine.proposer.loop_graphs
    return out


def profiled_run(args, engine: LLMEngine, kind: str, batch: int, method: str, top: int = 25) -> dict:
    """Two more runs of a configuration, not timed for the table: one with every graph replay between two
    device synchronisations (the device's time per replay, by graph: forward and KDA replay graphs apart),
    one under cProfile over its timed steps (the host's functions by own time; on CUDA the host's waits for the device show up
    in the call that waits: `tolist`, `synchronize`, a pageable `copy_`)."""
    import cProfile
    import io
    import pstats

    timed: dict[str, list[float]] = {}
    undo = []
    if engine.device.type == "cuda":
        for name, graphs in graph_sets(engine).items():
            for key, entry in graphs.graphs.items():
                for slot, graph in enumerate(e for e in entry if isinstance(e, torch.cuda.CUDAGraph)):
                    label = f"{name}{'_kda_replay' if slot else ''}"
                    original = graph.replay

                    def replay(original=original, label=label):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        original()
                        torch.cuda.synchronize()
                        timed.setdefault(label, []).append((time.perf_counter() - t) * 1e3)

                    graph.replay = replay
                    undo.append(graph)
    run_one(args, engine, kind, batch, method)
    for graph in undo:
        del graph.replay
    prof = cProfile.Profile()
    run_one(args, engine, kind, batch, method, prof)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    out = {"device_ms_per_replay": {k: {"replays": len(v), "mean_ms": sum(v) / len(v), "min_ms": min(v)}
                                    for k, v in timed.items()},
           "cprofile_top_tottime": text.getvalue()}
    if engine.device.type == "cuda":
        out["graph_kernels"] = graph_kernels(engine, batch)
        if args.trace_dir:
            out["device_idle"] = traced_run(args, engine, kind, batch, method)
    return out


def traced_run(args, engine: LLMEngine, kind: str, batch: int, method: str, gap_us: float = 10.0) -> dict:
    """One more run under torch.profiler (host Python stacks and device activity), its trace written to
    --trace-dir (gzipped): the device's busy and idle time over the whole run (prefill included; the trace has
    the steps apart), and its idle gaps over `gap_us` with the device work on either side of each."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        row = run_one(args, engine, kind, batch, method)
    os.makedirs(args.trace_dir, exist_ok=True)
    path = os.path.join(args.trace_dir, f"trace_{kind}_b{batch}_{method.replace(':', 'k').replace('+', '_')}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f:
        raw = f.read()
    os.remove(path)
    with gzip.open(path + ".gz", "wb") as g:
        g.write(raw)
    events = json.loads(raw)["traceEvents"]
    device = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not device:
        return {"trace": path + ".gz", "error": "no device events in the trace"}
    busy, gaps, end = 0.0, [], device[0][0]
    for i, (t0, t1, name) in enumerate(device):
        if t0 > end + gap_us:
            gaps.append((t0 - end, device[i - 1][2][:60] if i else "", name[:60]))
        busy += max(0.0, t1 - max(t0, end))
        end = max(end, t1)
    span = end - device[0][0]
    gaps.sort(reverse=True)
    return {"trace": path + ".gz", "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "idle_gaps_over_us": gap_us, "gaps": len(gaps), "gap_us_total": sum(g[0] for g in gaps),
            "steps": row["steps"], "largest_gaps": [{"us": g[0], "after": g[1], "before": g[2]} for g in gaps[:40]]}


def graph_kernels(engine: LLMEngine, batch: int, replays: int = 20, top: int = 12) -> dict:
    """Each captured graph of the smallest size >= `batch`, replayed alone (`replays` times, no request
    running, so it reads and writes free pages) under torch.profiler: kernels per replay, the sum of their
    durations, the replay's wall time between events, and the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, graphs in graph_sets(engine).items():
        keys = sorted(k for k in graphs.graphs if k[0] >= batch)
        if not keys:
            continue
        entry = graphs.graphs[keys[0]]
        for slot, graph in enumerate(e for e in entry if isinstance(e, torch.cuda.CUDAGraph)):
            label = f"{name}{'_kda_replay' if slot else ''}"
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
            events = prof.events()
            kernels = [(e.name, e.device_time) for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            if not kernels:  # kernels only as children of the host's launch events
                kernels = [(k.name, k.duration) for e in events for k in e.kernels]
            kernels = [(n, t) for n, t in kernels if "memcpy" not in n.lower() and "memset" not in n.lower()]
            by_name: dict[str, list[float]] = {}
            for n, t in kernels:
                by_name.setdefault(n, []).append(t)
            ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
            out[label] = {"key": list(keys[0]), "kernels_per_replay": len(kernels) / replays,
                          "kernel_us_per_replay": sum(t for _, t in kernels) / replays,
                          "wall_us_per_replay": start.elapsed_time(end) * 1e3 / replays,
                          "top": [{"name": n[:90], "per_replay": len(v) / replays, "us_per_replay": sum(v) / replays}
                                  for n, v in ranked[:top]]}
            g = out[label]
            print(f"  {label} {tuple(keys[0])}: {g['kernels_per_replay']:.0f} kernels, {g['kernel_us_per_replay']:.0f} us "
                  f"of kernels in {g['wall_us_per_replay']:.0f} us a replay", flush=True)
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'prompts':10s} {'B':>3s} {'method':7s} {'K':3s} {'tok/s/user':>10s} {'speedup':>7s} {'accept len':>10s} "
             f"{'accepted':>8s} {'steps':>5s} {'same':>5s}  graph replays"]
    for r in rows:
        spec = "acceptance_length" in r
        lines.append(f"{r['kind']:10s} {r['batch']:3d} {r['method']:7s} K={r['k']} {r['tokens_per_s_per_user']:10.1f} "
                     f"{r['speedup'] if 'speedup' in r else 1.0:6.2f}x "
                     f"{r['acceptance_length'] if spec else 1.0:10.2f} {r['acceptance_rate'] if spec else 0.0:8.0%} "
                     f"{r['steps']:5d} {str(r.get('same_tokens_as_off', '-')):>5s}  "
                     + " ".join(f"{k}={v}" for k, v in r["graph_replays"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default=None, help="default 1,4,16 (--quick: 1,2)")
    ap.add_argument("--kinds", default="repetitive,agentic")
    ap.add_argument("--methods", default="off,ngram,draft",
                    help="comma-separated: off, ngram, draft, each speculative one optionally as name:K (its K, not --k); "
                         "any of them with +fewer (e.g. off+fewer, draft:3+fewer) or +separate: that engine on "
                         "kimiserve.ops.backend.fewer_kernel_ops (a CUDA engine's default) or separate_kernel_ops "
                         "(each projection apart), interleaved with the others for an A/B")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--draft-model", default=None, help="default: the target's own preset (accepts every greedy draft)")
    ap.add_argument("--draft-seed", type=int, default=None)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=None, help="default on CUDA: 4 (per engine)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration; the median is kept")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new (prompts, batch) configuration after this many seconds (the JSON says which ran)")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 2, 8 tokens: a smoke test")
    ap.add_argument("--profile", action="store_true",
                    help="after each configuration's timed runs, per method: the device time of each graph replay and "
                         "a cProfile of one run (printed, and in the JSON; not in the table's figures)")
    ap.add_argument("--trace-dir", default=None,
                    help="with --profile on CUDA: one more run under torch.profiler per configuration and method, its "
                         "trace written here (gzipped), the device's idle gaps summarised in the JSON")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.gen_len, args.repeats = 8, 1
    args.batch_sizes = args.batch_sizes or ("1,2" if args.quick else "1,4,16")
    if args.device.startswith("cuda") and args.kv_cache_memory_gib is None and args.num_pages is None:
        args.kv_cache_memory_gib = 4.0  # the target's pool; the draft model's pool holds as many tokens
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda asked for, but CUDA is not available", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    engines = {m: make_engine(args, m) for m in methods}  # one per method, reused by every run
    build_s = time.perf_counter() - started
    freeze_startup_heap()  # as the server does once its engine is up
    rows, skipped = [], []
    for kind in args.kinds.split(","):
        for batch in batches:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                skipped.append((kind, batch))
                continue
            runs = {m: [] for m in methods}
            for m in methods:
                if engines[m].runner.graphs is not None:  # capture this configuration's graphs untimed
                    run_one(args, engines[m], kind, batch, m)
            for _ in range(args.repeats):  # methods interleaved, so a change of the machine's load hits all alike
                for m in methods:
                    runs[m].append(run_one(args, engines[m], kind, batch, m))
            base = None
            for m in methods:
                ordered = sorted(runs[m], key=lambda r: r["seconds"])
                row = ordered[len(ordered) // 2]  # the median run
                row["seconds_all"] = [r["seconds"] for r in runs[m]]
                if m == "off":
                    base = row
                elif base is not None:
                    row["speedup"] = row["tokens_per_s_per_user"] / base["tokens_per_s_per_user"]
                    row["same_tokens_as_off"] = row["tokens"] == base["tokens"]
                rows.append(row)
                extra = (f" accept len {row['acceptance_length']:.2f} ({row['acceptance_rate']:.0%}) "
                         f"speedup {row.get('speedup', float('nan')):.2f}x same={row.get('same_tokens_as_off')}"
                         if "acceptance_length" in row else "")
                print(f"{kind:10s} B={batch:3d} {m:7s} {row['tokens_per_s_per_user']:8.1f} tok/s/user "
                      f"{row['steps']:4d} steps{extra}", flush=True)
            if args.profile:
                for m, row in zip(methods, rows[-len(methods):]):
                    row["profile"] = profiled_run(args, engines[m], kind, batch, m)
                    print(f"--- profile {kind} B={batch} {m}: device ms per graph replay "
                          + json.dumps(row["profile"]["device_ms_per_replay"]), flush=True)
                    print("\n".join(row["profile"]["cprofile_top_tottime"].splitlines()[:45]), flush=True)
    for row in rows:
        row.pop("tokens")
    result = {"benchmark": "spec_decode", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "commit": git_commit(), "command": shlex.join([sys.executable, *sys.argv]),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
              or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_average_1min": [load_before, os.getloadavg()[0]], "engine_build_s": build_s,
              "wall_s": time.perf_counter() - started, "skipped_over_budget": skipped, "args": vars(args), "rows": rows}
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"spec_decode_{args.model}_{args.device.split(':')[0]}.json"
    if str(out) != "/dev/null":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['device']}, {args.model}, K={args.k}, {args.gen_len} timed tokens per request, median of "
          f"{args.repeats}; engines built in {build_s:.0f} s, {result['wall_s']:.0f} s in all"
          + (f"; over budget, not run: {skipped}" if skipped else ""))
    print(table(rows))
    if str(out) != "/dev/null":
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
