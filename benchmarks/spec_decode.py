"""Speculative decoding: acceptance length and tokens/s per user, speculation off beside it in the same run.

    python benchmarks/spec_decode.py [--model tiny] [--device cpu] [--batch-sizes 1,4,16] [--k 3]
                                     [--methods off,ngram,draft] [--draft-model MODEL] [--quick] [--out PATH]

For each prompt kind, batch size B and method, `--repeats` times (methods interleaved; the median run
is reported), a fresh engine runs B requests of the kind (greedy,
ignore_eos, max_tokens = gen_len + 1). Prefill steps (and the step that samples each request's first
token) are not timed; the timer runs over the remaining steps until every request is done.
tokens/s per user = generated tokens in the timed steps / B / time; speedup = that / the same figure
with speculation off. Acceptance length = 1 + accepted drafts / verify rounds (vLLM's mean acceptance
length); `steps` counts engine steps in the timed phase.

Prompt kinds (token ids 0..767, seeded):
* repetitive: a 32-token span repeated 6 times (plus a 5-token head): the continuation is in the prompt;
* agentic: a tool-use turn as token spans: system span, a 96-token "file" returned by a tool call, a
  tool-call span, the file again with two 8-token edits, a JSON-like span repeated twice, the request.

With random weights (the presets) the model's greedy continuation does not copy its prompt, so n-gram
drafts are rarely right; a draft model with other random weights almost never; a draft that IS the
target (the default --draft-model: the target's preset and seed) accepts every greedy draft, which
bounds what the verify path can give at this K. Trained models (the demo model) are needed for
representative acceptance. Under CUDA, verify steps run eagerly (the decode CUDA graphs cover
one-token-per-sequence steps only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = 768


def prompts_of(kind: str, batch: int, seed: int) -> list[list[int]]:
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


def run_one(args, kind: str, batch: int, method: str) -> dict:
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max}
    elif method == "draft":
        spec = {"method": "draft_model", "model": args.draft_model or args.model, "num_speculative_tokens": args.k}
        if args.draft_seed is not None:
            spec["draft_seed"] = args.draft_seed
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                  num_pages=args.num_pages, kv_cache_memory_gib=args.kv_cache_memory_gib,
                                  enforce_eager=args.enforce_eager, speculative_config=spec))
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
    steps0, stats0 = engine.num_steps, engine.stats()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        step()
    sync()
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) - before[k] for k, o in outputs.items())
    stats = engine.stats()
    row = {"kind": kind, "batch": batch, "method": method, "k": args.k if spec else 0, "seconds": elapsed,
           "generated_tokens": generated, "steps": engine.num_steps - steps0,
           "tokens_per_s_per_user": generated / batch / elapsed, "tokens_per_s": generated / elapsed,
           "tokens": {k: list(o.outputs[0].token_ids) for k, o in outputs.items()}}
    if spec:
        drafts = stats["spec_decode_num_drafts"] - stats0.get("spec_decode_num_drafts", 0)
        accepted = stats["spec_decode_num_accepted_tokens"] - stats0.get("spec_decode_num_accepted_tokens", 0)
        drafted = stats["spec_decode_num_draft_tokens"] - stats0.get("spec_decode_num_draft_tokens", 0)
        row.update(verify_rounds=drafts, draft_tokens=drafted, accepted_tokens=accepted,
                   acceptance_length=1 + accepted / drafts if drafts else 1.0,
                   acceptance_rate=accepted / drafted if drafted else 0.0,
                   accepted_per_pos=stats["spec_decode_num_accepted_tokens_per_pos"])
    engine.check_idle()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default=None, help="default 1,4,16 (--quick: 1,2)")
    ap.add_argument("--kinds", default="repetitive,agentic")
    ap.add_argument("--methods", default="off,ngram,draft")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--draft-model", default=None, help="default: the target's own preset (accepts every greedy draft)")
    ap.add_argument("--draft-seed", type=int, default=None)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (fresh engines); the median is kept")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 2, 8 tokens: a smoke test")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.gen_len, args.repeats = 8, 1
    args.batch_sizes = args.batch_sizes or ("1,2" if args.quick else "1,4,16")
    if args.device.startswith("cuda") and args.kv_cache_memory_gib is None and args.num_pages is None:
        args.kv_cache_memory_gib = 16.0  # the target's pool; the draft model's pool holds as many tokens
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda asked for, but CUDA is not available", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    load_before = os.getloadavg()[0]
    run_one(args, "repetitive", 1, "off")  # warm-up
    rows = []
    for kind in args.kinds.split(","):
        for batch in batches:
            base = None
            runs = {m: [] for m in methods}
            for _ in range(args.repeats):  # methods interleaved, so a change of the machine's load hits all alike
                for method in methods:
                    runs[method].append(run_one(args, kind, batch, method))
            for method in methods:
                ordered = sorted(runs[method], key=lambda r: r["seconds"])
                row = ordered[len(ordered) // 2]  # the median run
                row["seconds_all"] = [r["seconds"] for r in runs[method]]
                if method == "off":
                    base = row
                elif base is not None:
                    row["speedup"] = row["tokens_per_s_per_user"] / base["tokens_per_s_per_user"]
                    row["same_tokens_as_off"] = row["tokens"] == base["tokens"]
                rows.append(row)
                extra = (f" accept len {row['acceptance_length']:.2f} ({row['acceptance_rate']:.0%}) "
                         f"speedup {row.get('speedup', float('nan')):.2f}x same={row.get('same_tokens_as_off')}"
                         if "acceptance_length" in row else "")
                print(f"{kind:10s} B={batch:3d} {method:6s} {row['tokens_per_s_per_user']:8.1f} tok/s/user "
                      f"{row['steps']:4d} steps{extra}", flush=True)
    for row in rows:
        row.pop("tokens")
    result = {"benchmark": "spec_decode", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "commit": git_commit(), "command": shlex.join([sys.executable, *sys.argv]),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
              or platform.machine(), "threads": torch.get_num_threads(), "load_average_1min": [load_before, os.getloadavg()[0]],
              "args": vars(args), "rows": rows}
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"spec_decode_{args.model}_{args.device.split(':')[0]}.json"
    if str(out) != "/dev/null":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
