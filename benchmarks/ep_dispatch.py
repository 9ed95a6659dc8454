"""Expert-parallel dispatch / combine for small decode batches on gloo CPU ranks
(`kimiserve.distributed.expert_parallel`): time and bytes sent per rank of each scheme.

Shapes (from the presets): kimi-k3.1-pro (896 experts, top-16, latent width 3584, bf16 tokens) and
tiny (8 experts, top-2, width 32). N = 1, 4, 16, 64 decode tokens, EP = 2 and 4 ranks (one process and
one torch thread each, `tests/dist_utils.run_ranks`). Routing: k distinct uniform experts per token,
renormalised weights; the same routing on every rank. The expert computation is a stand-in (each
expert returns its rows unchanged: no FLOPs), so what is timed is the communication and the
dispatch bookkeeping (sorting, gathers, index_add); with it every scheme's output equals x (weights
sum to 1), which is checked.

Schemes, tokens replicated over the group (our layout: TP attention):
- a_all_reduce_fp32: local pairs -> fp32 partial [N, h] -> all-reduce (1 collective)
- a_all_reduce_bf16: the same, summed in bf16 (half the bytes; each partial rounded once)
- a_reduce_scatter: fp32 partial -> reduce-scatter (output split by tokens; 1 collective)
- b_all_to_all_replicated: rank r takes its token chunk -> counts, dispatch, combine all_to_all_single
  -> all-gather of the outputs (4 collectives)
tokens split over the ranks (data-parallel attention / token-sharded prefill layout):
- b_all_to_all: counts, dispatch, combine (3 collectives)
- a_gathered: all-gather tokens and routing, local experts, reduce-scatter (3 collectives; counts given)

Per row: median and p90 over iterations of the slowest rank's time of one call (a barrier before
each); bytes per rank per call from `CommStats` (the algorithm's payload: ring all-reduce 2 (W-1)/W of
the buffer, reduce-scatter (W-1)/W, all-gather (W-1) x local, all-to-all the rows sent off-rank), and
the bytes each process actually wrote to its sockets (/proc/self/io wchar: gloo's TCP transport
writes with writev; framing included), mean over ranks. Limits measured in the same run, per W:
each collective's latency (median of 1-value calls) and the loopback all-to-all bandwidth (a 32 MiB
all_to_all_single); floor_ms = sum of the call's collective latencies + bytes / bandwidth.

    python benchmarks/ep_dispatch.py [--ranks 2,4] [--tokens 1,4,16,64] [--shapes kimi-k3.1-pro,tiny]
        [--iters 30] [--out benchmarks/results/ep_dispatch.json]
    python benchmarks/ep_dispatch.py --quick --out /tmp/ep.json     # a few seconds: the smoke test's run

Writes the JSON (benchmark, device, date, commit, command, limits, rows) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import torch  # noqa: E402

SCHEMES = ("a_all_reduce_fp32", "a_all_reduce_bf16", "a_reduce_scatter", "b_all_to_all_replicated", "b_all_to_all",
           "a_gathered")
LAT_OPS = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
           "all_to_all_counts": "all_to_all", "all_to_all_dispatch": "all_to_all", "all_to_all_combine": "all_to_all"}


def socket_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def shape_of(name: str) -> dict:
    from kimiserve.config import load_preset

    c = load_preset(name)
    return dict(name=name, experts=c.num_experts, top_k=c.num_experts_per_token, hidden=c.moe_hidden_size,
                dtype="bfloat16")


def measure_limits(world: int, iters: int) -> dict:
    """Per-call times (s) of each collective at 1 value (4 rows of 1 for the reduce-scatter and the
    all-to-all), and of a 32 MiB all_to_all_single (the loopback bandwidth), on this rank; `merge`
    takes the slowest rank of each call, as for the schemes."""
    import torch.distributed as dist

    def timed(fn, n):
        times = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    one = torch.zeros(1)
    rows = torch.zeros(world)
    out_rows = torch.empty(world)
    small = torch.empty(1)
    gathered = torch.empty(world)
    lat = {
        "all_reduce": timed(lambda: dist.all_reduce(one), iters),
        "reduce_scatter": timed(lambda: dist.reduce_scatter_single(small, rows), iters),
        "all_gather": timed(lambda: dist.all_gather_single(gathered, one), iters),
        "all_to_all": timed(lambda: dist.all_to_all_single(out_rows, rows), iters),
    }
    big = torch.zeros(32 * 2**20 // 4)
    big_out = torch.empty_like(big)
    dist.all_to_all_single(big_out, big)  # warm
    return dict(latency=lat, bandwidth=timed(lambda: dist.all_to_all_single(big_out, big), max(3, iters // 10)),
                bandwidth_bytes=big.numel() * 4 * (world - 1) / world)


def rank_main(rank: int, world: int, shapes: list, tokens: list, iters: int, warmup: int, schemes: list) -> dict:
    import torch.distributed as dist

    from kimiserve.distributed.expert_parallel import (
        CommStats, EPGroup, ExpertPlacement, LocalExperts, ep_forward_all_to_all, ep_forward_all_to_all_replicated,
        ep_forward_gathered, ep_forward_replicated, token_chunk,
    )

    group = EPGroup.world()
    limits = measure_limits(world, max(2 * iters, 20))
    rows_out = []
    for shape in shapes:
        E, k, h = shape["experts"], shape["top_k"], shape["hidden"]
        dtype = getattr(torch, shape["dtype"])
        placement = ExpertPlacement.contiguous(E, world)
        experts = LocalExperts.from_rows_fn(lambda rows, slots: rows, placement.num_local)  # stand-in: no FLOPs
        for N in tokens:
            g = torch.Generator().manual_seed(1000 * N + E)  # the same routing on every rank
            x = torch.randn(N, h, generator=g).to(dtype)
            ids = torch.rand(N, E, generator=g).topk(k, dim=-1).indices
            weights = torch.rand(N, k, generator=g) + 0.1
            weights = weights / weights.sum(-1, keepdim=True)
            mine = token_chunk(N, world, rank)
            counts = [(lambda s: s.stop - s.start)(token_chunk(N, world, r)) for r in range(world)]
            calls = {
                "a_all_reduce_fp32": lambda s: ep_forward_replicated(x, ids, weights, placement, group, experts,
                                                                     stats=s),
                "a_all_reduce_bf16": lambda s: ep_forward_replicated(x, ids, weights, placement, group, experts,
                                                                     comm_dtype=torch.bfloat16, stats=s),
                "a_reduce_scatter": lambda s: ep_forward_replicated(x, ids, weights, placement, group, experts,
                                                                    output="reduce_scatter", stats=s),
                "b_all_to_all_replicated": lambda s: ep_forward_all_to_all_replicated(x, ids, weights, placement, group,
                                                                                      experts, stats=s),
                "b_all_to_all": lambda s: ep_forward_all_to_all(x[mine], ids[mine], weights[mine], placement, group,
                                                                experts, stats=s),
                "a_gathered": lambda s: ep_forward_gathered(x[mine], ids[mine], weights[mine], placement, group,
                                                            experts, token_counts=counts, stats=s),
            }
            for scheme in schemes:
                fn = calls[scheme]
                for _ in range(warmup):
                    fn(None)
                times, comm, stats = [], [], CommStats()
                wire = 0
                for _ in range(iters):
                    dist.barrier()
                    c0 = stats.seconds
                    w0 = socket_bytes()
                    t0 = time.perf_counter()
                    out = fn(stats)
                    times.append(time.perf_counter() - t0)
                    wire += socket_bytes() - w0
                    comm.append(stats.seconds - c0)
                expect = x[mine] if scheme in ("b_all_to_all", "a_gathered") else (
                    x[token_chunk(N, world, rank)] if scheme == "a_reduce_scatter" else x)
                err = float((out.double() - expect.double()).pow(2).mean().sqrt()
                            / expect.double().pow(2).mean().sqrt().clamp_min(1e-30)) if expect.numel() else 0.0
                rows_out.append(dict(shape=shape["name"], ranks=world, tokens=N, scheme=scheme, times=times, comm=comm,
                                     collectives=stats.collectives / iters, model_bytes=stats.bytes_sent / iters,
                                     by_op={op: (c / iters, b / iters) for op, (c, b) in stats.by_op.items()},
                                     socket_bytes=wire / iters, rel_rms_vs_x=err))
    return dict(limits=limits, rows=rows_out)


def merge(per_rank: list, world: int) -> tuple[dict, list]:
    lim = [r["limits"] for r in per_rank]

    def slowest_median(lists):  # per call the slowest rank, then the median over calls
        return statistics.median(max(ts) for ts in zip(*lists))

    limits = dict(ranks=world,
                  latency_ms={op: 1e3 * slowest_median([l["latency"][op] for l in lim]) for op in lim[0]["latency"]},
                  a2a_bandwidth_gbps=lim[0]["bandwidth_bytes"] / slowest_median([l["bandwidth"] for l in lim]) / 1e9)
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        same = [r["rows"][i] for r in per_rank]
        slowest = [max(ts) for ts in zip(*(s["times"] for s in same))]
        ms = sorted(t * 1e3 for t in slowest)
        comm_ms = [max(c) * 1e3 for c in zip(*(s["comm"] for s in same))]  # the slowest rank's time in collectives
        book_ms = [min(t - c for t, c in zip(s["times"], s["comm"])) * 1e3 for s in same]  # outside them, best call
        model = statistics.mean(s["model_bytes"] for s in same)
        floor = sum(c * limits["latency_ms"][LAT_OPS[op]] for op, (c, _) in row["by_op"].items())
        floor += model / (limits["a2a_bandwidth_gbps"] * 1e9) * 1e3
        rows.append(dict(
            shape=row["shape"], ranks=world, tokens=row["tokens"], scheme=row["scheme"],
            collectives=row["collectives"], median_ms=statistics.median(ms), min_ms=ms[0],
            p90_ms=ms[min(len(ms) - 1, int(0.9 * len(ms)))], comm_median_ms=statistics.median(comm_ms),
            bookkeeping_min_ms=max(book_ms),
            floor_ms=floor, bytes_per_rank=model, bytes_per_rank_max=max(s["model_bytes"] for s in same),
            socket_bytes_per_rank=statistics.mean(s["socket_bytes"] for s in same),
            by_op={op: [c, statistics.mean(s["by_op"][op][1] for s in same)] for op, (c, _) in row["by_op"].items()},
            rel_rms_vs_x=max(s["rel_rms_vs_x"] for s in same), iters=len(ms)))
    return limits, rows


def table(rows: list) -> str:
    head = ("| shape | EP | N | scheme | coll. | bytes/rank (model) | socket bytes/rank | median ms | min ms | "
            "p90 ms | in collectives ms | bookkeeping ms | floor ms |")
    lines = [head, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['ranks']} | {r['tokens']} | {r['scheme']} | {r['collectives']:g} | "
                     f"{r['bytes_per_rank']:,.0f} | {r['socket_bytes_per_rank']:,.0f} | {r['median_ms']:.3f} | "
                     f"{r['min_ms']:.3f} | {r['p90_ms']:.3f} | {r['comm_median_ms']:.3f} | "
                     f"{r['bookkeeping_min_ms']:.3f} | {r['floor_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--shapes", default="kimi-k3.1-pro,tiny")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated, run in this order")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="EP 2, N = 1 and 4, 3 iterations: the smoke test")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per rank count before the ranks are killed")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "ep_dispatch.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.tokens, args.iters, args.warmup = "2", "1,4", 3, 1
    from dist_utils import run_ranks
    from kimiserve.utils.run_info import git_commit

    shapes = [shape_of(s) for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    schemes = args.schemes.split(",")
    if not set(schemes) <= set(SCHEMES):
        ap.error(f"--schemes: unknown {sorted(set(schemes) - set(SCHEMES))}; known: {', '.join(SCHEMES)}")
    result = dict(benchmark="ep_dispatch", device=f"cpu ({platform.processor() or platform.machine()}, "
                                                  f"{os.cpu_count()} cores), gloo over loopback",
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  commit=git_commit(),
                  command="python benchmarks/ep_dispatch.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  quick=args.quick, torch=torch.__version__, shapes=shapes, iters=args.iters,
                  expert_compute="stand-in: each expert returns its rows (communication and bookkeeping timed)",
                  limits=[], rows=[])
    for world in (int(w) for w in args.ranks.split(",")):
        per_rank = run_ranks(world, rank_main, shapes, tokens, args.iters, args.warmup, schemes,
                             timeout=args.timeout)
        limits, rows = merge(per_rank, world)
        result["limits"].append(limits)
        result["rows"].extend(rows)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for lim in result["limits"]:
        lat = ", ".join(f"{op} {v:.3f}" for op, v in lim["latency_ms"].items())
        print(f"EP {lim['ranks']}: latency ms {lat}; all-to-all bandwidth {lim['a2a_bandwidth_gbps']:.2f} GB/s")
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
