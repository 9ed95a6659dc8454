"""Where a decode MoE layer's time goes at the K3.1 shape: the layer's launches as the engine runs them, back to back
in one CUDA graph, and each kernel's start, duration and the gap before it (torch.profiler's CUDA activity of one
replay).

A graph holds --layers calls of `ops.moe.triton.fused_moe`, each with its own routing draw (as a model's layers read
different experts; at 1 token a layer reads 281 MB, more than the 50 MB L2), or with --same-routing all with the
first draw (which tells a routing effect from a back-to-back one). The per-layer time of that graph is the
layer's cost inside an engine step; `moe_layer.py` times one call a replay, which also counts the replay's own start
(a few microseconds at 1 token). Per variant and token count:
- `layer_ms`: one call a graph (moe_layer.py's figure), median of 20 replays;
- `graph_layer_ms`: the --layers-call graph's replay / layers, and its bytes roofline share (the copy bandwidth of the
  same run; bytes as moe_layer.py counts them, summed over the layers' routings);
- `kernels`: one replay of the --layers-call graph under the profiler, per kernel of the middle layer: name, start
  (us from that layer's first kernel), duration and the idle gap before it; with each layer's span;
- `clocks_one_call`, `clocks_graph`: the SM clock and power draw while each was timed (`gpu_clocks.ClockLog`,
  nvidia-smi every 100 ms; None without it): at 16-64 tokens back-to-back layers hold the H200 at its 700 W cap
  and its SM clock drops (session 18); `wall_start` / `wall_end`: the row's UTC span.

    python benchmarks/moe_timeline.py [--tokens 1,16,64] [--layers 8] [--same-routing] [--variants default,SPEC,...]
        [--out benchmarks/results/moe_timeline.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_clocks import ClockLog, summarize  # noqa: E402
from moe_layer import copy_gbps, layer_bytes, packed_experts, route, shift_layout  # noqa: E402
from moe_specs import default_with_options, parse_variant  # noqa: E402

from kimiserve.utils.cuda_timing import capture_graph, cuda_time, graph_time  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402


def layer_calls(x, w, draws, cfg):
    """fn() running one fused_moe call per routing draw, each on its own output buffer."""
    from kimiserve.ops.moe import triton as tt

    outs = [torch.empty_like(x) for _ in draws]

    def fn():
        for (ids, weights), out in zip(draws, outs):
            tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                         w3_scale=w["w3_scale"], activation="situ", out=out, config=cfg, mxfp4_layout="shift")
    return fn


def kernel_timeline(graph: torch.cuda.CUDAGraph, layers: int) -> dict:
    """One profiled replay: the middle layer's kernels (start, duration, gap before) and every layer's span (us)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.name != "cudaGraphLaunch" and e.time_range.elapsed_us() >= 0),
                    key=lambda e: e.time_range.start)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events]
    per_layer = len(kernels) // layers
    if not kernels or len(kernels) % layers:
        return dict(error=f"{len(kernels)} kernels in a replay of {layers} layers",
                    names=[k[0][:60] for k in kernels[:20]])
    spans = [kernels[(i + 1) * per_layer - 1][2] - kernels[i * per_layer][1] for i in range(layers)]
    mid = layers // 2
    chunk = kernels[mid * per_layer:(mid + 1) * per_layer]
    prev_end = kernels[mid * per_layer - 1][2] if mid else chunk[0][1]
    t0 = chunk[0][1]
    rows = []
    for name, start, end in chunk:
        rows.append(dict(name=name[:80], start_us=start - t0, us=end - start, gap_us=start - prev_end))
        prev_end = end
    return dict(layer_spans_us=spans, middle_layer=rows, replay_span_us=kernels[-1][2] - kernels[0][1])


