#!/usr/bin/env python3
"""Train the kimi-demo model or its draft (seeded, wall-clock budgeted) and export it in the release format.

GPU runs (scripts/device/train_demo_v2.sh runs both in one H200 call; the shipped kimi-demo-draft is the
second's output; the shipped kimi-demo came from this script as of commit c2a0088, with the corpus and
schedule before recipe v2, `--max-minutes 7.5`: see BENCHMARKS.md):
    python scripts/train_demo.py --device cuda --model demo --out OUT/kimi-demo --max-minutes 6.3
    python scripts/train_demo.py --device cuda --model demo-draft --out OUT/kimi-demo-draft --max-minutes 2.2
CPU smoke run (about two minutes, the tiny model of the same structure):
    python scripts/train_demo.py --quick --out /tmp/kimi-demo-quick

Logs one JSON record per line to stdout (step time of the first steps, loss, token accuracy,
throughput, held-out teacher-forced exact match every minute) and writes train_log.json and
training_info.json into the model folder. See kimiserve/demo/train.py for the schedule.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # batch workers fork after the parent tokenised
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kimiserve.demo.train import TrainArgs, train  # noqa: E402
from kimiserve.utils.docs import field_docs  # noqa: E402

QUICK = dict(model="tiny", device="cpu", max_minutes=2.0, tokens_per_step=2048, max_seq_len=512, max_filler_tokens=200,
             warmup_steps=10, log_every=5, eval_every_minutes=0.75, eval_examples=24, export_every_minutes=1.0,
             num_workers=0, kda_chunk_size=32)


def parse(argv=None) -> TrainArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    docs = field_docs(TrainArgs)
    for f in dataclasses.fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=None, help=docs.get(f.name))
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], str)
            parser.add_argument(flag, type=kind, default=None, help=f"{docs.get(f.name, '')} (default {f.default})")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    base = QUICK if given.get("quick") else {}
    return TrainArgs(**{**base, **given})


def main(argv=None) -> None:
    args = parse(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu (or --quick)")
    train(args.model_config(), args, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
