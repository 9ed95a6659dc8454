"""The batch-invariant Triton matmul (`ops.batch_invariant.triton`) against torch's matmul (cuBLAS) on
the `small` preset's projection shapes (every linear of a decode step, with how many times a step runs
it), at decode and prefill row counts: the current tiles (`tile_config`), the same tiles with split-K
(`SPLIT_K_PROGRAMS`, `--split-k-programs`) in its two loop forms (`split`, `split_nested`:
`SPLIT_K_NESTED`), split-K with 128-row tiles for the wide weights (`split_bm128`), and with `--candidates` other tile configs (the kernel's
config may depend on the weight's shape, never on M; this picks them). Device time per call: a CUDA
graph of `--reps` calls replayed (no launch overhead, as in the engine's decode graphs), the weight
rotated over up to 128 copies of 256 MB in all (a decode step reads each weight once, from HBM, not L2).
Also whether the split-K rows alone have the bits they get among the most rows, and each variant's sum
over one decode step's calls (`per_step`). Prints and writes a JSON record.

    PYTHONPATH=. python benchmarks/batch_invariant_matmul.py --rows 1,4,64,2048 --split-k-programs 264 \\
        --out benchmarks/results/batch_invariant_matmul_split_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kimiserve.ops.batch_invariant import triton as bi_triton

SHAPES = {  # name: (N, K, calls in one decode step of `small`, weight dtype)
    "kda_qkvg": (12288, 7168, 26, torch.bfloat16),  # KDA q, k, v, g (6 layers) and MLA's g_proj (2)
    "kda_o": (7168, 12288, 8, torch.bfloat16),  # KDA and MLA o_proj
    "kda_b": (96, 7168, 6, torch.bfloat16),
    "kda_f_a": (128, 7168, 6, torch.bfloat16),
    "kda_f_b": (12288, 128, 6, torch.bfloat16),
    "mla_q_a": (1536, 7168, 2, torch.bfloat16),
    "mla_q_b": (18432, 1536, 2, torch.bfloat16),
    "mla_kv_a": (576, 7168, 2, torch.bfloat16),
    "mla_index_wk": (128, 7168, 2, torch.bfloat16),
    "mla_index_wq_b": (4096, 1536, 2, torch.bfloat16),
    "mla_index_weights": (32, 7168, 2, torch.bfloat16),
    "moe_router": (16, 7168, 7, torch.float32),  # fp32 x and weight: the IEEE path (cuBLAS: fp32 SGEMM)
    "moe_latent_down": (3584, 7168, 7, torch.bfloat16),
    "moe_latent_up": (7168, 3584, 7, torch.bfloat16),
    "shared_gate_up": (6144, 7168, 14, torch.bfloat16),
    "shared_down": (7168, 6144, 7, torch.bfloat16),
    "dense_gate_up": (33792, 7168, 2, torch.bfloat16),
    "dense_down": (7168, 33792, 1, torch.bfloat16),
    "lm_head": (163840, 7168, 1, torch.bfloat16),
}
"""Not here: MLA's two per-head products (batched over 96 heads, K 128 / 512: ~4 tiny calls a step) and
the routed experts' grouped matmul."""

