"""Where speculation's greedy tokens first differ from speculation off, and whether that is a near-tie.

    python benchmarks/spec_divergence.py [--model tiny] [--device cpu] [--kind repetitive] [--batch 16] [--k 3]
                                         [--gen-len 64] [--batch-invariant] [--out PATH]

Runs the same prompts (spec_decode.py's `prompts_of`) through speculation off, n-gram (K drafts), and off
again (run-to-run determinism), greedy with logprobs=2. For each request, the first position whose tokens
differ, and there the top-2 logprob margin of each run. A margin within bf16 rounding (~1e-2) is an
expected near-tie flip (verify rows run other GEMM shapes); a large margin means a wrong state, page or row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from spec_decode import prompts_of  # noqa: E402

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


def run(args, spec, invariant: bool) -> dict[str, tuple[list[int], list]]:
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, max_model_len=1024, enable_prefix_caching=False,
                                  max_num_seqs=max(args.batch, 1), speculative_config=spec, batch_invariant=invariant,
                                  kv_cache_memory_gib=4.0 if args.device.startswith("cuda") else None))
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts_of(args.kind, args.batch, args.seed)):
        engine.add_request(f"r{i}", p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
    return outs


def margin(entry) -> float | None:
    top = entry.top if entry is not None else []
    return top[0][1] - top[1][1] if len(top) >= 2 else None


def compare(base, other) -> list[dict]:
    rows = []
    for rid, (tokens, lps) in base.items():
        o_tokens, o_lps = other[rid]
        first = next((i for i, (a, b) in enumerate(zip(tokens, o_tokens)) if a != b), None)
        if first is not None:
            rows.append({"request": rid, "position": first, "off_token": tokens[first], "other_token": o_tokens[first],
                         "off_margin": margin(lps[first]), "other_margin": margin(o_lps[first])})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kind", default="repetitive")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant", action="store_true", help="also the batch_invariant=True engines")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "args": vars(args), "modes": {}}
    for invariant in ([False, True] if args.batch_invariant else [False]):
        name = "batch_invariant" if invariant else "default"
        try:
            off, ngram, off2 = run(args, None, invariant), run(args, spec, invariant), run(args, None, invariant)
        except Exception as exc:  # noqa: BLE001 - reported: e.g. a mode speculation does not serve
            result["modes"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: raised {type(exc).__name__}: {exc}")
            continue
        mode = {"ngram_vs_off": compare(off, ngram), "off_rerun_vs_off": compare(off, off2)}
        result["modes"][name] = mode
        for key, rows in mode.items():
            print(f"{name} {key}: {len(rows)} of {args.batch} requests differ")
            for r in rows:
                print(f"  {r['request']:>4s} pos {r['position']:3d} off {r['off_token']} (margin {r['off_margin']}) "
                      f"other {r['other_token']} (margin {r['other_margin']})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
