"""GRPO on the tiny model with zero rollout/trainer mismatch: 100 full-model steps and 100 LoRA steps.

Rollouts from an engine in batch-invariant mode, logprobs and updates from the trainer forward
(`kimiserve.rl`), weights (or the adapter) synced into the engine after every step. Writes the per-step
KL(rollout || trainer) and reward to benchmarks/results/rl_parity.json and, when matplotlib is
installed, a plot beside it (rl_parity.png).

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/rl_example.py [--steps 100] [--modes full,lora]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kimiserve import LLM
from kimiserve.rl.grpo import GRPOConfig, run_grpo

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def make_llm(**kwargs) -> LLM:
    return LLM("tiny", dtype="float32", kv_cache_dtype="bf16", batch_invariant=True, max_model_len=128,
               num_pages=300, **kwargs)


def run_mode(mode: str, cfg: GRPOConfig, log=print) -> list[dict]:
    if mode == "full":
        return run_grpo(make_llm(), cfg, log=log)
    if mode == "lora":
        from kimiserve.lora import LoRAAdapter

        llm = make_llm(enable_lora=True, max_lora_rank=8)
        adapter = LoRAAdapter.init(llm.engine.model, "policy", rank=8, alpha=16, seed=cfg.seed)
        llm.engine.load_lora_adapter(adapter.name, adapter)
        return run_grpo(llm, cfg, adapter=adapter, log=log)
    raise ValueError(f"mode must be full or lora, got {mode!r}")


def plot(results: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, hist in results.items():
        line, = ax_r.plot([h["step"] for h in hist], [h["reward"] for h in hist], label=mode)
        if all("expected_reward" in h for h in hist):
            ax_r.plot([h["step"] for h in hist], [h["expected_reward"] for h in hist], ls="--", color=line.get_color(),
                      label=f"{mode} (expected)")
        ax_k.plot([h["step"] for h in hist], [h["kl"] for h in hist], label=mode)
    ax_r.set(xlabel="step", ylabel="reward (target-token rate)", title="reward")
    ax_k.set(xlabel="step", ylabel="KL(rollout || trainer)", title="KL (exactly 0 at every step)")
    for ax in (ax_r, ax_k):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-2 full, 5e-2 LoRA")
    parser.add_argument("--num-prompts", type=int, default=GRPOConfig.num_prompts)
    parser.add_argument("--out", default=os.path.join(RESULTS, "rl_parity.json"))
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out's JSON, run nothing")
    args = parser.parse_args(argv)
    if args.plot_only:
        with open(args.out) as f:
            png = plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
        print(png or "matplotlib is not installed (pip install 'kimiserve[plot]')")
        return 0 if png else 1
    results = {}
    for mode in args.modes.split(","):
        lr = args.lr if args.lr is not None else (1e-2 if mode == "full" else 5e-2)
        t0 = time.perf_counter()
        results[mode] = run_mode(mode, GRPOConfig(steps=args.steps, lr=lr, num_prompts=args.num_prompts))
        print(f"{mode}: {args.steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    png = plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}" + (f" and {png}" if png else " (no plot: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
