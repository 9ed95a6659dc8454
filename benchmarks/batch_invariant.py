"""Throughput of batch-invariant mode against the default mode, in the same run.

For each mode an engine is built from the same weights; then
- prefill: `--batch` prompts of `--prompt-len` tokens, one output token each: prompt tokens/s;
- decode: `--batch` sequences past their prompts, `--decode-steps` pure decode steps timed: tokens/s;
- the batch-invariant engine's logprobs of one sequence alone and in the batch are compared (torch.equal),
  and the default engine's too (that they differ there is what the mode is for).
Anchors from the same run: the matrix rate of one large fp32 matmul (the device's BLAS) and the plain
torch time of the model's full-sequence forward over the prefill batch.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/batch_invariant.py            # tiny, CPU
    PYTHONPATH=. python benchmarks/batch_invariant.py --model small --device cuda --batch 16 --prompt-len 2048

On CUDA the batch-invariant engine runs split-K in its matmuls (`ops.batch_invariant.triton.SPLIT_K_PROGRAMS`,
264 by default; `--split-k-programs N` sets it while the engine is built and run) and the glue kernels
(`glue.KDA_GLUE_KERNELS`, `glue.MOE_GLUE_KERNELS`, `reference.PLAN_KERNEL_MAX_ROWS`), the defaults since session 7.
`--plain-invariant` (CUDA) adds one more engine, batch-invariant with both off (split-K 0, the torch glue:
the invariant mode of session 6), measured the same way. The invariant engine also runs `glue.FEWER_KERNELS`
(stacked projections, KDA decode from and to the state pages, ...; on since session 7): `--separate-kernels` adds
one more engine with it off; `--residual-epilogue` one more with `glue.RESIDUAL_EPILOGUE` on as well (the residual
adds in the matmuls); `--folded-casts` one more with `glue.FOLDED_CASTS` on (casts inside the kernels beside
them). `--modes a,b` runs only the listed modes (e.g. `default,batch_invariant_separate`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time

import torch

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, n: int = 2048) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    sync(device)
    t = time.perf_counter()
    reps = 5
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


@contextlib.contextmanager
def invariant_kernels(split_k_programs: int | None, glue_kernels: bool, switches: tuple[bool, bool, bool] | None = None):
    """Inside: `SPLIT_K_PROGRAMS` = split_k_programs (None: the module's) and the glue kernels on or off
    (nothing changes off CUDA: the modules are Triton's); (`glue.FEWER_KERNELS`, `glue.RESIDUAL_EPILOGUE`,
    `glue.FOLDED_CASTS`) = switches (None: the module's; any device)."""
    from kimiserve.ops.batch_invariant import glue

    before = glue.FEWER_KERNELS, glue.RESIDUAL_EPILOGUE, glue.FOLDED_CASTS
    if switches is not None:
        glue.FEWER_KERNELS, glue.RESIDUAL_EPILOGUE, glue.FOLDED_CASTS = switches
    try:
        if not torch.cuda.is_available():
            yield
            return
        with _triton_kernels(split_k_programs, glue_kernels):
            yield
    finally:
        glue.FEWER_KERNELS, glue.RESIDUAL_EPILOGUE, glue.FOLDED_CASTS = before


@contextlib.contextmanager
def _triton_kernels(split_k_programs: int | None, glue_kernels: bool):
    from kimiserve.ops.batch_invariant import glue
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.ops.batch_invariant import triton as bi_triton

    before = bi_triton.SPLIT_K_PROGRAMS, glue.KDA_GLUE_KERNELS, glue.MOE_GLUE_KERNELS, bi.PLAN_KERNEL_MAX_ROWS
    if split_k_programs is not None:
        bi_triton.SPLIT_K_PROGRAMS = split_k_programs
    if not glue_kernels:
        glue.KDA_GLUE_KERNELS, glue.MOE_GLUE_KERNELS, bi.PLAN_KERNEL_MAX_ROWS = False, False, 0
    try:
        yield
    finally:
        bi_triton.SPLIT_K_PROGRAMS, glue.KDA_GLUE_KERNELS, glue.MOE_GLUE_KERNELS, bi.PLAN_KERNEL_MAX_ROWS = before


def run_to_end(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def measure(args, batch_invariant: bool, prompts: list[list[int]]) -> dict:
    mode = "batch_invariant" if batch_invariant else "default"
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        print(f"  {mode}: {what} ({time.perf_counter() - t0:.1f} s)", flush=True)

    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, batch_invariant=batch_invariant,
                                  max_model_len=args.prompt_len + args.decode_steps + 8, enable_prefix_caching=False,
                                  max_num_batched_tokens=max(2048, args.prompt_len), num_pages=args.num_pages,
                                  kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization))
    progress("built")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    warm = SamplingParams(temperature=1.0, seed=1, max_tokens=3, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):  # warm-up: the timed prefill's and decode steps' shapes (kernels, graphs)
        engine.add_request(f"w{i}", p, warm)
    run_to_end(engine)
    sync(args.device)
    progress("warmed up")
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, one)
    run_to_end(engine)
    sync(args.device)
    prefill_s = time.perf_counter() - t
    progress(f"prefill {prefill_s:.3f} s")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=args.decode_steps + 1, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    while any(not engine.groups[f"d{i}"].samples[0].output_ids for i in range(len(prompts))):
        engine.step()  # prefill until every sequence has its first token
    sync(args.device)
    t, steps, done = time.perf_counter(), 0, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
    sync(args.device)
    decode_s = time.perf_counter() - t
    progress(f"decode {steps} steps {decode_s:.3f} s")
    engine.add_request("alone", prompts[0], params)
    alone = run_to_end(engine)["alone"].outputs[0]
    batched = done["d0"].outputs[0]
    graphs = getattr(engine.runner, "graphs", None)
    del engine
    gc.collect()  # the next engine's cache budget must not count this one's memory
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"decode_graph_replays": graphs.replays if graphs is not None else 0,"prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s, "prefill_s": prefill_s,
            "decode_tokens_per_s": steps * len(prompts) / decode_s, "decode_step_ms": 1e3 * decode_s / steps,
            "d0_alone_equals_in_batch": [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in batched.logprobs]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.7,
                        help="both engines' (GPU) cache budget: the rest is left for activations and graphs")
    parser.add_argument("--split-k-programs", type=int, default=None,
                        help="SPLIT_K_PROGRAMS of the batch-invariant engine (CUDA; default: the module's; 0: none)")
    parser.add_argument("--plain-invariant", action="store_true",
                        help="also measure batch-invariant mode without split-K and glue kernels (CUDA)")
    parser.add_argument("--separate-kernels", action="store_true",
                        help="also measure batch-invariant mode with glue.FEWER_KERNELS off")
    parser.add_argument("--residual-epilogue", action="store_true",
                        help="also measure batch-invariant mode with glue.FEWER_KERNELS and glue.RESIDUAL_EPILOGUE on")
    parser.add_argument("--folded-casts", action="store_true",
                        help="also measure batch-invariant mode with glue.FEWER_KERNELS and glue.FOLDED_CASTS on")
    parser.add_argument("--modes", default=None,
                        help="comma-separated modes to run of those the flags ask for (default: all; default is needed)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/batch_invariant_<device>.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    vocab = 768 if args.model == "tiny" else 100_000
    prompts = [torch.randint(0, vocab, (args.prompt_len,)).tolist() for _ in range(args.batch)]
    rate = matmul_rate(args.device)
    results = {}
    modes = [("default", False, None, True, None), ("batch_invariant", True, args.split_k_programs, True, None)]
    if args.plain_invariant:
        modes.append(("batch_invariant_plain", True, 0, False, (False, False, False)))
    if args.separate_kernels:
        modes.append(("batch_invariant_separate", True, args.split_k_programs, True, (False, False, False)))
    if args.residual_epilogue:
        modes.append(("batch_invariant_fewer_epilogue", True, args.split_k_programs, True, (True, True, False)))
    if args.folded_casts:
        modes.append(("batch_invariant_folded", True, args.split_k_programs, True, (True, False, True)))
    if args.modes:
        wanted = args.modes.split(",")
        unknown = sorted(set(wanted) - {m[0] for m in modes})
        if unknown or "default" not in wanted:
            parser.error(f"--modes {args.modes}: {unknown or 'default is needed'}; the flags give "
                         f"{', '.join(m[0] for m in modes)}")
        modes = [m for m in modes if m[0] in wanted]
    for mode, flag, split_programs, glue, switches in modes:
        t = time.perf_counter()
        with invariant_kernels(split_programs, glue, switches):
            results[mode] = measure(args, flag, prompts)
        print(mode, json.dumps(results[mode]), f"({time.perf_counter() - t:.1f} s with build and warm-up)", flush=True)
    d, b = results["default"], results.get("batch_invariant")
    plain = results.get("batch_invariant_plain")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    record = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)",
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "command": " ".join(["python", *sys.argv]),
        "model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
        "matmul_fp32_flops": rate, **results,
    }
    if b is not None:
        record["slowdown_prefill"] = d["prefill_tokens_per_s"] / b["prefill_tokens_per_s"]
        record["slowdown_decode"] = d["decode_tokens_per_s"] / b["decode_tokens_per_s"]
    if torch.cuda.is_available():
        from kimiserve.ops.batch_invariant import triton as bi_triton

        record["split_k_programs"] = bi_triton.SPLIT_K_PROGRAMS if args.split_k_programs is None else args.split_k_programs
    if plain is not None:
        record["slowdown_prefill_plain"] = d["prefill_tokens_per_s"] / plain["prefill_tokens_per_s"]
        record["slowdown_decode_plain"] = d["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    for mode, key in (("batch_invariant_separate", "separate"), ("batch_invariant_fewer_epilogue", "fewer_epilogue"),
                      ("batch_invariant_folded", "folded")):
        if mode in results:
            f = results[mode]
            record[f"slowdown_prefill_{key}"] = d["prefill_tokens_per_s"] / f["prefill_tokens_per_s"]
            record[f"slowdown_decode_{key}"] = d["decode_tokens_per_s"] / f["decode_tokens_per_s"]
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"batch_invariant_{args.device.split(':')[0]}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
