"""Guided decoding's cost in the engine: decode tokens/s with and without a JSON-schema grammar at
batch 1 and 64, and the grammar's compile time, in the same run.

    python benchmarks/guided.py [--model tiny|small|DIR] [--device cpu|cuda] [--batches 1 64]
                                [--gen-len 64] [--repeats 3] [--quick] [--out results/guided_cpu.json]

What is measured (median of `--repeats` timed runs, each on a fresh engine, after one warm-up run):

* decode: B requests of `prompt_len` random token ids, temperature 1 with a seed per request,
  `max_tokens = gen_len + 1`. The engine first prefills every prompt (those steps also sample the
  first token and are not timed); the timer runs over the next `gen_len` steps, each feeding one
  token per request and sampling the next (checked: `gen_len` steps of B tokens). decode tokens/s =
  B x gen_len / that time. "guided" gives every request the same JSON schema (`SCHEMA`: an array of
  at least 500 nested objects with bounded numbers, enums, short strings and patterns, so no
  request can end inside the timed steps; the grammar's mask changes from token to token as the
  walk moves through keys, numbers and strings); "free" the same requests without it (ignore_eos,
  so they also run every step). slowdown = 1 - guided / free.
* compile: the schema compiled by a fresh StructuredOutputManager (`cold`, which includes building
  llguidance's view of the vocabulary the first time: `tokenizer_setup_ms` alone), again on a new
  spec of the same size (`warm`: the vocabulary view exists), and from the cache (`cached`).

Vocabulary: `tiny` has its own (1,024 ids). Presets without a tokenizer (`small`, vocab 163,840)
get a synthetic Kimi-layout one of exactly the model's vocabulary size: tiny's 768 byte-level
tokens, then distinct concatenations of two of them in a seeded order (text-like pieces a BPE
vocabulary holds), then Kimi's 256 special slots. It needs no download, so it runs on the GPU
machine; the grammar library's costs depend on the vocabulary size and the tokens' bytes, not on
the weights.
"""

from __future__ import annotations

import argparse
import gc
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimiserve.config import resolve_model  # noqa: E402
from kimiserve.engine.args import EngineArgs, tokenizer_source  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.structured_output import StructuredOutputsParams  # noqa: E402
from kimiserve.structured_output.manager import StructuredOutputManager  # noqa: E402
from kimiserve.tokenizer import load_tokenizer  # noqa: E402
from kimiserve.tokenizer.tokenizer import kimi_tokenizer_config  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"login": {"type": "string", "maxLength": 8},
                                                   "admin": {"type": "boolean"}},
                  "required": ["login"], "additionalProperties": False},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    },
    "required": ["id", "name", "status", "owner"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 500}
DEFAULT = dict(batches=[1, 64], prompt_len=32, gen_len=64, repeats=3)
QUICK = dict(batches=[1, 4], prompt_len=8, gen_len=8, repeats=1)


def synthetic_tokenizer(vocab_size: int, folder: Path):
    """A Kimi-layout tokenizer of `vocab_size` ids (see the module doc)."""
    base = load_tokenizer("tiny")
    pieces = [base.decode_token_bytes(i) for i in range(base.num_base_tokens)]
    want = vocab_size - 256
    seen, tokens = set(pieces), list(pieces)
    rng = random.Random(0)
    while len(tokens) < want:
        t = rng.choice(pieces) + rng.choice(pieces)
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    import base64

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    (folder / "tokenizer_config.json").write_text(json.dumps(kimi_tokenizer_config(len(tokens))))
    return str(folder)


def engine_for(model: str, device: str, tokenizer: str | None, max_num_seqs: int, max_model_len: int) -> LLMEngine:
    args = EngineArgs(model=model, device=device, tokenizer=tokenizer, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, seed=0, num_pages=None if device == "cuda" else 3000)
    return LLMEngine(args)


