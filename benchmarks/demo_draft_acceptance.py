#!/usr/bin/env python3
"""Acceptance of a draft model's proposals by the demo model on held-out corpus prompts, per kind.

Greedy, through the engine with `{"method": "draft_model", ...}` speculation: for each kind of the
demo corpus (kimiserve/demo/corpus.py, held-out seed), `--n` prompts in one batch; reports the drafted
and accepted tokens, the accepted share, per-position acceptance and the mean tokens a round
(1 + K * accepted / drafted). Acceptance, not speed: `benchmarks/spec_decode.py` times speculation.

    python benchmarks/demo_draft_acceptance.py [--model kimi-demo] [--draft kimi-demo-draft] [--k 3] [--n 6]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimiserve import LLM, SamplingParams  # noqa: E402
from kimiserve.demo import corpus  # noqa: E402

KINDS = ("arithmetic", "word_problem", "tool_use", "chat", "multi_turn", "no_tool", "passkey", "edit")
HELDOUT_SEED = 20_001  # benchmarks/demo_eval.py's held-out stream (seed 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kimi-demo")
    parser.add_argument("--draft", default="kimi-demo-draft")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--n", type=int, default=6, help="prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--passkey-filler", type=int, default=900, help="passkey filler tokens (trained up to 900)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(HELDOUT_SEED)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, skip_special_tokens=False)
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    results = {"model": args.model, "draft": args.draft, "k": args.k, "n": args.n, "by_kind": {}}
    for kind in KINDS:
        llm = LLM(args.model, speculative_config=spec, max_model_len=2048, num_pages=128,
                  **({"device": args.device} if args.device else {}))
        examples = [corpus.passkey(rng, args.passkey_filler) if kind == "passkey" else corpus.GENERATORS[kind](rng)
                    for _ in range(args.n)]
        llm.generate([corpus.prompt_ids(llm.get_tokenizer(), ex) for ex in examples], params, use_tqdm=False)
        stats = llm.engine.stats()
        drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
        results["by_kind"][kind] = {"drafted": drafted, "accepted": accepted, "share": round(accepted / max(drafted, 1), 3),
                                    "per_position": stats["spec_decode_num_accepted_tokens_per_pos"],
                                    "mean_tokens_per_round": round(1 + args.k * accepted / max(drafted, 1), 2)}
        print(json.dumps({"kind": kind, **results["by_kind"][kind]}), flush=True)
        del llm
    drafted = sum(r["drafted"] for r in results["by_kind"].values())
    accepted = sum(r["accepted"] for r in results["by_kind"].values())
    results["all"] = {"drafted": drafted, "accepted": accepted, "share": round(accepted / max(drafted, 1), 3),
                      "mean_tokens_per_round": round(1 + args.k * accepted / max(drafted, 1), 2)}
    print(json.dumps({"kind": "all", **results["all"]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
