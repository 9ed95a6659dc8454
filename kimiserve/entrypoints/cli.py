"""`kimiserve` command line: inspect, plan, make-checkpoint, smooth-index-keys, generate, serve, bench serve."""

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


def cmd_plan(args: argparse.Namespace) -> int:
    from kimiserve.plan import run

    return run(args)


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


def cmd_smooth_index_keys(args: argparse.Namespace) -> int:
    import torch

    from kimiserve.config import resolve_model
    from kimiserve.engine.args import EngineArgs, tokenizer_source
    from kimiserve.model.loader import load_model, save_checkpoint
    from kimiserve.model.smoothing import smooth_index_keys
    from kimiserve.tokenizer import load_tokenizer

    config = resolve_model(args.model)
    if args.num_prompts < 1 or args.prompt_len < 1:
        raise ValueError("--num-prompts and --prompt-len must be >= 1")
    source = tokenizer_source(EngineArgs(model=args.model))
    tokenizer = load_tokenizer(source) if source else None
    if args.prompts_file:
        if tokenizer is None:
            raise ValueError(f"--prompts-file needs a tokenizer, and {args.model!r} has none")
        with open(args.prompts_file, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()]
        prompts = [torch.tensor(tokenizer.encode(t)[: args.prompt_len]) for t in texts[: args.num_prompts]]
        prompts = [p for p in prompts if p.numel()]
    else:  # random ids: fine for random-weight presets; give real text for a trained checkpoint
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=gen) for _ in range(args.num_prompts)]
    model = load_model(args.model, _dtype(args.dtype), args.seed)
    scales = smooth_index_keys(model, prompts)
    save_checkpoint(model, args.out)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
    for i, s in enumerate(scales):
        shifts = torch.log2(s)
        print(f"indexer {i}: {int((shifts != 0).sum())} of {s.numel()} key channels rescaled "
              f"(2^{int(shifts.min())} .. 2^{int(shifts.max())})")
    print(f"wrote {args.out}: index-key smoothing folded into k_norm and wq_b (scores unchanged)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kimiserve.engine.args import EngineArgs
    from kimiserve.entrypoints.llm import LLM
    from kimiserve.sampling_params import SamplingParams

    if args.stream and len(args.prompt) > 1:
        raise ValueError(f"--stream takes one prompt, got {len(args.prompt)}")
    # --seed seeds the preset weights and the engine (EngineArgs.seed) and, when sampling, each request
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed if args.temperature > 0 else None)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.dtype = DTYPES.get(engine_args.dtype, engine_args.dtype)
    engine_args.validate()
    from kimiserve.distributed.executor import run_if_worker

    code = run_if_worker(engine_args)
    if code is not None:
        return code
    llm = LLM(**vars(engine_args))
    conversations = [[{"role": "user", "content": p}] for p in args.prompt]
    if args.stream:
        prompt = args.prompt[0]
        if args.chat:
            if llm.get_tokenizer() is None:
                raise ValueError(f"model {args.model!r} has no tokenizer, which --chat needs")
            prompt = llm.get_tokenizer().apply_chat_template(conversations[0], add_generation_prompt=True)
        for out in llm.stream(prompt, params):
            print(out.outputs[0].delta_text, end="", flush=True)
        print()
        return 0
    outs = llm.chat(conversations, params) if args.chat else llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        print(f"{prompt!r} -> {out.outputs[0].text!r}")
    return 0


def _engine_args(args: argparse.Namespace):
    from kimiserve.engine.args import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.dtype = DTYPES.get(engine_args.dtype, engine_args.dtype)
    return engine_args


