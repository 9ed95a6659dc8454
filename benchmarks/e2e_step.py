"""The whole engine's decode step and prefill (issue 15): `LLMEngine` on a preset, real scheduler,
runner, sampler and detokenizer, CUDA graphs as the engine uses them, against the bytes and FLOPs
the step must move, with the copy bandwidth and the bf16 matmul rate measured in the same run.

Decode rows: `batch` requests of `context` prompt tokens are prefilled first; then each engine step
(one token per request) is timed on its own by the host clock around `engine.step()` (the step
ends with the sampled tokens on the host, so the clock covers the GPU work). Bytes per step: every
weight the step reads (all parameters but the routed experts and the embedding table, plus one
embedding row per token) + the distinct routed experts the batch hit in each MoE layer (counted
by a hook on the routers, bytes as stored: MXFP4 codes and scales) + per sequence and MLA layer
the index keys of the whole context and the latents of the min(context, top-k) selected tokens +
per sequence and KDA layer its state page read and written. Roofline = bytes / copy bandwidth.

Prefill rows: one prompt of `prompt_tokens`, TTFT = time to its first token (chunked as the
engine's `max_num_batched_tokens` says); FLOPs = 2 x active parameters x tokens + the attention's
2 x 2 x heads x (latent 576 + 512) x min(position, top-k) per token and MLA layer;
matmul_fraction = FLOPs / TTFT / measured matmul rate.

`--moe torch` runs the plain-PyTorch routed experts (today's path before the fused kernel) for the
baseline beside it. Writes `{"device", "date", "commit", "copy_gbps", "matmul_tflops", "rows"}`.

    python benchmarks/e2e_step.py [--preset small] [--batches 1,8,64] [--contexts 4096] [--prefill 32768]
                                  [--steps 16] [--moe triton|torch] [--out PATH]
    python benchmarks/e2e_step.py --dry-run        # tiny preset on the CPU: the plumbing only
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

from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.model.inspect import count_params, index_key_bytes, kda_state_bytes_per_layer, latent_bytes  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


def copy_gbps(device) -> float:
    if device.type != "cuda":
        return float("nan")
    from kimiserve.utils.cuda_timing import cuda_time

    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() / ms / 1e6


def matmul_tflops(device) -> float:
    if device.type != "cuda":
        return float("nan")
    from kimiserve.utils.cuda_timing import cuda_time

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = cuda_time(lambda: a @ b, repeats=10)
    return 2 * 8192**3 / ms / 1e9


class ExpertsHit:
    """Counts the distinct routed experts each MoE layer's router picks, per engine step."""

    def __init__(self, model):
        self.per_step: list[int] = []
        self._current = 0
        self.handles = [m.register_forward_hook(self._hook) for n, m in model.named_modules()
                        if n.endswith("block_sparse_moe.gate")]

    def _hook(self, module, inputs, output):
        ids = output[0]
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self._current += int(torch.unique(ids).numel())

    def end_step(self) -> None:
        self.per_step.append(self._current)
        self._current = 0


def weight_bytes(model) -> tuple[int, int, int]:
    """(bytes of everything but routed experts and the embedding table, bytes of one routed expert of one
    layer, bytes of one embedding row)."""
    other, expert, row = 0, 0, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes // p.shape[0]  # stacked [E, ...]: one expert's share
        elif name.endswith("embed_tokens.weight"):
            row = p.shape[1] * p.element_size()
        else:
            other += nbytes
    num_moe = sum(1 for n, _ in model.named_modules() if n.endswith("block_sparse_moe.experts"))
    return other, expert // max(1, num_moe), row


def make_engine(args, batch: int, max_len: int) -> LLMEngine:
    device = "cpu" if args.dry_run else "cuda"
    engine_args = EngineArgs(model=args.preset, dtype="bfloat16" if not args.dry_run else "float32",
                             kv_cache_dtype=args.kv_cache_dtype, device=device, max_model_len=max_len,
                             max_num_seqs=max(batch, 1), enable_prefix_caching=False,
                             max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
                             **({"num_pages": 600} if args.dry_run else {"kv_cache_memory_gib": args.cache_gib}))
    return LLMEngine(engine_args)


