"""PLANNING FIGURE (issue 15): one rank's decode step of Kimi-K3.1 under TP8/EP8, without communication.

The engine (`LLMEngine`: scheduler, runner, CUDA graphs, fused MoE and KDA decode kernels, fp8 cache)
runs rank 0 of the tensor_parallel_size 8 / expert-parallel layout alone (`EngineArgs.run_one_rank`):
the model is exactly that rank's shard of K3.1 with random weights (12 of the 96 KDA heads, 12 of the
96 MLA heads, experts 0-111 of 896 in MXFP4, 1/8 of the dense MLP, shared experts, latent-MoE
projections and vocabulary; router, norms, MLA/KDA down-projections and the indexer whole, as the
engine's TP replicates them), every collective replaced by a local op of its output's shape
(all-reduce: the identity; all-gather: the rank's block repeated). Routing is the real top-16 of
896: pairs routed to other ranks' experts are masked onto local expert 0 with weight 0, as the
engine's expert parallelism does today. `--index-heads` sets the indexer's heads (default 4, the
issue's per-rank count: 32 / 8; the engine's TP today replicates all 32, `--index-heads 32`).

Layers: the whole rank (93 layers: ~180 GB of MXFP4 experts) does not fit one H200, so subsets of
K3.1's own pattern run (MLA at every 4th layer and at the last one: 31 layers = 23 KDA + 8 MLA, the
full model's 69:24 exactly, and 4 layers = 3 KDA + 1 MLA; layer 0 has the dense MLP); T(n) = F + n x s
is fitted through the two subsets' step times (F: what does not scale with layers: embedding,
lm_head, sampling, host) and T(93) = F + 93 x s. Same for the bytes. Attention-residual blocks:
the subsets seal fewer of them than 93 layers do (small compute; not scaled).

Contexts are seeded from one real prefill of --source-tokens (kimiserve.bench.contexts; see
benchmarks/e2e_step.py), steps timed on their own after that. tokens/s per user = 1000 / T(93) ms:
what one rank's compute and memory traffic allow, before any communication (TP all-reduces,
all-gathers, the EP combine), which the multi-GPU work adds.

    python benchmarks/k31_rank_step.py [--batches 1,32] [--context 131072] [--layers 4,31] [--index-heads 4]
    python benchmarks/k31_rank_step.py --dry-run    # tiny-width stand-in on the CPU: the plumbing only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_step import copy_gbps, decode_row, ints, matmul_tflops, print_decode, result_header, saver  # noqa: E402

from kimiserve.config import tiny_parallel_config  # noqa: E402
from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.utils.run_info import results_path  # noqa: E402

FULL_LAYERS = 93


def mla_layers(n: int) -> list[int]:
    """K3.1's pattern cut to n layers: MLA at 3, 7, 11, ... and at the last layer (93 layers: 24 MLA)."""
    return sorted({i for i in range(n) if i % 4 == 3} | {n - 1})


def fit(t_small: float, n_small: int, t_big: float, n_big: int, n: int = FULL_LAYERS) -> tuple[float, float, float]:
    """(per-layer slope, fixed part, value at n layers) of the line through (n_small, t_small), (n_big, t_big)."""
    slope = (t_big - t_small) / (n_big - n_small)
    fixed = t_small - n_small * slope
    return slope, fixed, fixed + n * slope


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--layers", default="4,31", help="two layer counts of K3.1's pattern to fit the line through")
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--source-tokens", type=int, default=4096)
    p.add_argument("--cache-gib", type=float, default=30.0)
    p.add_argument("--dry-run", action="store_true", help="tiny widths on the CPU")
    p.add_argument("--out", default=None,
                   help="the JSON (default benchmarks/results/k31_rank_step.json; a CPU smoke run's "
                        "under the temp dir)")
    args = p.parse_args()
    args.out = args.out or results_path("k31_rank_step.json", smoke=args.dry_run)
    preset, base = "kimi-k3.1-pro", {}
    if args.dry_run:  # tiny_parallel_config: every split divides by 4
        preset, args.tp, args.context, args.steps, args.source_tokens = "tiny", 4, 300, 3, 130
        base = {k: v for k, v in tiny_parallel_config().to_dict().items() if k != "architecture"}
    device = torch.device("cpu" if args.dry_run else "cuda")
    copy, matmul = copy_gbps(device), matmul_tflops(device)
    result = result_header(device, copy, matmul, label="planning figure: one rank of TP8/EP8, no communication",
                           preset=preset, tp=args.tp, index_heads=args.index_heads, kv_cache_dtype="fp8")
    save = saver(result, args.out)
    layers, batches = ints(args.layers), ints(args.batches)
    if len(layers) != 2 or layers[0] >= layers[1]:
        raise SystemExit("--layers takes two increasing layer counts")
    for n in layers:
        overrides = {**base, "num_hidden_layers": n, "full_attn_layers": mla_layers(n), "index_n_heads": args.index_heads}
        engine = LLMEngine(EngineArgs(
            model=preset, model_overrides=overrides, tensor_parallel_size=args.tp, enable_expert_parallel=True,
            run_one_rank=True, dtype="float32" if args.dry_run else "bfloat16",
            kv_cache_dtype="bf16" if args.dry_run else "fp8", device=device.type,
            max_model_len=args.context + args.steps + 24, max_num_seqs=max(batches), enable_prefix_caching=True,
            seed=0, **({"num_pages": 3000} if args.dry_run else {"kv_cache_memory_gib": args.cache_gib})))
        for batch in batches:
            row = decode_row(engine, batch, args.context, copy, args.steps, args.source_tokens)
            row.update(layers=n, kda_layers=len(engine.config.kda_layers), mla_layers=len(engine.config.full_attn_layers))
            result["rows"].append(row)
            save()
            print_decode(row, f"{n:2d} layers ({row['kda_layers']} KDA + {row['mla_layers']} MLA): ")
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    small, big = layers
    for batch in batches:
        rows = {r["layers"]: r for r in result["rows"] if r["batch"] == batch and r.get("kind") == "decode"}
        slope, fixed, t93 = fit(rows[small]["step_ms"], small, rows[big]["step_ms"], big)
        b_slope, b_fixed, b93 = fit(rows[small]["bytes"], small, rows[big]["bytes"], big)
        scaled = {"kind": "decode_scaled", "batch": batch, "context": args.context, "layers": FULL_LAYERS,
                  "step_ms": t93, "per_layer_ms": slope, "fixed_ms": fixed, "bytes": b93,
                  "roofline_ms": b93 / copy / 1e6, "tokens_per_s_per_user": 1e3 / t93,
                  "tokens_per_s": batch * 1e3 / t93, "label": "planning figure: no communication"}
        scaled["roofline_fraction"] = scaled["roofline_ms"] / t93
        result["rows"].append(scaled)
        save()
        print(f"PLANNING FIGURE, one rank of TP{args.tp}/EP{args.tp} at {FULL_LAYERS} layers, batch {batch}, context "
              f"{args.context}: step {t93:.2f} ms ({slope:.3f} ms/layer + {fixed:.2f} ms fixed) = "
              f"{scaled['tokens_per_s_per_user']:.1f} tok/s per user without communication; bytes roofline "
              f"{scaled['roofline_ms']:.2f} ms ({100 * scaled['roofline_fraction']:.0f}%)", flush=True)
    print(f"\n{result['device']}, commit {result['commit']}: copy {copy:.0f} GB/s, bf16 matmul {matmul:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
