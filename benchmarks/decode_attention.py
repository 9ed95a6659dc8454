"""Long-context decode attention of one MLA layer on the GPU: sparse (index scan + top-k + sparse MLA)
vs dense FP8 MLA vs the plain-PyTorch version, all reading the engine's packed FP8 pages.

Real per-layer K3.1 dimensions (the `small` preset: 96 heads, latent 576 = 512 + 64, 32 index heads
x 128, top-k 2048), FP8 cache through the engine's page layout. For each (context, batch): the
time of each kernel (index scan, top-k, sparse MLA), of the whole sparse step, of dense MLA over
the whole context, and of the naive version (the pure-torch reference scan + torch.topk + the
reference sparse MLA); the bytes each must read; and the copy bandwidth measured in the same run.

    python benchmarks/decode_attention.py [--contexts 8192,32768,...] [--batches 1,64] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.cache.layout import CacheLayout  # noqa: E402
from kimiserve.cache.pool import PagePool  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.ops.indexer import reference as indexer_ref  # noqa: E402
from kimiserve.ops.mla import reference as mla_ref  # noqa: E402
from kimiserve.utils.cuda_timing import cuda_time, graph_time  # noqa: E402

INDEX_BYTES = 132  # fp8 key + fp32 scale per token
LATENT_BYTES = 576


def copy_bandwidth_gbps() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), repeats=10)
    return 2 * 4 * 2**30 / (ms * 1e-3) / 1e9


def build_case(config, batch: int, context: int, seed: int = 0):
    """A pool holding `batch` sequences of `context` tokens (random FP8 latents and keys) and the decode inputs."""
    layout = CacheLayout.from_config(config, "fp8", torch.bfloat16)
    bs = layout.block_size
    per_seq = math.ceil(context / bs)
    pool = PagePool(layout, batch * per_seq, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    # e4m3 bytes with exponent field <= 11 (|x| < 32) and a random sign: finite, moderate values
    for page in pool.data:
        page.random_(0, 96, generator=g).bitwise_or_(torch.randint_like(page, 0, 2, generator=g) << 7)
    pool.index_scale[0].copy_(torch.rand(pool.index_scale[0].shape, generator=g, device="cuda") * 0.01 + 1e-3)
    tables = torch.randperm(batch * per_seq, generator=g, device="cuda").view(batch, per_seq)
    H, L, R = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    Hi, D = config.index_n_heads, config.index_head_dim
    return dict(
        pool=pool,
        tables=tables,
        lens=torch.full((batch,), context, device="cuda", dtype=torch.int64),
        q_latent=torch.randn(batch, H, L, device="cuda") * 0.05,
        q_pe=torch.randn(batch, H, R, device="cuda", dtype=torch.bfloat16),
        iq=torch.randn(batch, Hi, D, device="cuda", dtype=torch.bfloat16),
        iw=torch.randn(batch, Hi, device="cuda") * Hi ** -0.5,
        scale=(config.qk_nope_head_dim + R) ** -0.5,
    )


def measure(config, batch: int, context: int, topk: int, naive: bool) -> dict:
    from kimiserve.ops.indexer.triton import paged_indexer_scores
    from kimiserve.ops.mla.triton import paged_dense_mla_decode, paged_sparse_mla_decode
    from kimiserve.ops.topk.triton import topk_indices

    c = build_case(config, batch, context)
    pool, tables, lens = c["pool"], c["tables"], c["lens"]
    keys, key_scales, latents = pool.index_key[0], pool.index_scale[0], pool.latent[0]
    bf16 = torch.bfloat16

    def scan():
        return paged_indexer_scores(c["iq"], c["iw"], keys, key_scales, tables, lens, bf16, max_context=context)

    scores = scan()
    idx = topk_indices(scores, topk, lens)

    def sparse_mla():
        return paged_sparse_mla_decode(c["q_latent"], c["q_pe"], latents, 1.0, tables, idx, c["scale"], bf16)

    def sparse_step():
        s = scan()
        i = topk_indices(s, topk, lens)
        return paged_sparse_mla_decode(c["q_latent"], c["q_pe"], latents, 1.0, tables, i, c["scale"], bf16)

    def dense():
        return paged_dense_mla_decode(c["q_latent"], c["q_pe"], latents, 1.0, tables, lens, c["scale"], bf16,
                                      max_context=context)

    row = dict(context=context, batch=batch,
               scan_ms=cuda_time(scan), topk_ms=cuda_time(lambda: topk_indices(scores, topk, lens)),
               sparse_mla_ms=cuda_time(sparse_mla), sparse_ms=cuda_time(sparse_step), dense_ms=cuda_time(dense),
               sparse_bytes=batch * (context * INDEX_BYTES + min(topk, context) * LATENT_BYTES),
               dense_bytes=batch * context * LATENT_BYTES)
    row["torch_topk_ms"] = cuda_time(lambda: torch.topk(scores, topk, dim=-1))
    row["scan_graph_ms"] = graph_time(scan)
    row["topk_graph_ms"] = graph_time(lambda: topk_indices(scores, topk, lens))
    row["sparse_mla_graph_ms"] = graph_time(sparse_mla)
    row["sparse_graph_ms"] = graph_time(sparse_step)
    row["dense_graph_ms"] = graph_time(dense)
    if naive:
        def naive_step():
            s = indexer_ref.paged_indexer_scores(c["iq"], c["iw"], keys, key_scales, tables, lens, bf16)
            i = torch.topk(s, topk, dim=-1).indices
            return mla_ref.paged_sparse_mla_decode(c["q_latent"], c["q_pe"], latents, 1.0, tables, i, c["scale"], bf16)
        row["naive_ms"] = cuda_time(naive_step, repeats=5, warmup=1)
        ref_out = naive_step()
        row["sparse_vs_naive_rel_rms"] = float((sparse_step() - ref_out).norm() / ref_out.norm())
    else:
        row["naive_ms"] = None
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768,131072,524288,1048576")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--naive-max-tokens", type=int, default=64 * 131072,
                        help="skip the naive version above batch * context tokens (it gathers the whole cache)")
    parser.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = parser.parse_args()
    config = load_preset("small")
    copy_gbps = copy_bandwidth_gbps()
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            layout = CacheLayout.from_config(config, "fp8", torch.bfloat16)
            need = batch * math.ceil(context / layout.block_size) * layout.page_bytes * 1.2 + batch * context * 16
            if need > torch.cuda.mem_get_info()[0]:
                print(f"skip batch {batch} context {context}: needs ~{need / 2**30:.0f} GiB")
                continue
            row = measure(config, batch, context, config.index_topk, batch * context <= args.naive_max_tokens)
            row["copy_gbps"] = copy_gbps
            row["sparse_gbps"] = row["sparse_bytes"] / (row["sparse_graph_ms"] * 1e-3) / 1e9
            row["dense_gbps"] = row["dense_bytes"] / (row["dense_graph_ms"] * 1e-3) / 1e9
            rows.append(row)
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  commit=commit, command=" ".join(sys.argv), copy_gbps=copy_gbps, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ncopy bandwidth {copy_gbps:.0f} GB/s (read + write); times in ms; CUDA graph replay (eager in brackets)")
    print("context  batch   scan  top-k  sparse-MLA  sparse step       dense          naive  sparse/dense  sparse GB/s  % copy")
    for r in rows:
        naive = f"{r['naive_ms']:.3f}" if r["naive_ms"] is not None else "-"
        print(f"{r['context']:>7} {r['batch']:>6} {r['scan_graph_ms']:6.3f} {r['topk_graph_ms']:6.3f} "
              f"{r['sparse_mla_graph_ms']:11.3f} {r['sparse_graph_ms']:6.3f} ({r['sparse_ms']:5.3f}) "
              f"{r['dense_graph_ms']:8.3f} ({r['dense_ms']:7.3f}) {naive:>7} {r['sparse_graph_ms'] / r['dense_graph_ms']:13.3f} "
              f"{r['sparse_gbps']:12.0f} {100 * r['sparse_gbps'] / copy_gbps:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