CANDIDATES = [
    {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 32, "BK": 128, "num_warps": 4, "num_stages": 4},
    {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
    {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
    {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3},
]
"""`--candidates`: other tiles (without split-K) for the sweep."""

WIDE_ROWS = {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3}
"""Variant `split_bm128`: these tiles for weights of more than 1,024 rows, with split-K (session 5's sweep:
1.2-1.3x faster than the current tiles at 2,048 rows, slower at 4 rows without split-K). Not a library
config: `TilePlan` tiles the grouped expert matmul's rows by `CONFIG["BM"]`, so it would need its own."""


def device_ms(calls, reps: int) -> float:
    """Device ms per call of `calls[i % len(calls)]`, i < reps, captured in one CUDA graph and replayed
    (off CUDA, e.g. under Triton's interpreter to check the script: wall time of one pass)."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for i in range(reps):
            calls[i % len(calls)]()
        return 1e3 * (time.perf_counter() - t) / reps
    for fn in calls[:2]:
        fn()  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,64,2048")
    parser.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default: all)")
    parser.add_argument("--split-k-programs", type=int, default=264, help="the split variant's SPLIT_K_PROGRAMS (0: none)")
    parser.add_argument("--candidates", action="store_true", help="also time CANDIDATES (no split-K)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dev = args.device
    rows = [int(r) for r in args.rows.split(",")]
    chosen, split_programs, nested = bi_triton.tile_config, bi_triton.SPLIT_K_PROGRAMS, bi_triton.SPLIT_K_NESTED
    variants = {"current": (chosen, 0, False)}  # (tile_config, SPLIT_K_PROGRAMS, SPLIT_K_NESTED)
    if args.split_k_programs > 0:
        variants["split"] = (chosen, args.split_k_programs, False)
        variants["split_nested"] = (chosen, args.split_k_programs, True)
        variants["split_bm128"] = (lambda N, K: WIDE_ROWS if N > 1024 else chosen(N, K), args.split_k_programs, False)
    if args.candidates:
        variants.update({f"config{i}": (lambda N, K, cfg=cfg: cfg, 0, False) for i, cfg in enumerate(CANDIDATES)})
    record = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev, "date": time.strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(["python", *sys.argv]), "reps": args.reps, "results": [], "candidates": CANDIDATES}
    shapes = {k: v for k, v in SHAPES.items() if not args.shapes or k in args.shapes.split(",")}
    per_step = {M: {name: 0.0 for name in ["torch", *variants]} for M in rows}
    try:
        for name, (N, K, calls, dtype) in shapes.items():
            copies = max(1, min(128, -(-(256 << 20) // (N * K * dtype.itemsize))))
            reps = max(args.reps, copies)  # every copy read once per replay
            ws = [torch.randn(N, K, device=dev, dtype=dtype) for _ in range(copies)]
            big = torch.randn(max(rows), K, device=dev, dtype=dtype)
            for M in rows:
                x = big[:M]
                c = chosen(N, K)
                row = {"shape": name, "M": M, "N": N, "K": K, "dtype": str(dtype), "calls_per_step": calls,
                       "current": c, "torch_ms": device_ms([lambda w=w: x @ w.T for w in ws], reps)}
                for v, (config_of, programs, nest) in variants.items():
                    bi_triton.tile_config, bi_triton.SPLIT_K_PROGRAMS, bi_triton.SPLIT_K_NESTED = config_of, programs, nest
                    out = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
                    row[f"{v}_ms"] = device_ms([lambda w=w: bi_triton.matmul(x, w, out_dtype=out) for w in ws], reps)
                    if v.startswith("split"):
                        plan = bi_triton.matmul_plan(1, M, N, K, x.device)
                        row[f"{v}_chunks"], row[f"{v}_spread"] = plan.chunks, plan.spread
                        if M < max(rows):  # these rows alone == among the most rows (all chunks in one program)
                            row[f"{v}_rows_alone_equal_among_all"] = bool(torch.equal(
                                bi_triton.matmul(x, ws[0]), bi_triton.matmul(big, ws[0], spread=False)[:M]))
                    bi_triton.tile_config, bi_triton.SPLIT_K_PROGRAMS, bi_triton.SPLIT_K_NESTED = chosen, split_programs, nested
                for v in ["torch", *variants]:
                    per_step[M][v] += calls * row[f"{v}_ms"]
                print(json.dumps(row), flush=True)
                record["results"].append(row)
            del ws, big
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        bi_triton.tile_config, bi_triton.SPLIT_K_PROGRAMS, bi_triton.SPLIT_K_NESTED = chosen, split_programs, nested
    record["per_step"] = {str(M): v for M, v in per_step.items()}
    print("per decode step of `small` (ms, these shapes x their calls):", json.dumps(record["per_step"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
