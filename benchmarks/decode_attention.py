"""Long-context decode attention of one MLA layer on the GPU: sparse (index scan + top-k + sparse MLA)
vs dense MLA vs the plain-PyTorch version, all reading the engine's packed pages, per cache format.

Real per-layer K3.1 dimensions (the `small` preset: 96 heads, latent 576 = 512 + 64, 32 index heads
x 128, top-k 2048), cache through the engine's page layout for each `--kv-cache-dtypes` entry:
fp8 (e4m3 latents with a per-layer scale, e4m3 index keys + fp32 per-token scale) and fp4 (NVFP4
latent rows, MXFP4 index keys stored Hadamard-rotated, so the step rotates its index query first,
as the model does). For each (context, batch, format): the time of each kernel (index scan, top-k,
sparse MLA), of the whole sparse step, of dense MLA over the whole context, and of the naive
version (the pure-torch reference scan, which dequantises the keys first, + torch.topk + the
reference sparse MLA); the bytes each must read (per context token the scan's key + scale bytes,
per selected token one latent row: fp8 132 + 576 B, fp4 68 + 324 B); and the copy bandwidth
measured in the same run. The last table puts fp4 next to fp8 (target: fp4 / fp8 sparse step
<= 0.65 at 1M tokens, batch 1).

    python benchmarks/decode_attention.py [--contexts 8192,32768,...] [--batches 1,64] [--kv-cache-dtypes fp8,fp4]
                                          [--out PATH]
    python benchmarks/decode_attention.py --cpu-smoke --out PATH   # reference ops, tiny preset, CPU (plumbing check)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import traceback
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.cache.layout import CacheLayout  # noqa: E402
from kimiserve.cache.pool import PagePool  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.ops.indexer import reference as indexer_ref  # noqa: E402
from kimiserve.ops.mla import reference as mla_ref  # noqa: E402
from kimiserve.ops.quant.reference import hadamard  # noqa: E402
from kimiserve.ops.topk.reference import topk_reference  # noqa: E402
from kimiserve.utils.cuda_timing import cuda_time, graph_time, wall_time  # noqa: E402
from kimiserve.utils.run_info import git_commit, results_path  # noqa: E402

KV_CACHE_DTYPES = ("fp8", "fp4")
INDEX_BYTES = 132  # fp8 key + fp32 scale per token (fp4: 68, see `read_bytes`); sweep_decode.py imports these
LATENT_BYTES = 576  # fp8 latent row (fp4: 324)
NAIVE_BYTES_PER_KEY_VALUE = 24
"""Peak bytes per index-key value of the naive scan (gathered codes, int64 code indices, fp32 values,
their product): sizes the memory check that drops the naive version from a row."""


def copy_bandwidth_gbps(device: str = "cuda", nbytes: int = 2**32) -> float:
    """Bytes read + written per second by a device-to-device copy of nbytes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer = cuda_time if device == "cuda" else wall_time
    ms = timer(lambda: dst.copy_(src), repeats=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def triton_ops() -> SimpleNamespace:
    from kimiserve.ops.indexer.triton import paged_indexer_scores
    from kimiserve.ops.mla.triton import paged_dense_mla_decode, paged_sparse_mla_decode
    from kimiserve.ops.topk.triton import topk_indices

    return SimpleNamespace(scan=paged_indexer_scores, topk=topk_indices, sparse=paged_sparse_mla_decode,
                           dense=paged_dense_mla_decode)


def reference_ops() -> SimpleNamespace:
    """The pure-torch ops under the same names (the CPU smoke run)."""
    return SimpleNamespace(scan=indexer_ref.paged_indexer_scores, topk=topk_reference,
                           sparse=mla_ref.paged_sparse_mla_decode, dense=mla_ref.paged_dense_mla_decode)


def read_bytes(layout: CacheLayout) -> tuple[int, int]:
    """(scan bytes per context token, latent bytes per selected token) of one layer in this layout:
    fp8 (132, 576), fp4 (68, 324) at K3.1 sizes."""
    bs = layout.block_size
    index = layout.index_key[0].nbytes + (layout.index_scale[0].nbytes if layout.index_scale else 0)
    return index // bs, layout.latent[0].nbytes // bs


def fill_random(pool: PagePool, g: torch.Generator) -> None:
    """Random finite cache contents of moderate size (|value| < 32) in layer 0's regions."""
    if pool.kv_cache_dtype == "fp8":
        # e4m3 bytes with exponent field <= 11 (|x| < 32) and a random sign: finite, moderate values
        for page in pool.data:
            page.random_(0, 96, generator=g).bitwise_or_(torch.randint_like(page, 0, 2, generator=g) << 7)
        scales = pool.index_scale[0]
        scales.copy_(torch.rand(scales.shape, generator=g, device=scales.device) * 0.01 + 1e-3)
    elif pool.kv_cache_dtype == "fp4":
        pool.data.random_(generator=g)  # every e2m1 code is finite: any code byte will do
        latent = pool.latent[0]
        groups = latent.shape[-1] // 9
        latent[..., 8 * groups:].random_(0x28, 0x48, generator=g)  # e4m3 scales 0.25 .. 3.75: |x| <= 22.5
        pool.index_scale[0].random_(120, 128, generator=g)  # ue8m0 scales 2^-7 .. 1
    else:
        raise ValueError(f"no random fill for kv_cache_dtype {pool.kv_cache_dtype!r}")


def build_case(config, batch: int, context: int, seed: int = 0, kv: str = "fp8", device: str = "cuda"):
    """A pool holding `batch` sequences of `context` tokens (random latents and keys in format `kv`) and
    the decode inputs."""
    layout = CacheLayout.from_config(config, kv, torch.bfloat16)
    bs = layout.block_size
    per_seq = math.ceil(context / bs)
    pool = PagePool(layout, batch * per_seq, device)
    g = torch.Generator(device=device).manual_seed(seed)
    fill_random(pool, g)
    tables = torch.randperm(batch * per_seq, generator=g, device=device).view(batch, per_seq)
    H, L, R = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    Hi, D = config.index_n_heads, config.index_head_dim
    randn = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=g, device=device).to(dtype)
    return dict(
        pool=pool,
        tables=tables,
        lens=torch.full((batch,), context, device=device, dtype=torch.int64),
        q_latent=randn(batch, H, L) * 0.05,
        q_pe=randn(batch, H, R, dtype=torch.bfloat16),
        iq=randn(batch, Hi, D, dtype=torch.bfloat16),
        iw=randn(batch, Hi) * Hi ** -0.5,
        scale=(config.qk_nope_head_dim + R) ** -0.5,
        # keys stored rotated: the step scans with the rotated query (formats.rotate_index_keys, with the
        # matrix made once here so that no host-to-device copy lands inside a CUDA graph)
        rotation=hadamard(D, torch.float32, device) if layout.index_key_rotation else None,
    )


