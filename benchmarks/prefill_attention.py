"""One MLA layer's attention for one row step of a long prefill chunk on the GPU, piece by piece and
tiling by tiling: the index scan (decode kernel, one row per program, vs the query-tiled prefill
kernel), the top-k, sparse MLA (the decode kernel's default vs `paged_sparse_mla_prefill` under
several tilings) and the query absorption (the per-head fp32 kernel vs one bf16 batched matmul).

The case is what `MLAAttention.attend_chunk` runs at the end of a prompt of `context` tokens: the
`small` preset's widths (96 heads, latent 512 + 64, 32 index heads x 128, top-2048), the engine's page
layout in --kv-cache-dtype, one sequence in scattered pages with random contents, and the chunk's
last `rows` query rows (default: the engine's step, PREFILL_SCORE_BYTES / (4 x context)). FLOPs: scan
2 x 32 x 128 per (row, visible key); sparse MLA 2 x 96 x (576 + 512) per (row, selected token);
absorption 2 x 96 x 128 x 512 per row. Times: CUDA events, median of --repeats eager calls.

    python benchmarks/prefill_attention.py [--contexts 32768,131072] [--kv-cache-dtype fp8] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_attention import build_case  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.model.mla import PREFILL_SCORE_BYTES  # noqa: E402
from kimiserve.utils.cuda_timing import cuda_time, wall_time  # noqa: E402
from kimiserve.utils.run_info import git_commit, results_path  # noqa: E402

# (block_h, block_n, num_warps, num_stages, reload) tilings of the sparse kernel tried at prefill shapes
# (128-head blocks on 16 warps do not compile for sm_90: ptxas needs ~158 registers a thread, 16 warps allow 128)
SPARSE_TILINGS = [(32, 64, 8, 1, True), (64, 64, 8, 1, True), (64, 64, 8, 1, False), (64, 64, 8, 2, False),
                  (64, 32, 4, 2, False), (64, 32, 8, 2, True), (64, 128, 8, 1, True), (32, 64, 4, 2, False),
                  (32, 64, 8, 2, True)]
# (block_q, tiles, num_warps, num_stages) of the prefill scan
SCAN_TILINGS = [(2, 8, 4, 2), (4, 8, 4, 2), (8, 8, 4, 2), (4, 16, 4, 3), (8, 4, 8, 2)]


def run_case(config, context: int, rows: int, kv: str, repeats: int, device: str = "cuda") -> dict:
    from kimiserve.ops.indexer.triton import paged_indexer_scores
    from kimiserve.ops.indexer.triton_prefill import prefill_indexer_scores
    from kimiserve.ops.mla.head_matmul_triton import head_matmul
    from kimiserve.ops.mla.triton import DecodeConfig, paged_sparse_mla_decode, paged_sparse_mla_prefill
    from kimiserve.ops.topk.triton import topk_indices

    c = build_case(config, 1, context, kv=kv, device=device)
    pool, table = c["pool"], c["tables"][0]
    g = torch.Generator(device=device).manual_seed(1)
    H, L, R = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    Hi, D, k = config.index_n_heads, config.index_head_dim, config.index_topk
    n = min(rows, context)
    randn = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    lens = torch.arange(context - n + 1, context + 1, device=device)
    iq, iw = randn(n, Hi, D).bfloat16(), randn(n, Hi) * Hi ** -0.5
    q_lat, q_pe = (randn(n, H, L) * 0.05).bfloat16(), randn(n, H, R).bfloat16()
    keys, key_scales, latents, ls = pool.index_key[0], pool.index_scale[0], pool.latent[0], pool.latent_scales[0]
    rot, bf16 = c["rotation"], torch.bfloat16
    time = (lambda fn: cuda_time(fn, repeats=repeats, warmup=2)) if device == "cuda" else \
        (lambda fn: wall_time(fn, repeats=1, warmup=0))
    scan_flops = 2 * Hi * D * int(lens.sum())
    sel = lens.clamp(max=k)
    sparse_flops = 2 * H * (L + R + L) * int(sel.sum())
    row = dict(context=context, rows=n, kv_cache_dtype=kv, scan_flops=scan_flops, sparse_flops=sparse_flops)

    def scan_decode():
        return paged_indexer_scores(iq, iw, keys, key_scales, table.expand(n, -1), lens, bf16, context, rotation=rot)

    ref_scores = scan_decode()
    row["scan_decode_ms"] = time(scan_decode)
    row["scan"] = []
    for bq, tiles, warps, stages in SCAN_TILINGS:
        fn = lambda: prefill_indexer_scores(iq, iw, keys, key_scales, table, lens, bf16, context, rotation=rot,  # noqa: E731
                                            block_q=bq, tiles=tiles, num_warps=warps, num_stages=stages)
        try:
            got = fn()
            ok = torch.equal(torch.isinf(got), torch.isinf(ref_scores))
            fin = torch.isfinite(ref_scores)
            err = float((got[fin] - ref_scores[fin]).norm() / ref_scores[fin].norm())
            row["scan"].append(dict(block_q=bq, tiles=tiles, num_warps=warps, num_stages=stages, ms=time(fn),
                                    rel_err=err, same_mask=ok))
        except Exception as e:  # a tiling that does not compile: recorded, the others still run
            row["scan"].append(dict(block_q=bq, tiles=tiles, num_warps=warps, num_stages=stages, error=repr(e)[:300]))
    idx = topk_indices(ref_scores, k, lens)
    row["topk_ms"] = time(lambda: topk_indices(ref_scores, k, lens))

    tables = table.expand(n, -1)
    ref_out = paged_sparse_mla_decode(q_lat, q_pe, latents, ls, tables, idx, c["scale"], bf16)
    row["sparse_decode_default_ms"] = time(lambda: paged_sparse_mla_decode(q_lat, q_pe, latents, ls, tables, idx,
                                                                           c["scale"], bf16))
    row["sparse"] = []
    for bh, bn, warps, stages, reload in SPARSE_TILINGS:
        cfg = DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages, reload=reload)
        fn = lambda: paged_sparse_mla_prefill(q_lat, q_pe, latents, ls, table, idx, c["scale"], bf16, config=cfg)  # noqa: E731
        try:
            got = fn().float()
            err = float((got - ref_out).norm() / ref_out.norm())
            row["sparse"].append(dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages, reload=reload,
                                      ms=time(fn), rel_err=err))
        except Exception as e:
            row["sparse"].append(dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages, reload=reload,
                                      error=repr(e)[:300]))
    row["sparse_prefill_default_ms"] = time(lambda: paged_sparse_mla_prefill(q_lat, q_pe, latents, ls, table, idx,
                                                                             c["scale"], bf16))
    q_nope = randn(n, H, config.qk_nope_head_dim).bfloat16()
    w_kc = (randn(H, config.qk_nope_head_dim, L) * 0.05).bfloat16()
    row["absorb_flops"] = 2 * n * H * config.qk_nope_head_dim * L
    row["absorb_head_matmul_ms"] = time(lambda: head_matmul(q_nope, w_kc))
    row["absorb_bf16_matmul_ms"] = time(lambda: torch.matmul(q_nope.transpose(0, 1), w_kc).transpose(0, 1))
    del pool, c
    torch.cuda.empty_cache()
    return row


def tflops(flops: int, ms: float) -> float:
    return flops / ms / 1e9


def print_row(r: dict) -> None:
    print(f"\ncontext {r['context']}, {r['rows']} rows, {r['kv_cache_dtype']}:")
    print(f"  scan decode kernel   {r['scan_decode_ms']:8.3f} ms  {tflops(r['scan_flops'], r['scan_decode_ms']):6.1f} TFLOP/s")
    for s in r["scan"]:
        tag = f"  scan prefill q{s['block_q']} t{s['tiles']} w{s['num_warps']} s{s['num_stages']}"
        print(f"{tag:22s} " + (f"{s['ms']:8.3f} ms  {tflops(r['scan_flops'], s['ms']):6.1f} TFLOP/s  err {s['rel_err']:.1e}"
                              f" mask {'ok' if s['same_mask'] else 'DIFFERS'}" if "ms" in s else s["error"]))
    print(f"  top-k                {r['topk_ms']:8.3f} ms")
    print(f"  sparse decode dflt   {r['sparse_decode_default_ms']:8.3f} ms  "
          f"{tflops(r['sparse_flops'], r['sparse_decode_default_ms']):6.1f} TFLOP/s")
    for s in r["sparse"]:
        tag = f"  sparse h{s['block_h']} n{s['block_n']} w{s['num_warps']} s{s['num_stages']} {'R' if s['reload'] else '-'}"
        print(f"{tag:22s} " + (f"{s['ms']:8.3f} ms  {tflops(r['sparse_flops'], s['ms']):6.1f} TFLOP/s  err {s['rel_err']:.1e}"
                              if "ms" in s else s["error"]))
    print(f"  sparse prefill dflt  {r['sparse_prefill_default_ms']:8.3f} ms  "
          f"{tflops(r['sparse_flops'], r['sparse_prefill_default_ms']):6.1f} TFLOP/s")
    print(f"  absorb head_matmul   {r['absorb_head_matmul_ms']:8.3f} ms  "
          f"{tflops(r['absorb_flops'], r['absorb_head_matmul_ms']):6.1f} TFLOP/s; bf16 matmul "
          f"{r['absorb_bf16_matmul_ms']:.3f} ms  {tflops(r['absorb_flops'], r['absorb_bf16_matmul_ms']):6.1f} TFLOP/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--rows", type=int, default=None, help="query rows (default: the engine's step at each context)")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None,
                   help="the JSON (default benchmarks/results/prefill_attention.json; a CPU smoke run's "
                        "under the temp dir)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny preset, 300 tokens, 7 rows, on the CPU (run under TRITON_INTERPRET=1): the plumbing only")
    args = p.parse_args()
    args.out = args.out or results_path("prefill_attention.json", smoke=args.cpu_smoke)
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:
        args.preset, args.contexts, args.rows, args.repeats = "tiny", "300", 7, 1
    elif not torch.cuda.is_available():
        sys.exit("prefill_attention.py needs a CUDA GPU (and Triton)")
    config = load_preset(args.preset)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "date": datetime.date.today().isoformat(), "commit": git_commit(),
              "command": " ".join(sys.argv), "rows": []}
    for context in [int(x) for x in args.contexts.split(",") if x]:
        rows = args.rows or max(1, PREFILL_SCORE_BYTES // (4 * context))
        try:
            r = run_case(config, context, rows, args.kv_cache_dtype, args.repeats, device)
        except Exception:
            traceback.print_exc()
            continue
        result["rows"].append(r)
        print_row(r)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
