"""Decode context parallel (DCP): bytes each rank sends per decode step per MLA layer, and the
capacity in full 1M-token contexts of one rank's pool.

Traffic, Kimi-K3.1 sizes (index_topk k = 2048; 96 MLA heads split over tp = D, H_l = 96 / D per
rank; latent L = 512 + R = 64; index keys fp8 132 B or fp4 68 B per token), three ways to find the
top-k under DCP:

(a) the exact merge (`kimiserve.distributed.dcp.dcp_sparse_decode`): all-gather of the group's
    queries (H_l x (L + R) fp32 per row), all-gather of c = min(k, S0) (score, position) int32 pairs
    (8 B) per row, all-to-all of the partial outputs with their lse (D x H_l x (L + 1) fp32 per row);
(b) all-gathered score rows: each rank's S0 fp32 scores instead of the candidates (then every rank
    takes topk_reference of the assembled row), the same query gather and partial merge;
(c) replicated index keys: each rank fetches the others' index keys (S0 keys in the cache format
    per row, all-gathered; every rank then scans every key and selects alone), plus the same query
    gather and partial merge.

S0 = tokens rank 0 holds of an S-token context (the most any rank holds; every rank sends that
width, as an all-gather needs equal sizes), interleave I = block_size of the per-rank layout.

Bytes sent by one rank (the convention the counter applies to the real calls): an all-gather of n
bytes per rank sends n to each of the D - 1 others, (D - 1) n (ring or direct); an all-to-all of n
bytes per rank keeps its own chunk and sends (D - 1) / D n. Everything scales linearly with the
batch B (one query row per sequence, each sequence its own candidates / scores / keys):

    (a) = B (D - 1) [H_l (L + R) 4 + c 8 + H_l (L + 1) 4]
    (b) = B (D - 1) [H_l (L + R) 4 + S0 4 + H_l (L + 1) 4]
    (c) = B (D - 1) [H_l (L + R) 4 + S0 key_bytes + H_l (L + 1) 4]

Measured: D gloo ranks on the CPU (spawned processes, one torch thread each) run the real code
with torch.distributed's collectives wrapped to count what each call sends: (a) the real
`dcp_sparse_decode` (the scan replaced by random fp32 scores of the rank's S_local tokens: the
count does not depend on their values; the top-k merge and sparse MLA are the real ones over a
real K3.1 per-rank pool whose block tables all point at one page), (b) the same queries and merge
with an all-gather of the score rows (its selection checked equal to (a)'s), (c) the same with an
all-gather of random key bytes in the cache format (the scan of the gathered keys is not run).
This is a byte count, not a timing.

Capacity: per rank, a cache budget (--budget-gb, decimal GB of pages) holds
pages_for_budget(budget, page_bytes) pages of `CacheLayout` for the per-rank config (tp = D: 96 / D
KDA heads per state page); a 1M-token sequence takes ceil(S0 / block_size) attention pages (rank 0
holds the most) + 69 state pages (KDA state is replicated over the DCP ranks, sharded by heads).
Checked against `kimiserve plan` (`compute_plan`, --parallel dcp --gpus D, and tp for the TP-only
comparison) given GPU memory = budget + that plan's weights per GPU, utilisation 1, reserve 0.

    python benchmarks/dcp_traffic.py [--quick] [--out benchmarks/results/dcp_traffic.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESET = "kimi-k3.1-pro"
CONTEXTS = (131072, 340000, 1048576)
DCP_SIZES = (2, 4, 8)
CAPACITY_SIZES = (1, 2, 4, 8)
KEY_FORMATS = ("fp8", "fp4")
CAPACITY_CONTEXT = 1048576
DEFAULT_BUDGET_GB = 48.0
GB = 1e9
FP32, POS, PAIR = 4, 4, 8  # bytes: a score, a position (int32), a (score, position) candidate


# ------------------------------------------------------------------------------------------ formulas
def sizes(config, D: int) -> dict:
    return dict(k=config.index_topk, heads=config.num_attention_heads, H_l=config.num_attention_heads // D,
                L=config.kv_lora_rank, R=config.qk_rope_head_dim)


def key_bytes(kv: str, config) -> int:
    """Bytes of one index key in the cache format (codes + scales), as the layout stores it."""
    from kimiserve.cache.formats import index_key_storage

    dtype, n, sdtype, sn = index_key_storage(kv, config.index_head_dim)
    return dtype.itemsize * n + (sdtype.itemsize * sn if sdtype is not None else 0)


def formula(config, D: int, S: int, B: int, interleave: int, kv: str) -> dict:
    from kimiserve.distributed.dcp import dcp_local_count

    z = sizes(config, D)
    S0 = dcp_local_count(S, 0, interleave, D)
    c = min(z["k"], S0)
    queries = B * (D - 1) * z["H_l"] * (z["L"] + z["R"]) * FP32
    partials = B * (D - 1) * z["H_l"] * (z["L"] + 1) * FP32
    cand = B * (D - 1) * c * PAIR
    scores = B * (D - 1) * S0 * FP32
    keys = B * (D - 1) * S0 * key_bytes(kv, config)
    return dict(S0=S0, candidates=c, queries=queries, partials=partials,
                a_selection=cand, a_total=queries + cand + partials,
                b_selection=scores, b_total=queries + scores + partials,
                c_selection=keys, c_total=queries + keys + partials)


# ------------------------------------------------------------------------------------------ counting
class Counter:
    """Wraps torch.distributed's collectives; records the bytes each call sends from this rank."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all_single", "all_reduce",
             "reduce_scatter_tensor", "reduce_scatter_single", "broadcast")

    def __init__(self):
        self.calls: list[dict] = []
        self._saved = {}
        self._depth = threading.local()

    def _sent(self, name, args, kwargs) -> tuple[int, int]:
        import torch.distributed as dist

        group = kwargs.get("group")
        D = dist.get_world_size(group)
        if name in ("all_gather_single", "all_gather_into_tensor"):
            n = args[1].numel() * args[1].element_size()
            return n, (D - 1) * n
        if name == "all_gather":
            n = args[1].numel() * args[1].element_size()
            return n, (D - 1) * n
        if name == "all_to_all_single":
            if kwargs.get("input_split_sizes") or (len(args) > 3 and args[3]):
                raise NotImplementedError("uneven all-to-all splits are not counted")
            n = args[1].numel() * args[1].element_size()
            return n, n * (D - 1) // D
        if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            n = args[1].numel() * args[1].element_size()
            return n, n * (D - 1) // D
        if name == "all_reduce":
            n = args[0].numel() * args[0].element_size()
            return n, 2 * n * (D - 1) // D  # ring: reduce-scatter + all-gather
        n = args[0].numel() * args[0].element_size()
        return n, n * (D - 1)  # broadcast from this rank at most

    def __enter__(self):
        import torch.distributed as dist

        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapped(*args, __fn=fn, __name=name, **kwargs):
                depth = getattr(self._depth, "n", 0)
                if depth == 0:  # an outer collective calling another is counted once
                    n, sent = self._sent(__name, args, kwargs)
                    t = args[1] if __name not in ("all_reduce", "broadcast") else args[0]
                    if isinstance(t, list):
                        t = t[0]
                    self.calls.append(dict(op=__name, dtype=str(t.dtype).replace("torch.", ""),
                                           shape=list(t.shape), bytes_in=n, sent=sent))
                self._depth.n = depth + 1
                try:
                    return __fn(*args, **kwargs)
                finally:
                    self._depth.n = depth

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False

    @property
    def sent(self) -> int:
        return sum(c["sent"] for c in self.calls)