def measure(ops, timers, config, kv: str, batch: int, context: int, topk: int, naive: bool, device: str) -> dict:
    c = build_case(config, batch, context, kv=kv, device=device)
    pool, tables, lens = c["pool"], c["tables"], c["lens"]
    keys, key_scales, latents = pool.index_key[0], pool.index_scale[0], pool.latent[0]
    latent_scale = pool.latent_scales[0]
    bf16 = torch.bfloat16
    rotation = c["rotation"]  # fp4 keys are stored rotated: the scan rotates the query first, as the model's does

    def scan():
        return ops.scan(c["iq"], c["iw"], keys, key_scales, tables, lens, bf16, max_context=context, rotation=rotation)

    scores = scan()
    idx = ops.topk(scores, topk, lens)

    def sparse_mla():
        return ops.sparse(c["q_latent"], c["q_pe"], latents, latent_scale, tables, idx, c["scale"], bf16)

    def sparse_step():
        s = scan()
        i = ops.topk(s, topk, lens)
        return ops.sparse(c["q_latent"], c["q_pe"], latents, latent_scale, tables, i, c["scale"], bf16)

    def dense():
        return ops.dense(c["q_latent"], c["q_pe"], latents, latent_scale, tables, lens, c["scale"], bf16,
                         max_context=context)

    index_bytes, latent_bytes = read_bytes(pool.layout)
    row = dict(kv_cache_dtype=kv, context=context, batch=batch,
               scan_ms=timers.eager(scan), topk_ms=timers.eager(lambda: ops.topk(scores, topk, lens)),
               sparse_mla_ms=timers.eager(sparse_mla), sparse_ms=timers.eager(sparse_step),
               dense_ms=timers.eager(dense),
               sparse_bytes=batch * (context * index_bytes + min(topk, context) * latent_bytes),
               dense_bytes=batch * context * latent_bytes,
               index_bytes_per_token=index_bytes, latent_bytes_per_token=latent_bytes,
               block_size=pool.block_size, pool_bytes=pool.nbytes)
    row["torch_topk_ms"] = timers.eager(lambda: torch.topk(scores, topk, dim=-1))
    row["scan_graph_ms"] = timers.graph(scan)
    row["topk_graph_ms"] = timers.graph(lambda: ops.topk(scores, topk, lens))
    row["sparse_mla_graph_ms"] = timers.graph(sparse_mla)
    row["sparse_graph_ms"] = timers.graph(sparse_step)
    row["dense_graph_ms"] = timers.graph(dense)
    if naive:
        def naive_step():  # the references dequantise the gathered keys / latents (fp8 or fp4) first
            s = indexer_ref.paged_indexer_scores(c["iq"], c["iw"], keys, key_scales, tables, lens, bf16,
                                                 rotation=rotation)
            i = torch.topk(s, topk, dim=-1).indices
            return mla_ref.paged_sparse_mla_decode(c["q_latent"], c["q_pe"], latents, latent_scale, tables, i,
                                                   c["scale"], bf16)
        row["naive_ms"] = timers.slow(naive_step)
        ref_out, out = naive_step(), sparse_step()
        row["sparse_vs_naive_rel_rms"] = float((out - ref_out).norm() / ref_out.norm())
        row["sparse_finite"] = bool(torch.isfinite(out).all())
    else:
        row["naive_ms"] = None
    return row