def decode_row(args, engine: LLMEngine, batch: int, context: int, copy: float) -> dict:
    cfg, layout = engine.config, engine.layout
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    for i in range(batch):
        prompt = torch.randint(0, cfg.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(f"d{i}", prompt, SamplingParams(max_tokens=args.steps + 5, temperature=0, ignore_eos=True))
    while any(not g.samples[0].output_ids for g in engine.groups.values()):  # prefill
        engine.step()
    engine.step()  # the first decode step (captures the CUDA graph of this shape)
    times = []
    for _ in range(args.steps):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    # a replayed graph runs no Python: count the experts the batch hits in two eager steps
    graphs, engine.runner.graphs = engine.runner.graphs, None
    hits = ExpertsHit(engine.model)
    for _ in range(2):
        engine.step()
        hits.end_step()
    for h in hits.handles:
        h.remove()
    engine.runner.graphs = graphs
    while engine.has_unfinished_requests():
        engine.step()
    other, expert, row = weight_bytes(engine.model)
    mla, kda = len(cfg.full_attn_layers), len(cfg.kda_layers)
    ctx = context + 2 + args.steps // 2
    latent_format, key_format = layout.kv_cache_dtype.split("+")[0], layout.kv_cache_dtype.split("+")[-1]
    per_seq = mla * (ctx * index_key_bytes(cfg, key_format) +
                     min(ctx, cfg.index_topk or ctx) * latent_bytes(cfg, latent_format)) \
        + 2 * kda * kda_state_bytes_per_layer(cfg)
    experts_hit = statistics.mean(hits.per_step)
    step_bytes = other + batch * row + experts_hit * expert + batch * per_seq
    step_ms = statistics.median(times)
    roofline_ms = step_bytes / copy / 1e6
    return {"kind": "decode", "batch": batch, "context": context, "step_ms": step_ms,
            "tokens_per_s": batch / step_ms * 1e3, "tokens_per_s_per_user": 1e3 / step_ms,
            "experts_hit_per_step": experts_hit, "bytes": step_bytes, "roofline_ms": roofline_ms,
            "roofline_fraction": roofline_ms / step_ms, "step_ms_all": times, "moe": args.moe}


def prefill_row(args, engine: LLMEngine, tokens: int, matmul: float) -> dict:
    cfg = engine.config
    prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    ttft = time.perf_counter() - start
    active = count_params(cfg)["active_params"]
    k = cfg.index_topk or tokens
    attended = sum(min(p + 1, k) for p in range(tokens))
    heads = cfg.num_attention_heads
    flops = 2 * active * tokens + len(cfg.full_attn_layers) * 4 * heads * (576 + 512) * attended
    return {"kind": "prefill", "prompt_tokens": tokens, "ttft_s": ttft, "tokens_per_s": tokens / ttft,
            "flops": flops, "matmul_fraction": flops / ttft / (matmul * 1e12) if matmul == matmul else None,
            "moe": args.moe}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="4096")
    p.add_argument("--prefill", default="32768", help="prompt lengths to prefill ('' for none)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--cache-gib", type=float, default=40.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--moe", choices=("triton", "torch"), default="triton")
    p.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU, small sizes")
    p.add_argument("--out", default="benchmarks/results/e2e_step.json")
    args = p.parse_args()
    if args.moe == "torch":
        os.environ["KIMISERVE_MOE"] = "torch"
    if args.dry_run:
        args.preset, args.batches, args.contexts, args.prefill, args.steps = "tiny", "1,3", "40", "100", 3
        args.kv_cache_dtype = "bf16"
    device = torch.device("cpu" if args.dry_run else "cuda")
    copy, matmul = copy_gbps(device), matmul_tflops(device)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": datetime.date.today().isoformat(), "commit": git_commit(), "copy_gbps": copy,
              "matmul_tflops": matmul, "preset": args.preset, "kv_cache_dtype": args.kv_cache_dtype, "rows": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    contexts = [int(c) for c in args.contexts.split(",") if c]
    batches = [int(b) for b in args.batches.split(",") if b]
    for context in contexts:
        engine = make_engine(args, max(batches), context + args.steps + 8)
        for batch in batches:
            row = decode_row(args, engine, batch, context, copy)
            result["rows"].append(row)
            save()
            print(f"decode batch {batch:4d} context {context:7d}: step {row['step_ms']:8.3f} ms "
                  f"({row['tokens_per_s']:8.1f} tok/s), {row['experts_hit_per_step']:.0f} experts hit, "
                  f"roofline {row['roofline_ms']:.3f} ms = {100 * row['roofline_fraction']:.1f}%", flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for tokens in [int(t) for t in args.prefill.split(",") if t]:
        engine = make_engine(args, 1, tokens + 8)
        row = prefill_row(args, engine, tokens, matmul)
        result["rows"].append(row)
        save()
        frac = row["matmul_fraction"]
        print(f"prefill {tokens:7d} tokens: TTFT {row['ttft_s']:.3f} s ({row['tokens_per_s']:.0f} tok/s), "
              f"{'n/a' if frac is None else f'{100 * frac:.1f}%'} of the matmul rate", flush=True)
        del engine
    print(f"\n{result['device']}, commit {result['commit']}: copy {copy:.0f} GB/s, bf16 matmul {matmul:.1f} TFLOP/s, "
          f"MoE {args.moe}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