# ------------------------------------------------------------------------------------------ one rank
def _all_gather_single(out, t) -> None:
    import torch.distributed as dist

    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t.contiguous())


def rank_main(rank: int, D: int, points: list, seed: int) -> list:
    import torch
    import torch.distributed as dist

    from kimiserve.cache.pool import PagePool
    from kimiserve.config import load_preset
    from kimiserve.distributed.dcp import (DcpGroup, dcp_gather_heads, dcp_global_position, dcp_local_count,
                                           dcp_merge_heads, dcp_owner, dcp_local_position, dcp_sparse_decode)
    from kimiserve.ops.mla.reference import paged_sparse_mla_decode_lse
    from kimiserve.ops.topk.reference import topk_reference
    from kimiserve.plan import rank_layout

    config = load_preset(PRESET)
    z = sizes(config, D)
    layout = rank_layout(config, "fp8", D)
    I = layout.block_size
    pool = PagePool(layout, 1)  # the block tables all point at this page: only the counts matter
    pool.data.zero_()
    dcp = DcpGroup(dist.group.WORLD, rank, D)
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rows = []
    for S, B in points:
        g = torch.Generator().manual_seed(seed + 7919 * rank + S + B)
        lens = torch.full((B,), S, dtype=torch.int64)
        S_loc, S0 = dcp_local_count(S, rank, I, D), dcp_local_count(S, 0, I, D)
        local_scores = torch.randn(B, S_loc, generator=g)
        local_scores = (local_scores * 64).round() / 64  # some ties
        q_abs = torch.randn(B, z["H_l"], z["L"], generator=g)
        q_pe = torch.randn(B, z["H_l"], z["R"], generator=g)
        iq = torch.zeros(B, config.index_n_heads, config.index_head_dim)
        iw = torch.zeros(B, config.index_n_heads)
        tables = torch.zeros(B, -(-S_loc // layout.block_size), dtype=torch.int64)

        def fake_scan(q, w, key_cache, key_scales, block_tables, context_lens, dtype, max_context, *, rotation=None):
            assert max_context == S_loc and block_tables is tables
            return local_scores

        # (a) the exact merge: the real decode step
        with Counter() as ca:
            out_a, sel = dcp_sparse_decode(q_abs, q_pe, iq, iw, pool, 0, tables, lens, S, z["k"], scale,
                                           torch.bfloat16, dcp, I, indexer_scores=fake_scan, return_selection=True)
        # (b) all-gathered score rows
        with Counter() as cb:
            finish = dcp_gather_heads(q_abs, q_pe, dcp, async_op=True)
            padded = torch.full((B, S0), float("-inf"))
            padded[:, :S_loc] = local_scores
            parts = torch.empty(D * B, S0)
            _all_gather_single(parts, padded)
            parts = parts.view(D, B, S0)
            row = torch.full((B, S), float("-inf"))
            for r in range(D):
                n = dcp_local_count(S, r, I, D)
                row[:, dcp_global_position(torch.arange(n), r, I, D)] = parts[r, :, :n]
            idx_b = topk_reference(row, z["k"], lens)
            mine = (idx_b >= 0) & (dcp_owner(idx_b, I, D) == rank)
            local_b = torch.where(mine, dcp_local_position(idx_b, I, D), -1)
            qa, qp = finish()
            part, lse = paged_sparse_mla_decode_lse(qa, qp, pool.latent[0], pool.latent_scales[0], tables, local_b,
                                                    scale, torch.bfloat16)
            out_b = dcp_merge_heads(part, lse, dcp)
        same_selection = torch.equal(idx_b, sel.positions)
        same_output = torch.equal(out_b, out_a)
        # (c) replicated index keys: fetch every rank's keys in the cache format
        counted_c = {}
        for kv in KEY_FORMATS:
            kb = key_bytes(kv, config)
            with Counter() as cc:
                finish = dcp_gather_heads(q_abs, q_pe, dcp, async_op=True)
                keys = torch.randint(0, 256, (B, S0, kb), dtype=torch.uint8, generator=g)
                everyone = torch.empty(D * B, S0, kb, dtype=torch.uint8)
                _all_gather_single(everyone, keys)
                del everyone
                qa, qp = finish()  # every rank would now scan all keys and select alone: (a)'s selection
                part, lse = paged_sparse_mla_decode_lse(qa, qp, pool.latent[0], pool.latent_scales[0], tables,
                                                        sel.local, scale, torch.bfloat16)
                dcp_merge_heads(part, lse, dcp)
            counted_c[kv] = dict(sent=cc.sent, calls=cc.calls)
        rows.append(dict(rank=rank, D=D, context=S, batch=B, interleave=I, S_local=S_loc, S0=S0,
                         a=dict(sent=ca.sent, calls=ca.calls), b=dict(sent=cb.sent, calls=cb.calls), c=counted_c,
                         b_selection_equals_a=same_selection, b_output_equals_a=same_output))
    return rows


def _child(rank, D, port, points, seed, results, timeout):
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=D,
                                timeout=timedelta(seconds=timeout))
        try:
            out = rank_main(rank, D, points, seed)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))


