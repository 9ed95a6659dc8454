#!/usr/bin/env python3
"""Accuracy of the trained demo model on a held-out set (the corpus generator, another seed), through the engine.

Greedy generation through `LLM` (the engine: page cache, sparse indexer, chunked prefill) for each
kv-cache dtype; the output goes through the OpenAI server's reasoning and tool-call parsers. Per kind:

  arithmetic / word_problem   final-answer exact match (the last number of the content)
  chat / multi_turn           the expected value appears in the content
  tool_call                   a call was emitted; it parses (JSON object); schema-valid (exactly the declared
                              required string arguments); correct (expected name and arguments)
  tool_answer                 the answer uses the tool result (its value appears in the content)
  no_tool / decline           no tool call and the expected content
  passkey@N                   the pass key appears in the content, N tokens of filler (trained up to ~1K)
  edit                        the content's code block is the prompt's file with the change, exactly

`--index-topk K` serves a copy of the model whose MLA indexer keeps K keys (K >= the prompt length:
dense attention), which tells indexer recall apart from length generalisation when passkeys fail.

    python benchmarks/demo_eval.py --model kimi-demo [--n 50] [--kv-cache-dtypes bf16,fp8,fp4]
        [--kinds arithmetic,word_problem] [--passkey-lengths 1024,4096,16384,65536] [--passkey-n 10 | 10,10,2,1]
        [--index-topk K] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimiserve import LLM, SamplingParams  # noqa: E402
from kimiserve.config import resolve_model_folder  # noqa: E402
from kimiserve.demo import corpus  # noqa: E402
from kimiserve.entrypoints.openai.reasoning_parser import KimiReasoningParser  # noqa: E402
from kimiserve.entrypoints.openai.tool_parser import KimiToolParser  # noqa: E402

HELDOUT_SEED_OFFSET = 20_000  # training draws from seeds < 10_000 * 1000; its own held-out from 10_007 + seed
NUMBER = re.compile(r"-?\d+")
PASSKEY_MAX_TOKENS = 32  # "The pass key is NNNNN." is ~20 tokens (digits are one token each); 16 cut keys short
KINDS = ("arithmetic", "word_problem", "chat", "multi_turn", "tool_call", "tool_answer", "no_tool", "edit")
EDIT_SEED_OFFSET = 11  # edits come from a stream of their own: the other kinds' held-out sets predate them
CODE_BLOCK = re.compile(r"```\n(.*?)\n```", re.S)


def edits(seed: int, n: int) -> list[corpus.Example]:
    rng = random.Random(HELDOUT_SEED_OFFSET + EDIT_SEED_OFFSET + seed)
    return [corpus.edit(rng) for _ in range(n)]


def heldout(seed: int, n: int, kinds=KINDS) -> list[corpus.Example]:
    """n examples of each kind in `kinds` (no_tool holds both no_tool and decline)."""
    rng = random.Random(HELDOUT_SEED_OFFSET + seed)
    want = {k: n for k in kinds if k != "edit"}
    out = []
    while any(want.values()):
        name = rng.choice([k for k, v in want.items() if v])
        gen = "tool_use" if name in ("tool_call", "tool_answer") else name
        ex = corpus.GENERATORS[gen](rng)
        kind = "no_tool" if ex.kind == "decline" else ex.kind
        if want.get(kind):
            want[kind] -= 1
            out.append(ex)
    return out + (edits(seed, n) if "edit" in kinds else [])


def passkeys(seed: int, lengths: list[int], n: int | list[int]) -> list[corpus.Example]:
    """`n` examples per length (one count, or one per length)."""
    counts = n if isinstance(n, list) else [n] * len(lengths)
    rng = random.Random(HELDOUT_SEED_OFFSET + 7 + seed)
    return [corpus.passkey(rng, length) for length, k in zip(lengths, counts) for _ in range(k)]


def schema_valid(call, tools) -> bool:
    """Arguments are a JSON object holding exactly the declared function's required string parameters."""
    spec = next((t["function"] for t in tools or [] if t["function"]["name"] == call.name), None)
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return False
    if spec is None or not isinstance(args, dict):
        return False
    params = spec["parameters"]
    return set(args) == set(params["required"]) and all(isinstance(v, str) for v in args.values())