def fits(config, kv: str, batch: int, context: int, naive: bool, free_bytes: int) -> tuple[bool, bool, float]:
    """(the row fits, the naive version fits too, bytes needed without the naive version)."""
    layout = CacheLayout.from_config(config, kv, torch.bfloat16)
    need = batch * math.ceil(context / layout.block_size) * layout.page_bytes * 1.2 + batch * context * 16
    naive_need = batch * context * config.index_head_dim * NAIVE_BYTES_PER_KEY_VALUE if naive else 0
    return need <= free_bytes, need + naive_need <= free_bytes, need


def best_ms(row: dict, name: str) -> float:
    """The CUDA-graph figure, else (no graph: the CPU run) the eager one."""
    graph = row.get(f"{name}_graph_ms")
    return graph if graph is not None else row[f"{name}_ms"]


def compare_formats(rows: list[dict]) -> list[dict]:
    """Per (context, batch) measured in both fp8 and fp4: the fp4 / fp8 time ratios (graph figures)."""
    by_case = {(r["context"], r["batch"], r["kv_cache_dtype"]): r for r in rows}
    out = []
    for (context, batch, kv), fp4 in by_case.items():
        fp8 = by_case.get((context, batch, "fp8"))
        if kv != "fp4" or fp8 is None:
            continue
        cmp = dict(context=context, batch=batch, fp8_sparse_ms=best_ms(fp8, "sparse"),
                   fp4_sparse_ms=best_ms(fp4, "sparse"))
        for name in ("sparse", "scan", "topk", "sparse_mla", "dense"):
            cmp[f"{name}_fp4_over_fp8"] = best_ms(fp4, name) / best_ms(fp8, name)
        cmp["sparse_eager_fp4_over_fp8"] = fp4["sparse_ms"] / fp8["sparse_ms"]
        cmp["sparse_bytes_fp4_over_fp8"] = fp4["sparse_bytes"] / fp8["sparse_bytes"]
        fp4["sparse_over_fp8"] = cmp["sparse_fp4_over_fp8"]
        out.append(cmp)
    return out