def cmd_serve(args: argparse.Namespace) -> int:
    from kimiserve.config import DEFAULT_MODEL
    from kimiserve.entrypoints.openai.api_server import run_server
    from kimiserve.entrypoints.openai.server_args import ServerArgs

    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise ValueError(f"model given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    engine_args = _engine_args(args)
    engine_args.validate()
    server_args = ServerArgs.from_cli_args(args)
    server_args.validate()
    from kimiserve.distributed.executor import run_if_worker

    code = run_if_worker(engine_args)  # another node's ranks, or a torchrun rank > 0: no API server
    if code is not None:
        return code
    _leave_a_core_to_the_server(engine_args)
    return run_server(engine_args, server_args)


def _leave_a_core_to_the_server(engine_args) -> None:
    """On the CPU, the engine's torch threads and the HTTP event loop share the cores: unless
    OMP_NUM_THREADS says otherwise, torch gets all but one (1.8x the throughput of torch taking every
    core, with 2 cores and the load generator beside it; BENCHMARKS.md)."""
    import os

    import torch

    if engine_args.resolved_device().type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from kimiserve.bench.serve import main as bench_main

    return bench_main(args) or 0


def _add_serve_parser(sub) -> None:
    from kimiserve.engine.args import EngineArgs
    from kimiserve.entrypoints.openai.server_args import ServerArgs

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (like `vllm serve`)",
                       description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                                   "/v1/chat/completions, /v1/responses, /v1/messages (Anthropic), /v1/models, "
                                   "/tokenize, /detokenize, /health, /ping, /metrics, /reset_prefix_cache.")
    p.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    ServerArgs.add_cli_args(p.add_argument_group("server arguments (ServerArgs)"))
    p.add_argument("--dtype", default="auto", help="model dtype: fp32/float32, bf16/bfloat16 or auto "
                   "(bfloat16 on GPU, float32 on CPU)")
    EngineArgs.add_cli_args(p.add_argument_group("engine arguments (EngineArgs)"), skip=("dtype",))
    p.set_defaults(func=cmd_serve)


def _add_bench_parser(sub, load: bool) -> None:
    p = sub.add_parser("bench", help="benchmarks against a running server")
    bench = p.add_subparsers(dest="bench_command", required=True)
    serve = bench.add_parser("serve", help="load a running server with streaming requests and report "
                                           "throughput and latencies")
    if load:  # the bench module is only imported when a bench command runs
        from kimiserve.bench.serve import add_cli_arguments

        add_cli_arguments(serve)
    serve.set_defaults(func=cmd_bench_serve)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    from kimiserve.engine.args import EngineArgs

    parser = argparse.ArgumentParser(prog="kimiserve", description="Serve Kimi-K3.1-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="parameter counts, cache bytes per token and KDA state size of a model")
    p.add_argument("--model", default="kimi-demo",
                   help="a preset (kimi-demo, tiny, small, kimi-k3.1-pro) or a model folder (default kimi-demo)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_inspect)

    from kimiserve.plan import add_cli_args as add_plan_args

    p = sub.add_parser("plan", help="capacity planner: how many full contexts fit on N GPUs, arithmetic shown",
                       description="Weights, KDA state and cache per GPU under tp or dcp, and how many contexts "
                                   "of --context tokens fit, with each number's formula.")
    add_plan_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("make-checkpoint", help="write a random-weight model folder in the release format")
    p.add_argument("--preset", required=True, choices=("tiny", "small", "kimi-k3.1-pro"), help="a random-weight preset")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the non-quantised weights")
    p.add_argument("--max-shard-mb", type=float, default=2048, help="largest safetensors shard, MiB")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("smooth-index-keys", help="fold per-channel index-key smoothing into a checkpoint "
                       "(better fp4 index keys; scores unchanged)",
                       description="Calibrate power-of-two per-channel scales of the indexer's keys on prompts "
                                   "and fold them into k_norm (divided) and wq_b (multiplied): an exact change "
                                   "of basis that keeps every score, so fp4 (MXFP4) index keys lose less to "
                                   "outlier channels. Writes a new model folder.")
    p.add_argument("--model", required=True, help="a preset or a model folder")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--prompts-file", default=None, help="calibration text, one prompt per line (default: random ids)")
    p.add_argument("--num-prompts", type=int, default=8, help="calibration prompts")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per calibration prompt (longer ones are cut)")
    p.add_argument("--seed", type=int, default=0, help="seed of preset weights and of random prompts")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the non-quantised weights")
    p.set_defaults(func=cmd_smooth_index_keys)

    p = sub.add_parser("generate", help="generate text with the engine (the offline LLM API)",
                       description="Generate a completion for each prompt; engine flags follow the sampling flags.")
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="softmax temperature; 0 for greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="keep the k best tokens; 0 or -1 disables it")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the preset weights and of the engine, and of each request's sampling when "
                        "--temperature > 0")
    p.add_argument("--dtype", default="auto", help="model dtype: fp32/float32, bf16/bfloat16 or auto "
                   "(bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt)")
    EngineArgs.add_cli_args(p.add_argument_group("engine arguments (EngineArgs)"), skip=("seed", "dtype"))
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    p.set_defaults(func=cmd_generate)

    _add_serve_parser(sub)
    _add_bench_parser(sub, load=bool(argv) and argv[0] == "bench")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kimiserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
