"""The host's cost of a request's outputs over a long generation, by `RequestOutputKind`: CUMULATIVE copies
each request's tokens and joins its text at every step (a step's cost grows with the output so far), DELTA
reports what is new, FINAL_ONLY (`LLM.generate`) reports once, at the end. The engine runs `host_overhead.py`'s
stub forward on the CPU (zero logits, so the step is the host's work alone) with its real detokenizer.

    python3 benchmarks/output_kinds.py [--batch 64] [--tokens 2048] [--repeats 2] [--out PATH]

Prints the mean ms a step of each kind (the runs interleaved) over the whole generation and over its last
tenth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_overhead import stub_forward  # noqa: E402

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.engine.outputs import RequestOutputKind  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


def run(engine: LLMEngine, kind: RequestOutputKind, batch: int, tokens: int, tag: str) -> list[float]:
    """ms of each step of one generation of `batch` requests of `tokens` tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}{i}", [1 + i, 2, 3, 4], params, kind)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.batch < 1 or args.tokens < 16 or args.repeats < 1:
        p.error("--batch and --repeats must be >= 1 and --tokens >= 16")
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(model="tiny", dtype="float32", device="cpu", max_model_len=args.tokens + 16,
                                  max_num_seqs=args.batch, enable_prefix_caching=False, seed=0,
                                  num_pages=args.batch * (args.tokens // 8 + 12)))
    stub_forward(engine)
    rows: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for kind in RequestOutputKind:
            times = run(engine, kind, args.batch, args.tokens, f"{kind.value}{repeat}-")
            tail = times[-max(1, len(times) // 10):]
            rows.setdefault(kind.value, []).append({"steps": len(times), "mean_ms": statistics.fmean(times),
                                                    "last_tenth_mean_ms": statistics.fmean(tail)})
    print(f"batch {args.batch}, {args.tokens} tokens a request (host CPU, stub forward)")
    for kind, runs in rows.items():
        print(f"{kind:>11}: " + "  ".join(f"{r['mean_ms']:.3f} ms a step ({r['last_tenth_mean_ms']:.3f} in the "
                                          f"last tenth)" for r in runs))
    if args.out:
        result = {"device": "cpu", "torch": torch.__version__, "commit": git_commit(), "batch": args.batch,
                  "tokens": args.tokens, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"), "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