def print_tables(result: dict) -> None:
    rows, copy_gbps = result["rows"], result["copy_gbps"]
    gpu = result["device"] != "cpu"
    print(f"\n{result['device']}: copy bandwidth {copy_gbps:.0f} GB/s (read + write); times in ms; "
          + ("CUDA graph replay (eager in brackets)" if gpu else "host clock, reference ops (plumbing check only)"))
    print("kv   context  batch    scan  top-k  sparse-MLA  sparse step          dense        naive  sparse/dense"
          "  sparse GB/s  % copy")
    for r in rows:
        naive = f"{r['naive_ms']:.3f}" if r["naive_ms"] is not None else "-"
        print(f"{r['kv_cache_dtype']:<4} {r['context']:>7} {r['batch']:>6} {best_ms(r, 'scan'):7.3f} "
              f"{best_ms(r, 'topk'):6.3f} {best_ms(r, 'sparse_mla'):11.3f} {best_ms(r, 'sparse'):7.3f} "
              f"({r['sparse_ms']:6.3f}) {best_ms(r, 'dense'):8.3f} ({r['dense_ms']:7.3f}) {naive:>7} "
              f"{best_ms(r, 'sparse') / best_ms(r, 'dense'):13.3f} {r['sparse_gbps']:12.0f} "
              f"{100 * r['sparse_gbps'] / copy_gbps:7.0f}")
    if result["fp4_vs_fp8"]:
        print("\nfp4 next to fp8 (target: sparse step fp4 / fp8 <= 0.65 at 1M tokens, batch 1; bytes ratio for scale)")
        print("context  batch  fp8 sparse  fp4 sparse  fp4/fp8  (eager)  scan fp4/fp8  sparse-MLA fp4/fp8"
              "  dense fp4/fp8  bytes fp4/fp8")
        for c in result["fp4_vs_fp8"]:
            print(f"{c['context']:>7} {c['batch']:>6} {c['fp8_sparse_ms']:11.3f} {c['fp4_sparse_ms']:11.3f} "
                  f"{c['sparse_fp4_over_fp8']:8.3f} ({c['sparse_eager_fp4_over_fp8']:6.3f}) "
                  f"{c['scan_fp4_over_fp8']:13.3f} {c['sparse_mla_fp4_over_fp8']:19.3f} "
                  f"{c['dense_fp4_over_fp8']:14.3f} {c['sparse_bytes_fp4_over_fp8']:14.3f}")