def time_row(x, shifted, draws, cfg, layers: int, copy: float, nbytes: list[int]) -> dict:
    """One call a replay (the first draw), the --layers-call graph per layer, one replay's kernels; the wall spans of
    the two timings (`_one_call_span`, `_graph_span`: seconds since the epoch, for the clock log)."""
    wall_start = datetime.datetime.now(datetime.timezone.utc).isoformat()
    t0 = time.time()
    one = graph_time(layer_calls(x, shifted, draws[:1], cfg), repeats=20)
    t1 = time.time()
    graph = capture_graph(layer_calls(x, shifted, draws, cfg))
    t2 = time.time()
    per_layer = cuda_time(graph.replay, repeats=20) / layers
    t3 = time.time()
    roofline = sum(nbytes) / layers / (copy * 1e9) * 1e3
    one_roofline = nbytes[0] / (copy * 1e9) * 1e3
    timeline = kernel_timeline(graph, layers)
    return dict(config=str(cfg), layer_ms=one, layer_roofline_fraction=one_roofline / one, graph_layer_ms=per_layer,
                roofline_ms=roofline, graph_roofline_fraction=roofline / per_layer, timeline=timeline,
                wall_start=wall_start, wall_end=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                _one_call_span=(t0, t1), _graph_span=(t2, t3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,64")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--routing", default="random", choices=("random", "zipf"))
    parser.add_argument("--same-routing", action="store_true", help="every layer of a graph with the first draw")
    parser.add_argument("--variants", default="default",
                        help="'default' (the shift layout's default config), 'default+OPT+...' (the same with "
                             "moe_layer.py's options: pdl, skS, dskS) and moe_layer.py variant specs")
    parser.add_argument("--shape", default="896,16,3584,3072", help="experts,top_k,hidden,intermediate")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "moe_timeline.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_timeline.py times CUDA graphs and needs a GPU", file=sys.stderr)
        return 2
    if args.layers < 1:
        raise SystemExit("--layers must be >= 1")
    from kimiserve.ops.moe import triton as tt

    E, k, h, inter = (int(v) for v in args.shape.split(","))
    variants = args.variants.split(",")
    for spec in variants:
        if spec != "default":
            default_with_options(spec, "default", tt.MoEConfig) or parse_variant(spec)
    copy = copy_gbps("cuda", 2**32, lambda fn: cuda_time(fn, repeats=10, warmup=3))
    w = packed_experts(E, h, inter, "cuda")
    shifted = shift_layout(w, True)
    per_expert = sum(w[n][0].numel() for n in w)
    del w
    result = dict(benchmark="moe_timeline", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=git_commit(),
                  command=" ".join(sys.argv), shape=dict(experts=E, top_k=k, hidden=h, intermediate=inter),
                  layers=args.layers, routing=args.routing, same_routing=args.same_routing, copy_gbps=copy, rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(f"{result['device']}: copy {copy:.0f} GB/s; {E} experts, top-{k}, {h} -> {inter}; {args.layers} layers a "
          "graph", flush=True)
    table = []
    with ClockLog() as clocks:
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, h, device="cuda").bfloat16()
            draws = [route(n, E, k, args.routing, "cuda", 1000 * n + (0 if args.same_routing else i))
                     for i in range(args.layers)]
            nbytes = [layer_bytes(int(torch.unique(ids).numel()), per_expert, n, h, 2, ids.numel())
                      for ids, _ in draws]
            for spec in variants:
                def default():
                    return tt.device_default_config(n, k, E, torch.bfloat16, True, "shift", (h, inter), "cuda")

                cfg = default() if spec == "default" else (default_with_options(spec, "default", default)
                                                           or parse_variant(spec))
                row = time_row(x, shifted, draws, cfg, args.layers, copy, nbytes)
                row.update(tokens=n, variant=spec)
                result["rows"].append(row)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
                table.append(row)
                print(f"{n:>4} tokens {spec:<36} one call {row['layer_ms']:.4f} ms "
                      f"({100 * row['layer_roofline_fraction']:.1f}%), in a graph of {args.layers}: "
                      f"{row['graph_layer_ms']:.4f} ms/layer ({100 * row['graph_roofline_fraction']:.1f}%)", flush=True)
                for k_row in row["timeline"].get("middle_layer", []):
                    print(f"      {k_row['start_us']:8.1f} us  {k_row['us']:8.1f} us  gap {k_row['gap_us']:6.1f}  "
                          f"{k_row['name'][:60]}", flush=True)
        samples = clocks.samples(wait=0.5)  # nvidia-smi's last lines
    for row in table:
        for name in ("one_call", "graph"):
            row[f"clocks_{name}"] = summarize(samples, *row.pop(f"_{name}_span"))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'tokens':>6} {'variant':<36} {'one call':>10} {'share':>6} {'graph/layer':>12} {'share':>6}"
          "  SM MHz mean/min, power-capped share (graph)")
    for r in table:
        c = r["clocks_graph"]
        clock = f"{c['sm_mhz_mean']:.0f}/{c['sm_mhz_min']} {100 * c['power_capped']:.0f}%" if c else "(no nvidia-smi)"
        print(f"{r['tokens']:>6} {r['variant']:<36} {r['layer_ms']:>10.4f} {100 * r['layer_roofline_fraction']:>5.1f}%"
              f" {r['graph_layer_ms']:>12.4f} {100 * r['graph_roofline_fraction']:>5.1f}%  {clock}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