def run_group(D: int, points: list, seed: int, timeout: float) -> list:
    """rank_main on D spawned gloo ranks; their rows in rank order (a failure raises with its traceback)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(r, D, port, points, seed, results, timeout), daemon=True)
             for r in range(D)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        while len(out) + len(errors) < D:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise SystemExit(f"DCP {D}: ranks {sorted(set(range(D)) - set(out))} did not finish in {timeout}s")
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise SystemExit("\n".join(errors))
    return [out[r] for r in range(D)]


# ------------------------------------------------------------------------------------------ capacity
def capacity(config, budget_bytes: int, groups) -> list:
    """Full 1M-token contexts in one rank's pool of `budget_bytes`, DCP D = tp = D, and TP-only rows."""
    from kimiserve.distributed.dcp import dcp_local_count, dcp_local_pages
    from kimiserve.engine.args import pages_for_budget
    from kimiserve.plan import compute_plan, rank_layout, weights_per_gpu

    L = CAPACITY_CONTEXT
    n_kda = len(config.kda_layers)
    rows = []
    for mode, sizes_ in (("dcp", CAPACITY_SIZES), ("tp", (8,))):
        for D in sizes_:
            for kv in KEY_FORMATS:
                layout = rank_layout(config, kv, D)
                bs = layout.block_size
                ranks = D if mode == "dcp" else 1
                pages = pages_for_budget(budget_bytes, layout.page_bytes)
                tokens0 = dcp_local_count(L, 0, bs, ranks)
                attn = dcp_local_pages(L, 0, bs, ranks, bs)
                per_seq = attn + n_kda
                full = pages // per_seq
                # kimiserve plan with GPU memory = this budget + its weights per GPU (utilisation 1, no reserve)
                weights = weights_per_gpu(groups, D)["total"]
                plan = compute_plan(config, (budget_bytes + weights) / GB, D, mode, kv, L, gpu_memory_utilization=1.0,
                                    reserve_gb=0.0, groups=groups, hints=False)
                fit = plan["fit"]
                rows.append(dict(mode=mode, D=D, tp=D, kv_cache_dtype=kv, block_size=bs, page_bytes=layout.page_bytes,
                                 budget_bytes=budget_bytes, pages=pages, tokens_rank0=tokens0,
                                 attention_pages_per_seq=attn, state_pages_per_seq=n_kda, pages_per_seq=per_seq,
                                 bytes_per_seq=per_seq * layout.page_bytes, full_contexts=full,
                                 plan_available_bytes=fit["available_bytes"], plan_pages=fit["pages_per_gpu"],
                                 plan_pages_per_seq=fit["pages_per_seq"], plan_full_contexts=fit["full_contexts"],
                                 matches_plan=(fit["pages_per_gpu"] == pages and fit["pages_per_seq"] == per_seq
                                               and fit["full_contexts"] == full)))
    return rows


