"""The batch-invariant Triton matmul (`ops.batch_invariant.triton`) against torch's matmul (cuBLAS) on
the `small` preset's projection shapes, at decode and prefill row counts, for candidate tile configs
(the kernel's config may depend on the weight's shape, never on M; this picks them), and whether each
config gives the first rows alone the bits they get among the most rows on this device (and whether it
gives the bits of the first candidate: tiles of the same K order may or may not change them). Prints and
writes a JSON record.

    PYTHONPATH=. python benchmarks/batch_invariant_matmul.py --out benchmarks/results/batch_invariant_matmul_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kimiserve.ops.batch_invariant import triton as bi_triton

SHAPES = {"kda_qkv": (12288, 7168), "kda_o": (7168, 12288), "kda_b": (96, 7168), "mla_q_a": (1536, 7168),
          "mla_kv_a": (576, 7168), "mla_q_b": (18432, 1536), "dense_up": (33792, 7168), "dense_down": (7168, 33792),
          "shared_down": (7168, 6144), "lm_head": (163840, 7168)}
CANDIDATES = [
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 32, "BK": 64, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 32, "BK": 128, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
    {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3},
    {"BM": 64, "BN": 16, "BK": 128, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 32, "BK": 128, "num_warps": 4, "num_stages": 6},
    {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3},
    {"BM": 64, "BN": 32, "BK": 256, "num_warps": 4, "num_stages": 3},
]


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,2048,8192")
    parser.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    chosen = bi_triton.tile_config
    record = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(["python", *sys.argv]), "results": []}
    shapes = {k: v for k, v in SHAPES.items() if not args.shapes or k in args.shapes.split(",")}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        big = torch.randn(max(rows), K, device="cuda", dtype=torch.bfloat16)
        for M in rows:
            x = big[:M]
            row = {"shape": name, "M": M, "N": N, "K": K, "torch_ms": 1e3 * timed(lambda: x @ w.T), "current": chosen(N, K)}
            for i, cfg in enumerate(CANDIDATES):
                bi_triton.tile_config = lambda N, K, cfg=cfg: cfg
                row[f"config{i}_ms"] = 1e3 * timed(lambda: bi_triton.matmul(x, w, out_dtype=torch.bfloat16))
                if M == min(rows):  # the config's rows alone == among the most rows, on this device
                    y = bi_triton.matmul(x, w)
                    row[f"config{i}_invariant"] = bool(torch.equal(y, bi_triton.matmul(big, w)[:M]))
                    first = y if i == 0 else first  # whether tiles change the bits at all (same K order, other tiles)
                    row[f"config{i}_bits_of_config0"] = bool(torch.equal(y, first))
            bi_triton.tile_config = chosen
            row["chosen_ms"] = 1e3 * timed(lambda: bi_triton.matmul(x, w, out_dtype=torch.bfloat16))
            best = min(range(len(CANDIDATES)), key=lambda i: row[f"config{i}_ms"])
            row["best"] = best
            print(json.dumps(row), flush=True)
            record["results"].append(row)
    record["candidates"] = CANDIDATES
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
