"""Issue 15's engine table from `benchmarks/e2e_step.py`'s JSON, as markdown for BENCHMARKS.md: each decode row's
step, tokens/s, experts hit, bytes, roofline and share, each prefill row's TTFT and share of the matmul rate, each
against issue 15's target where it sets one (decode >= 60% of the roofline at batch 1 and >= 50% at batch 64, prefill
>= 40% of the matmul rate), under a line naming the device, date, commit and the ceilings measured in the run.

    python3 benchmarks/e2e_table.py RESULTS.json [--commit SHA] [--write PATH]

--commit: the tree the run timed, where the device copy's git metadata was stale (the table says which commit the
JSON had); with --write PATH the JSON is written there with that commit (e.g. over benchmarks/results/e2e_step.json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

DECODE_TARGETS = {1: 0.60, 64: 0.50}  # batch -> share of the bytes roofline
PREFILL_TARGET = 0.40  # share of the measured bf16 matmul rate


def _tokens(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _context(n: int) -> str:
    return "1M" if n in (1000000, 1048576) else _tokens(n)


def _share(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.1f}%"


def _against(value: float | None, target: float | None) -> str:
    if target is None:
        return ""
    if value is None or math.isnan(value):
        return f">= {100 * target:.0f}%: not measured"
    return f">= {100 * target:.0f}%: {'met' if value >= target else 'not met'}"


def _label(row: dict) -> str:
    parts = [row[k] for k in ("moe_decode_tile", "moe_prefill_tile") if row.get(k)]
    return f" [{', '.join(parts)}]" if parts else ""


def table(result: dict, commit: str | None = None) -> str:
    """The markdown: a header line, then one table of the decode rows and one of the prefill rows (where there are
    any), in the JSON's order."""
    stated = result.get("commit", "?")
    tree = f"`{commit}` (the JSON said `{stated}`)" if commit and commit != stated else f"`{stated}`"
    lines = [f"{result.get('device', '?')}, {result.get('date', '?')}, tree {tree}; copy "
             f"{result.get('copy_gbps', float('nan')):.0f} GB/s, bf16 matmul {result.get('matmul_tflops', float('nan')):.1f}"
             f" TFLOP/s; `{result.get('command', '?')}`", ""]
    decode = [r for r in result.get("rows", []) if r.get("kind") == "decode"]
    prefill = [r for r in result.get("rows", []) if r.get("kind") == "prefill"]
    skipped = result.get("skipped", [])  # decode rows the card could not hold
    if decode or skipped:
        lines += ["| decode case | step | tok/s (per user) | experts hit | bytes | roofline | share | target |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in decode:
            lines.append(
                f"| batch {r['batch']}, {_context(r['context'])} context{_label(r)} | {r['step_ms']:.3f} ms | "
                f"{r['tokens_per_s']:.0f} ({r['tokens_per_s_per_user']:.1f}) | {r['experts_hit_per_step']:.0f} | "
                f"{r['bytes'] / 1e9:.2f} GB | {r['roofline_ms']:.3f} ms | {_share(r['roofline_fraction'])} | "
                f"{_against(r['roofline_fraction'], DECODE_TARGETS.get(r['batch']))} |")
        for r in skipped:
            lines.append(f"| batch {r['batch']}, {_context(r['context'])} context | - | - | - | - | - | - | "
                         f"skipped: {r['reason']} |")
        lines.append("")
    if prefill:
        lines += ["| prefill | TTFT | tok/s | TFLOP | share of matmul | target |", "|---|---:|---:|---:|---:|---|"]
        for r in prefill:
            lines.append(f"| one {_tokens(r['prompt_tokens'])} prompt{_label(r)} | {r['ttft_s']:.3f} s | "
                         f"{r['tokens_per_s']:.0f} | {r['flops'] / 1e12:.1f} | {_share(r['matmul_fraction'])} | "
                         f"{_against(r['matmul_fraction'], PREFILL_TARGET)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a JSON file benchmarks/e2e_step.py wrote")
    p.add_argument("--commit", help="the tree the run timed, where the JSON's commit is the device copy's stale one")
    p.add_argument("--write", help="write the JSON here, its commit replaced by --commit")
    args = p.parse_args(argv)
    try:
        with open(args.results) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"cannot read {args.results}: {e}", file=sys.stderr)
        return 2
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        print(f"{args.results} is not benchmarks/e2e_step.py's JSON (no 'rows' list)", file=sys.stderr)
        return 2
    print(table(result, args.commit))
    if args.write:
        if args.commit and args.commit != result.get("commit"):
            result = {**result, "commit": args.commit, "commit_note": f"the run's JSON said {result.get('commit')}"}
        with open(args.write, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