def decode_run(engine: LLMEngine, batch: int, cfg: dict, guided: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    spec = StructuredOutputsParams(json=SCHEMA) if guided else None
    for i in range(batch):
        prompt = torch.randint(0, 700, (cfg["prompt_len"],), generator=g).tolist()
        engine.add_request(f"{seed}-{i}", prompt, SamplingParams(temperature=1.0, seed=seed * 1000 + i,
                                                                 max_tokens=cfg["gen_len"] + 1, ignore_eos=not guided,
                                                                 structured_outputs=spec))
    while any(not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and compile): not timed
    sync(engine)
    steps, tokens = engine.num_steps, engine.num_computed_tokens
    t0 = time.perf_counter()
    for _ in range(cfg["gen_len"]):
        engine.step()
    sync(engine)
    seconds = time.perf_counter() - t0
    steps, tokens = engine.num_steps - steps, engine.num_computed_tokens - tokens
    if engine.scheduler.num_preemptions:
        raise RuntimeError("requests were preempted: give the engine more pages")
    if steps != cfg["gen_len"] or tokens != batch * cfg["gen_len"]:
        raise RuntimeError(f"the timed phase ran {steps} steps of {tokens} tokens, not {cfg['gen_len']} of {batch}")
    while engine.has_unfinished_requests():
        engine.step()
    failed = engine.num_failed_requests
    if failed:
        raise RuntimeError(f"{failed} requests failed")
    return {"seconds": seconds, "tokens_per_s": batch * cfg["gen_len"] / seconds}


def sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def compile_times(tokenizer, vocab_size: int, eos: int | None) -> dict:
    manager = StructuredOutputManager(tokenizer, vocab_size, eos)
    t0 = time.perf_counter()
    manager._get_backend()
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=SCHEMA))
    first = time.perf_counter() - t0
    warm = []
    for k in range(5):
        other = {**SCHEMA, "minItems": 500 + k + 1}  # another spec: not a cache hit
        t0 = time.perf_counter()
        manager.compile(StructuredOutputsParams(json=other))
        warm.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=SCHEMA))
    cached = time.perf_counter() - t0
    manager.shutdown()
    return {"tokenizer_setup_ms": setup * 1e3, "cold_ms": (setup + first) * 1e3, "first_compile_ms": first * 1e3,
            "warm_ms_median": statistics.median(warm) * 1e3, "cached_ms": cached * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--gen-len", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, one repeat")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else DEFAULT)
    for name in ("batches", "gen_len", "repeats"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    config = resolve_model(args.model)
    tokenizer_dir = None
    probe = EngineArgs(model=args.model)
    if tokenizer_source(probe) is None:
        tokenizer_dir = synthetic_tokenizer(config.vocab_size, Path(tempfile.mkdtemp()) / "synthetic_tokenizer")
    tokenizer = load_tokenizer(tokenizer_dir or tokenizer_source(probe))
    max_len = cfg["prompt_len"] + cfg["gen_len"] + 8
    results = {"compile": compile_times(tokenizer, config.vocab_size, tokenizer.eos_token_id), "decode": {}}
    print(f"compile: {json.dumps({k: round(v, 3) for k, v in results['compile'].items()})}", flush=True)
    for batch in cfg["batches"]:
        row = {}
        for guided in (False, True):
            runs = []
            for rep in range(cfg["repeats"] + 1):  # the first is a warm-up
                engine = engine_for(args.model, args.device, tokenizer_dir, max(batch, 1), max_len)
                out = decode_run(engine, batch, cfg, guided, seed=rep)
                engine.shutdown()
                del engine  # before the next engine is built: on a GPU each takes most of its memory
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                if rep:
                    runs.append(out["tokens_per_s"])
            row["guided" if guided else "free"] = {"tokens_per_s": statistics.median(runs), "runs": runs}
        row["slowdown"] = 1 - row["guided"]["tokens_per_s"] / row["free"]["tokens_per_s"]
        results["decode"][f"batch_{batch}"] = row
        print(f"batch {batch}: free {row['free']['tokens_per_s']:.1f} tok/s, guided {row['guided']['tokens_per_s']:.1f} "
              f"tok/s, slowdown {row['slowdown'] * 100:.1f}%", flush=True)
    import importlib.metadata as md

    results["meta"] = {
        "model": args.model, "device": args.device, "vocab_size": config.vocab_size,
        "tokenizer": "synthetic (see the module doc)" if tokenizer_dir else tokenizer_source(probe),
        "llguidance": md.version("llguidance"), "torch": torch.__version__, "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "commit": git_commit(), "date": datetime.date.today().isoformat(), "config": cfg,
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
