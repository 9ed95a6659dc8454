"""`kimiserve` command line: inspect, make-checkpoint, generate."""

from __future__ import annotations

import argparse
import json
import sys

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


def _dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def cmd_inspect(args: argparse.Namespace) -> int:
    from kimiserve.config import resolve_model
    from kimiserve.model.inspect import format_summary, model_summary

    summary = model_summary(resolve_model(args.model))
    print(json.dumps(summary, indent=2) if args.json else format_summary(args.model, summary))
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from kimiserve.config import load_preset
    from kimiserve.model.loader import save_checkpoint
    from kimiserve.model.model import build_model
    from kimiserve.tokenizer import load_tokenizer

    config = load_preset(args.preset)
    model = build_model(config, _dtype(args.dtype), seed=args.seed)
    shards = save_checkpoint(model, args.out, max_shard_bytes=int(args.max_shard_mb * 2**20))
    load_tokenizer("tiny").save_pretrained(args.out)
    print(f"wrote {args.out}: config.json, {len(shards)} safetensors shards + index, tokenizer files")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kimiserve.generate import generate

    texts = generate(
        args.model, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        dtype=_dtype(args.dtype), chat=args.chat,
    )
    for prompt, text in zip(args.prompt, texts):
        print(f"{prompt!r} -> {text!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimiserve", description="Serve Kimi-K3.1-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="parameter counts, cache bytes per token and KDA state size of a model")
    p.add_argument("--model", required=True, help="a preset (tiny, small, kimi-k3.1-pro) or a model folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("make-checkpoint", help="write a random-weight model folder in the release format")
    p.add_argument("--preset", required=True, help="tiny, small or kimi-k3.1-pro")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the non-quantised weights")
    p.add_argument("--max-shard-mb", type=float, default=2048, help="largest safetensors shard, MiB")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("generate", help="generate text (full-sequence recompute per token until the engine lands)")
    p.add_argument("--model", default="tiny", help="a preset or a model folder (default: the built-in tiny model)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and weight seed of presets)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="compute dtype on the CPU")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kimiserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