# ------------------------------------------------------------------------------------------ main
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(n: int) -> str:
    return f"{n:,}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke: measure D = 2 at a 4096-token context only (formulas and capacity in full)")
    parser.add_argument("--budget-gb", type=float, default=DEFAULT_BUDGET_GB,
                        help=f"per-rank cache budget in decimal GB (default {DEFAULT_BUDGET_GB:g})")
    parser.add_argument("--measure-contexts", type=int, nargs="*", default=list(CONTEXTS),
                        help="contexts measured on gloo ranks (batch 1); the rest are formula only")
    parser.add_argument("--batch-check", type=int, default=4, help="also measure this batch at the first context")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default="benchmarks/results/dcp_traffic.json")
    args = parser.parse_args()

    import torch

    from kimiserve.config import load_preset
    from kimiserve.distributed.dcp import dcp_local_count
    from kimiserve.plan import rank_layout, weight_groups
    from kimiserve.utils.run_info import git_commit

    t0 = time.time()
    config = load_preset(PRESET)
    measure_D = (2,) if args.quick else DCP_SIZES
    contexts = CONTEXTS
    measure_points = [(4096, 1), (4096, 3)] if args.quick else \
        [(S, 1) for S in args.measure_contexts] + ([(args.measure_contexts[0], args.batch_check)]
                                                    if args.batch_check and args.measure_contexts else [])
    measured = {}
    for D in measure_D:
        t = time.time()
        ranks = run_group(D, measure_points, 1234, args.timeout)
        for rows in zip(*ranks):
            measured[(D, rows[0]["context"], rows[0]["batch"])] = rows
        print(f"measured DCP {D} on {D} gloo ranks: {len(measure_points)} points in {time.time() - t:.1f}s", flush=True)

    traffic, mismatches = [], []
    for D in DCP_SIZES:
        I = rank_layout(config, "fp8", D).block_size
        pts = sorted({(S, 1) for S in contexts} | {(key[1], key[2]) for key in measured if key[0] == D})
        for S, B in pts:
            for kv in KEY_FORMATS:
                f = formula(config, D, S, B, I, kv)
                row = dict(D=D, tp=D, heads_per_rank=96 // D, context=S, batch=B, key_format=kv, interleave=I, **f)
                got = measured.get((D, S, B))
                if got is not None:
                    per_rank = dict(a=[r["a"]["sent"] for r in got], b=[r["b"]["sent"] for r in got],
                                    c=[r["c"][kv]["sent"] for r in got])
                    row["measured"] = dict(per_rank_sent=per_rank, a_calls=got[0]["a"]["calls"],
                                           b_calls=got[0]["b"]["calls"], c_calls=got[0]["c"][kv]["calls"],
                                           b_selection_equals_a=all(r["b_selection_equals_a"] for r in got),
                                           b_output_equals_a=all(r["b_output_equals_a"] for r in got))
                    ok = (all(x == f["a_total"] for x in per_rank["a"]) and all(x == f["b_total"] for x in per_rank["b"])
                          and all(x == f["c_total"] for x in per_rank["c"]))
                    row["measured_equals_formula"] = ok
                    if not ok or not row["measured"]["b_selection_equals_a"]:
                        mismatches.append((D, S, B, kv))
                traffic.append(row)

    budget = int(args.budget_gb * GB)
    groups = weight_groups(config)
    cap = capacity(config, budget, groups)
    if any(not r["matches_plan"] for r in cap):
        mismatches.append("capacity vs kimiserve plan")

    result = dict(
        benchmark="dcp_traffic", model=PRESET, quick=args.quick, device="cpu (gloo)", cpu_model=_cpu_model(),
        cpu_count=os.cpu_count(), torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), git_commit=git_commit(),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        sizes=dict(index_topk=config.index_topk, mla_heads=config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
                   qk_rope_head_dim=config.qk_rope_head_dim, index_key_bytes={kv: key_bytes(kv, config) for kv in KEY_FORMATS}),
        convention=("bytes one rank sends per decode step per MLA layer: all-gather of n bytes per rank -> (D - 1) n; "
                    "all-to-all of n bytes per rank -> (D - 1) / D n; linear in the batch"),
        traffic=traffic, capacity=dict(context=CAPACITY_CONTEXT, budget_bytes_per_rank=budget, rows=cap),
        all_measured_equal_formula=not mismatches, wall_seconds=round(time.time() - t0, 1),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)

    print(f"\nbytes each rank sends per decode step per MLA layer, batch 1 ({PRESET}: k {config.index_topk}, "
          f"96 heads over tp = D, L {config.kv_lora_rank} + {config.qk_rope_head_dim}); "
          f"(a) exact merge, (b) all-gathered scores, (c) fetched index keys; m = measured on gloo = formula")
    print(f"{'context':>9} {'D':>2} {'a: cand':>9} {'a total':>9} {'b: scores':>10} {'b total':>10} "
          f"{'c fp8 total':>12} {'c fp4 total':>12} {'b/a':>5} {'c8/a':>6} {'m':>2}")
    for r8, r4 in zip(traffic[0::2], traffic[1::2]):
        if r8["batch"] != 1:
            continue
        m = "y" if r8.get("measured_equals_formula") and r4.get("measured_equals_formula") else \
            ("-" if "measured" not in r8 else "NO")
        print(f"{r8['context']:>9} {r8['D']:>2} {_fmt(r8['a_selection']):>9} {_fmt(r8['a_total']):>9} "
              f"{_fmt(r8['b_selection']):>10} {_fmt(r8['b_total']):>10} {_fmt(r8['c_total']):>12} "
              f"{_fmt(r4['c_total']):>12} {r8['b_total'] / r8['a_total']:5.1f} {r8['c_total'] / r8['a_total']:6.0f} {m:>2}")
    for r in traffic:
        if r["batch"] != 1 and r["key_format"] == "fp8":
            one = next(x for x in traffic if x["D"] == r["D"] and x["context"] == r["context"] and x["batch"] == 1
                       and x["key_format"] == "fp8")
            print(f"batch {r['batch']} at {r['context']}, D {r['D']}: (a) {_fmt(r['a_total'])} = {r['batch']} x "
                  f"{_fmt(one['a_total'])}" + (" (measured)" if r.get("measured_equals_formula") else ""))
    print(f"\nfull {CAPACITY_CONTEXT:,}-token contexts in one rank's pool of {budget / GB:g} GB "
          f"(CacheLayout of the per-rank config, pages_for_budget; = kimiserve plan)")
    print(f"{'mode':>5} {'D':>2} {'kv':>4} {'block':>6} {'page B':>10} {'pages':>7} {'pages/seq':>9} {'GB/seq':>7} "
          f"{'contexts':>8} {'plan':>5}")
    for r in cap:
        print(f"{r['mode'] + str(r['D']):>5} {r['D'] if r['mode'] == 'dcp' else 1:>2} {r['kv_cache_dtype']:>4} "
              f"{r['block_size']:>6} {_fmt(r['page_bytes']):>10} {_fmt(r['pages']):>7} {_fmt(r['pages_per_seq']):>9} "
              f"{r['bytes_per_seq'] / GB:7.2f} {r['full_contexts']:>8} {'=' if r['matches_plan'] else 'NO':>5}")
    print(f"\nwrote {args.out} in {time.time() - t0:.1f}s" + ("" if not mismatches else f"; MISMATCHES: {mismatches}"))
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