def score(ex: corpus.Example, text: str) -> dict[str, bool]:
    reasoning, rest = KimiReasoningParser().extract(text)
    content, calls = KimiToolParser().extract(rest)
    content = content.strip()
    if ex.kind in ("arithmetic", "word_problem"):
        numbers = NUMBER.findall(content)
        return {"exact": bool(numbers) and numbers[-1] == ex.answer, "reasoned": bool(reasoning)}
    if ex.kind == "tool_call":
        call = calls[0] if calls else None
        parsed = call is not None and _json_object(call.arguments)
        valid = parsed and schema_valid(call, ex.tools)
        correct = valid and call.name == ex.expected_call["name"] and json.loads(call.arguments) == ex.expected_call["arguments"]
        return {"called": call is not None, "parsed": bool(parsed), "schema_valid": bool(valid), "correct": bool(correct)}
    if ex.kind in ("no_tool", "decline"):
        return {"no_call": not calls, "answer": not calls and ex.answer in content}
    if ex.kind == "edit":
        block = CODE_BLOCK.search(content)
        return {"exact": not calls and block is not None and block.group(1) == ex.answer}
    return {"answer": not calls and ex.answer in content}  # chat, multi_turn, tool_answer, passkey


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def run(llm: LLM, examples: list[corpus.Example], max_tokens: int, texts: list[str] | None = None) -> list[dict[str, bool]]:
    """Scores of greedy replies (appended to `texts` when given)."""
    tokenizer = llm.get_tokenizer()
    prompts = [corpus.prompt_ids(tokenizer, ex) for ex in examples]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if texts is not None:
        texts += [out.outputs[0].text for out in outs]
    return [score(ex, out.outputs[0].text) for ex, out in zip(examples, outs)]


def with_index_topk(model: str, topk: int, folder: Path) -> str:
    """A model folder like `model` (its files linked) whose config keeps `topk` indexer keys."""
    src = Path(resolve_model_folder(model))
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    if text.get("index_topk") is None:
        raise ValueError(f"{model} has no indexer")
    text["index_topk"] = topk
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def summarise(examples, scores, key=lambda ex: ex.kind) -> dict[str, dict[str, float]]:
    groups: dict[str, list[dict[str, bool]]] = {}
    for ex, s in zip(examples, scores):
        groups.setdefault(key(ex), []).append(s)
    return {k: {"n": len(v), **{m: round(sum(s[m] for s in v) / len(v), 3) for m in v[0]}} for k, v in sorted(groups.items())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the trained model folder")
    parser.add_argument("--seed", type=int, default=1, help="held-out seed (a different stream from training)")
    parser.add_argument("--n", type=int, default=50, help="examples per kind")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"held-out kinds to run (of {', '.join(KINDS)})")
    parser.add_argument("--kv-cache-dtypes", default="bf16,fp8,fp4")
    parser.add_argument("--passkey-lengths", default="1024,4096,16384,65536", help="filler tokens")
    parser.add_argument("--passkey-n", default="10", help="passkey examples per length (one count or one per length)")
    parser.add_argument("--index-topk", type=int, default=None,
                        help="serve the model with this indexer top-k (>= the prompt length: dense attention)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=None,
                        help="cache pool size (default: the engine's; on a GPU shared with another job, give one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=256, help="reply budget (the longest worked arithmetic is ~220 tokens)")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    counts = [int(x) for x in args.passkey_n.split(",")]
    if len(counts) not in (1, len(lengths)):
        raise SystemExit(f"--passkey-n: one count or one per length ({len(lengths)}), got {args.passkey_n!r}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not set(kinds) <= set(KINDS):
        raise SystemExit(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    examples = heldout(args.seed, args.n, kinds) if args.n > 0 and kinds else []
    keys = passkeys(args.seed, lengths, counts if len(counts) > 1 else counts[0])
    model = args.model
    if args.index_topk is not None:
        model = with_index_topk(model, args.index_topk, Path(tempfile.mkdtemp()) / "model")
    results = {"model": args.model, "index_topk": args.index_topk, "seed": args.seed, "dtype": args.dtype,
               "n": args.n, "kinds": list(kinds), "max_tokens": args.max_tokens, "passkey_n": dict(zip(map(str, lengths), counts * (len(lengths) if len(counts) == 1 else 1))),
               "by_cache": {}}
    for kv in args.kv_cache_dtypes.split(","):
        t0 = time.time()
        llm = LLM(model, kv_cache_dtype=kv, dtype=args.dtype, max_model_len=max(lengths + [2048]) + 1024,
                  kv_cache_memory_gib=args.kv_cache_memory_gib, **({"device": args.device} if args.device else {}))
        res = summarise(examples, run(llm, examples, args.max_tokens)) if examples else {}
        if keys:
            texts: list[str] = []
            res.update(summarise(keys, run(llm, keys, PASSKEY_MAX_TOKENS, texts), key=lambda ex: f"passkey@{ex.filler_tokens}"))
            res["passkey_replies"] = [{"filler": ex.filler_tokens, "key": ex.answer, "reply": t} for ex, t in zip(keys, texts)]
        results["by_cache"][kv] = {"seconds": round(time.time() - t0, 1), **res}
        print(json.dumps({"kv_cache_dtype": kv, **results["by_cache"][kv]}), flush=True)
        del llm
        if args.json:  # after every cache: a long run's finished parts survive
            Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
