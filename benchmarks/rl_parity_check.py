"""Engine vs trainer logprobs, bit for bit, for the base model and a LoRA adapter (issue 20's GPU check).

An engine in batch-invariant mode samples `--num-seqs` completions (seeded, temperature 1) of
`--completion-len` tokens after random prompts of `--prompt-len` tokens, all in one batch, for the
base model and then for a random rank-8 LoRA adapter (served by name); the trainer forward
(`kimiserve.rl.PolicyTrainer`, no grad) recomputes the logprobs of the sampled tokens; the script
reports torch.equal and the largest difference for each, and writes the JSON record.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/rl_parity_check.py                     # tiny, CPU, short
    PYTHONPATH=. python benchmarks/rl_parity_check.py --model small --device cuda --prompt-len 1024 --completion-len 1024

`--fewer-kernels` runs it with `ops.batch_invariant.glue.FEWER_KERNELS` on, `--residual-epilogue` with
`glue.RESIDUAL_EPILOGUE` too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.lora import LoRAAdapter
from kimiserve.rl.trainer import PolicyTrainer
from kimiserve.sampling_params import SamplingParams


def generate(engine, prompts, params, lora_name=None):
    for i, p in enumerate(prompts):
        engine.add_request(f"{lora_name}-{i}", p, params, lora_name=lora_name)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[f"{lora_name}-{i}"].outputs[0] for i in range(len(prompts))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--completion-len", type=int, default=60)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.7,
                        help="the engine's (GPU) cache budget: the rest is left for the trainer's forward")
    parser.add_argument("--separate-kernels", action="store_true",
                        help="ops.batch_invariant.glue.FEWER_KERNELS = False (on by default since session 7)")
    parser.add_argument("--residual-epilogue", action="store_true", help="glue.RESIDUAL_EPILOGUE = True (with FEWER_KERNELS)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/rl_parity_check_<device>.json")
    args = parser.parse_args(argv)
    from kimiserve.ops.batch_invariant import glue

    if args.separate_kernels and args.residual_epilogue:
        parser.error("--residual-epilogue needs FEWER_KERNELS: leave out --separate-kernels")
    if args.separate_kernels:
        glue.FEWER_KERNELS = False
    if args.residual_epilogue:
        glue.RESIDUAL_EPILOGUE = True
    start = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, batch_invariant=True, enable_lora=True,
                                  max_lora_rank=8, kv_cache_dtype=args.kv_cache_dtype,
                                  max_model_len=args.prompt_len + args.completion_len + 8,
                                  gpu_memory_utilization=args.gpu_memory_utilization))
    vocab = engine.config.vocab_size if engine.tokenizer is None else min(engine.config.vocab_size, 768)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=args.completion_len, logprobs=0, ignore_eos=True)
    adapter = LoRAAdapter.init(engine.model, "lora", rank=8, random_b=True, seed=1)
    engine.load_lora_adapter("lora", adapter)
    trainer = PolicyTrainer.from_engine(engine, share_weights=True)
    print(f"engine and trainer built in {time.perf_counter() - start:.1f} s", flush=True)
    record = {"model": args.model, "device": args.device, "num_seqs": args.num_seqs, "prompt_len": args.prompt_len,
              "completion_len": args.completion_len, "kv_cache_dtype": engine.layout.kv_cache_dtype,
              "fewer_kernels": glue.FEWER_KERNELS, "residual_epilogue": glue.RESIDUAL_EPILOGUE,
              "command": " ".join(["python", *sys.argv])}
    for name, lora in (("base", None), ("lora", "lora")):
        t = time.perf_counter()
        outs = generate(engine, prompts, params, lora)
        engine_s = time.perf_counter() - t
        print(f"{name}: engine sampled {args.num_seqs} x {args.completion_len} tokens in {engine_s:.1f} s", flush=True)
        t = time.perf_counter()
        with torch.no_grad():
            lps = trainer.logprobs(prompts, [o.token_ids for o in outs],
                                   lora=None if lora is None else adapter.batch_for(args.num_seqs * (args.prompt_len + args.completion_len)))
        trainer_s = time.perf_counter() - t
        got = torch.cat([lp.cpu() for lp in lps])
        want = torch.tensor([lp.logprob for o in outs for lp in o.logprobs], dtype=torch.float32)
        record[name] = {"tokens": int(want.numel()), "equal": bool(torch.equal(got, want)),
                        "max_abs_diff": float((got - want).abs().max()), "engine_s": engine_s, "trainer_s": trainer_s}
        print(name, record[name], flush=True)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"rl_parity_check_{args.device.split(':')[0]}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    return 0 if record["base"]["equal"] and record["lora"]["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