def parse_kv_cache_dtypes(spec: str) -> list[str]:
    kvs = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [kv for kv in kvs if kv not in KV_CACHE_DTYPES]
    if bad or not kvs:
        raise argparse.ArgumentTypeError(
            f"--kv-cache-dtypes takes a list of {', '.join(KV_CACHE_DTYPES)}, got {spec!r}")
    return kvs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default=None, help="default 8192,32768,131072,524288,1048576 (smoke: 100,300)")
    parser.add_argument("--batches", default=None, help="default 1,64 (smoke: 1,2)")
    parser.add_argument("--kv-cache-dtypes", type=parse_kv_cache_dtypes, default="fp8,fp4",
                        help="cache formats, each measured on every (context, batch)")
    parser.add_argument("--naive-max-tokens", type=int, default=64 * 131072,
                        help="skip the naive version above batch * context tokens (it gathers the whole cache)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the reference ops on the tiny preset on the CPU (a plumbing check, no useful figures)")
    parser.add_argument("--out", default=None,
                        help="the JSON (default benchmarks/results/decode_attention.json; a CPU smoke run's "
                             "under the temp dir)")
    args = parser.parse_args()
    args.out = args.out or results_path("decode_attention.json", smoke=args.cpu_smoke)
    if args.cpu_smoke:
        torch.set_num_threads(1)
        device, preset, ops = "cpu", "tiny", reference_ops()
        timers = SimpleNamespace(eager=wall_time, graph=lambda fn: None, slow=wall_time)
        contexts, batches = args.contexts or "100,300", args.batches or "1,2"
        copy_gbps = copy_bandwidth_gbps(device, 2**24)
        free_bytes = lambda: 2**62
    else:
        if not torch.cuda.is_available():
            print("decode_attention.py times the Triton kernels and needs a CUDA device (none found); "
                  "--cpu-smoke runs the plumbing on the CPU", file=sys.stderr)
            return 2
        device, preset, ops = "cuda", "small", triton_ops()
        timers = SimpleNamespace(eager=cuda_time, graph=graph_time, slow=lambda fn: cuda_time(fn, repeats=5, warmup=1))
        contexts, batches = args.contexts or "8192,32768,131072,524288,1048576", args.batches or "1,64"
        copy_gbps = copy_bandwidth_gbps(device, 2**32)
        torch.cuda.empty_cache()
        free_bytes = lambda: torch.cuda.mem_get_info()[0]
    config = load_preset(preset)
    commit = git_commit()
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=commit,
                  command=" ".join(sys.argv), model=preset, cpu_smoke=args.cpu_smoke,
                  kv_cache_dtypes=args.kv_cache_dtypes, copy_gbps=copy_gbps, rows=[], skipped=[], fp4_vs_fp8=[])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    failed = False
    for batch in map(int, batches.split(",")):
        for context in map(int, contexts.split(",")):
            for kv in args.kv_cache_dtypes:
                naive = batch * context <= args.naive_max_tokens
                ok, naive_ok, need = fits(config, kv, batch, context, naive, free_bytes())
                if not ok:
                    result["skipped"].append(dict(kv_cache_dtype=kv, context=context, batch=batch,
                                                  reason=f"needs ~{need / 2**30:.0f} GiB"))
                    print(f"skip {kv} batch {batch} context {context}: needs ~{need / 2**30:.0f} GiB", flush=True)
                    continue
                try:
                    row = measure(ops, timers, config, kv, batch, context, config.index_topk, naive and naive_ok,
                                  device)
                except Exception as e:  # a kernel without this format yet, or out of memory: the other rows still run
                    row, reason = None, f"{type(e).__name__}: {e}"
                    if not isinstance(e, torch.cuda.OutOfMemoryError):
                        failed = True
                        traceback.print_exc()
                    result["skipped"].append(dict(kv_cache_dtype=kv, context=context, batch=batch, reason=reason))
                    print(f"skip {kv} batch {batch} context {context}: {reason}", file=sys.stderr, flush=True)
                if row is None:  # outside the except block: the traceback no longer holds the case's pool
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                row["copy_gbps"] = copy_gbps
                row["sparse_gbps"] = row["sparse_bytes"] / (best_ms(row, "sparse") * 1e-3) / 1e9
                row["dense_gbps"] = row["dense_bytes"] / (best_ms(row, "dense") * 1e-3) / 1e9
                result["rows"].append(row)
                result["fp4_vs_fp8"] = compare_formats(result["rows"])
                with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                    json.dump(result, f, indent=1)
                print(json.dumps(row), flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_tables(result)
    if failed:
        print("\nsome rows failed (see `skipped` in the JSON)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
