"""How many tokens of attention cache a fixed memory budget holds, per kv cache dtype: the real page
pool of the `kimi-k3.1-pro` preset (24 MLA layers, 69 KDA layers) allocated for bf16, fp8 and fp4
with as many pages as fit in the budget.

The pool is allocated (on CUDA when available, else on the CPU) and zeroed, so the memory is
committed, not only reserved. tokens = pages x block_size: the attention tokens of all MLA layers
the pool holds with every page an attention page. KDA state is per sequence, not per token: each
sequence also takes one state page per KDA layer out of the same pool; those are not counted in
`tokens`. `--sequences N` also reports `tokens_with_state`: the tokens left after N sequences'
state pages are reserved.

    python benchmarks/capacity.py [--budget-gb 4] [--sequences N] [--device cpu|cuda] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.cache.layout import CacheLayout  # noqa: E402
from kimiserve.cache.pool import PagePool  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

KV_CACHE_DTYPES = ("bf16", "fp8", "fp4")


def measure(config, kv: str, budget_bytes: int, sequences: int, device: str) -> dict:
    layout = CacheLayout.from_config(config, kv, torch.bfloat16)
    pages = budget_bytes // layout.page_bytes
    if pages < 1:
        raise SystemExit(f"a budget of {budget_bytes} bytes holds no {kv} page ({layout.page_bytes} bytes)")
    pool = PagePool(layout, pages, device)
    pool.data.zero_()  # touch every byte: the pages are really there
    allocated = pool.nbytes
    assert allocated <= budget_bytes and pool.num_pages == pages
    del pool
    state_pages = len(config.kda_layers) * sequences
    return dict(
        block_size=layout.block_size, page_bytes=layout.page_bytes, pages=pages, allocated_bytes=allocated,
        tokens=pages * layout.block_size,
        bytes_per_token=layout.page_bytes / layout.block_size,  # all MLA layers, with the page's padding
        cache_bytes_per_token=layout.token_bytes,  # latent + index key + scale regions only
        tokens_with_state=max(0, pages - state_pages) * layout.block_size,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=4.0, help="memory budget in GiB (2^30 bytes)")
    parser.add_argument("--sequences", type=int, default=0,
                        help="sequences whose KDA state pages (one per KDA layer) are reserved for tokens_with_state")
    parser.add_argument("--preset", default="kimi-k3.1-pro")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/capacity.json")
    args = parser.parse_args()
    config = load_preset(args.preset)
    budget = int(args.budget_gb * 2**30)
    per_kv = {}
    for kv in KV_CACHE_DTYPES:
        per_kv[kv] = measure(config, kv, budget, args.sequences, args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    tokens = {kv: r["tokens"] for kv, r in per_kv.items()}
    commit = git_commit()
    result = dict(
        budget_bytes=budget, tokens=tokens,
        ratios=dict(fp4_over_fp8=tokens["fp4"] / tokens["fp8"], fp8_over_bf16=tokens["fp8"] / tokens["bf16"],
                    fp4_over_bf16=tokens["fp4"] / tokens["bf16"]),
        per_kv_cache_dtype=per_kv, model=args.preset, num_mla_layers=len(config.full_attn_layers),
        num_kda_layers=len(config.kda_layers), sequences=args.sequences,
        state_pages_per_sequence=len(config.kda_layers),
        note=("tokens = pages * block_size with every page an attention page; each sequence's KDA state "
              "(one page per KDA layer) comes out of the same pool and is not counted there; "
              "tokens_with_state reserves `sequences` sequences' state pages"),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=commit, command=" ".join(sys.argv),
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.preset}: {budget / 2**30:g} GiB of pages on {result['device']}; tokens = pages x block_size "
          f"(KDA state pages, {len(config.kda_layers)} per sequence, not counted"
          + (f"; with state: {args.sequences} sequences' reserved" if args.sequences else "") + ")")
    print("kv     block  page MiB  pages     tokens  B/token (all layers)"
          + ("  tokens with state" if args.sequences else ""))
    for kv, r in per_kv.items():
        print(f"{kv:<5} {r['block_size']:>6} {r['page_bytes'] / 2**20:9.2f} {r['pages']:>6} {r['tokens']:>10} "
              f"{r['bytes_per_token']:21.0f}" + (f" {r['tokens_with_state']:18}" if args.sequences else ""))
    ratios = result["ratios"]
    print(f"fp4 / fp8 tokens {ratios['fp4_over_fp8']:.3f}, fp8 / bf16 {ratios['fp8_over_bf16']:.3f}, "
          f"fp4 / bf16 {ratios['fp4_over_bf16']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
