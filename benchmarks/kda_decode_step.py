"""A KDA layer's whole decode step after the projections (issue 15 item 2: <= 10 us per layer at
batch 1): the fused Triton kernel (`ops/kda/triton_decode.py`) against the composition the engine ran
before it (torch short conv over the gathered conv pages, L2 norms, gate, beta, fla-core's
`fused_recurrent_kda` on the state pages in place, torch gated RMSNorm) and against fla's delta-rule
kernel alone, each replayed from a CUDA graph (as the engine's decode steps run). The kernel in its
forms: "fused" (one program per sequence and head), "split BV=n" (`block_v=n`: the head's V columns
over programs in blocks of n, three kernels) and "one BV=n" (`--block-v one<n>`: the same blocks in one
launch, the last block of a head to finish doing its norm; `counters`); each kernel variant's output and
conv pages after one call are checked against the composition before it (rel RMS; conv pages
bit-equal), and a "one BV=n" beside a "split BV=n" for bit-equality with it.

Two times per variant: `us`, one call replayed from a graph of its own (so each replay pays the graph's
launch, several us at batch 1), and `us_in_graph` (`--layers-in-graph N`, up to batch 64), one call's share
of a graph of N calls each on its own copy of the state and conv pages, as N layers run inside one decode
step's graph (the pages of N layers are past the L2 cache at 96 heads, as in a step, where other layers'
weights pass through it between two KDA layers).

Sizes: a K3.1 layer (96 heads x 128, conv 4) on one GPU and one TP8 rank's share (12 heads); state
and conv pages as strided views of a pool (page stride past the page). Bytes per step: the fp32
state read and written (2 x H x K x V x 4 per sequence), the conv state read and written, the five
[H * K] inputs, beta's logits and the output; the copy bandwidth is measured in the same run.

    python benchmarks/kda_decode_step.py [--batches 1,8,64,256] [--heads 96,12] [--block-v 32,64] [--out PATH]
    python benchmarks/kda_decode_step.py --batches 1,2,4,8 --block-v 32,one32,one16   # the one-launch form
    python benchmarks/kda_decode_step.py --cpu-smoke     # Triton interpreter, tiny sizes (plumbing)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.ops.kda import paged  # noqa: E402
from kimiserve.utils.run_info import git_commit, results_path  # noqa: E402


def make_case(B: int, H: int, K: int, W: int, device: str, gen: torch.Generator):
    P = H * K
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(device)  # noqa: E731
    xs = [rnd(B, P).bfloat16() for _ in range(5)]
    b = rnd(B, H).bfloat16()
    weights = paged.KDADecodeWeights(rnd(P, W, scale=0.5), rnd(P, W, scale=0.5), rnd(P, W, scale=0.5),
                                     rnd(H, scale=0.5), rnd(P), -5.0, 1 + rnd(K, scale=0.1), 1e-5)
    pages = B + 3
    state_n, conv_n = H * K * K, 3 * P * (W - 1)
    states = torch.zeros(pages, state_n + 64, device=device)[:, :state_n].view(pages, H, K, K)
    states.copy_(rnd(pages, H, K, K, scale=0.1))
    conv = torch.zeros(pages, conv_n + 64, device=device, dtype=torch.bfloat16)[:, :conv_n].view(pages, 3, P, W - 1)
    conv.copy_(rnd(pages, 3, P, W - 1).bfloat16())
    page_ids = torch.randperm(pages, generator=gen)[:B].to(device)
    q, k, v, f, gate = xs
    return (q, k, v, f, b, gate, weights, conv, states, page_ids)


def step_bytes(B: int, H: int, K: int, W: int) -> int:
    P = H * K
    return B * (2 * H * K * K * 4 + 2 * 3 * P * (W - 1) * 2 + 5 * P * 2 + H * 2 + P * 2)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def layers_graph_time(fn, case, layers: int, fla=None) -> float:
    """Milliseconds of one call of fn in a CUDA graph of `layers` calls, each on its own copy of the case's
    conv and state pages (fn None: fla's delta rule alone on fixed gates, as in `main`)."""
    from kimiserve.utils.cuda_timing import graph_time

    q, k, v, f, b, gate, weights, conv, states, page_ids = case
    pages = [(conv.clone(), states.clone()) for _ in range(layers)]
    if fn is None:
        B, P = q.shape
        H = b.shape[1]
        K = P // H
        qh, kh, vh = (t.view(B, 1, H, K) for t in (q, k, v))
        g = torch.full((B, 1, H, K), -0.1, device=q.device)
        beta = torch.full((B, 1, H), 0.5, device=q.device)
        calls = [functools.partial(fla.kda_decode, qh, kh, vh, g, beta, st, page_ids) for _, st in pages]
    else:
        calls = [functools.partial(fn, q, k, v, f, b, gate, weights, cv, st, page_ids) for cv, st in pages]

    def every_layer():
        for call in calls:
            call()

    return graph_time(every_layer) / layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--heads", default="96,12", help="KDA heads per GPU (96: one GPU; 12: a TP8 rank)")
    parser.add_argument("--block-v", default="32,64", help="V blocks of the split form to time ('' for none); "
                        "one<n> (e.g. one32): the one-launch split form with blocks of n")
    parser.add_argument("--layers-in-graph", type=int, default=16,
                        help="calls (each on its own pages) in the graph of `us_in_graph` (0: not timed)")
    parser.add_argument("--compare-module", default=None,
                        help="files with other versions of ops/kda/triton_decode.py, comma-separated (e.g. `git show "
                        "REV:kimiserve/ops/kda/triton_decode.py > old.py`): each one's single kernel timed beside as "
                        "'fused (<file name>)'")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--out", default=None,
                        help="the JSON (default benchmarks/results/kda_decode_step.json; a CPU smoke run's "
                             "under the temp dir)")
    args = parser.parse_args()
    args.out = args.out or results_path("kda_decode_step.json", smoke=args.cpu_smoke)
    K, W = 128, 4
    if args.cpu_smoke:  # the interpreter with the tests' patches (a loop bound from a scalar, float casts)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        import triton_interpreter_shims

        triton_interpreter_shims.enable()
        device, batches, heads, K = "cpu", [1, 3], [2], 16
    else:
        device, batches, heads = "cuda", [int(x) for x in args.batches.split(",")], [int(x) for x in args.heads.split(",")]
    from kimiserve.ops.kda import triton_decode

    variants = {"fused": functools.partial(triton_decode.kda_decode_step, fallback=paged.kda_decode, block_v=None)}
    for i, path in enumerate(x for x in (args.compare_module or "").split(",") if x):
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"compared_triton_decode_{i}", path)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        variants[f"fused ({os.path.basename(path)})"] = functools.partial(
            other.kda_decode_step, fallback=paged.kda_decode, block_v=None)
    for spec in (x for x in args.block_v.split(",") if x):
        one = spec.startswith("one")
        bv = int(spec[3:] if one else spec)
        variants[f"{'one' if one else 'split'} BV={bv}"] = functools.partial(
            triton_decode.kda_decode_step, fallback=paged.kda_decode, block_v=bv,
            counters=triton_decode.StepCounters() if one else None)
    kernels = [name for name in variants]
    if device == "cuda":
        from kimiserve.ops.kda import fla
        from kimiserve.utils.cuda_timing import cuda_time, graph_time

        variants["torch + fla"] = functools.partial(paged.kda_decode_step, kda_decode=fla.kda_decode)
        variants["fla delta rule only"] = None
        src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        copy = 2 * src.numel() * 4 / (cuda_time(lambda: dst.copy_(src), repeats=10) * 1e-3) / 1e9
    else:
        from kimiserve.utils.cuda_timing import wall_time as graph_time

        copy = float("nan")
    variants["torch reference"] = paged.kda_decode_step
    rows, failed = [], False
    result = {"benchmark": "kda_decode_step", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "date": datetime.date.today().isoformat(), "commit": git_commit(),
              "copy_gbps": copy}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def write(rows):
        with open(args.out, "w") as fh:
            json.dump({**result, "rows": rows}, fh, indent=1)

    gen = torch.Generator().manual_seed(0)
    for H in heads:
        for B in batches:
            case = make_case(B, H, K, W, device, gen)
            outs, convs = {}, {}
            for name, fn in variants.items():
                if fn is None:  # fla's kernel on already-mixed inputs (what the engine paid for the delta rule alone)
                    q, k, v, f, b, gate, weights, conv, states, page_ids = case
                    qh, kh, vh = (t.view(B, 1, H, K) for t in (q, k, v))
                    g = torch.full((B, 1, H, K), -0.1, device=device)
                    beta = torch.full((B, 1, H), 0.5, device=device)
                    run = lambda: fla.kda_decode(qh, kh, vh, g, beta, states, page_ids)  # noqa: E731
                else:
                    conv, states = case[7].clone(), case[8].clone()
                    args_ = (*case[:7], conv, states, case[9])
                    outs[name] = fn(*args_)
                    convs[name] = conv.clone()
                    run = functools.partial(fn, *args_)
                ms = graph_time(run) if device == "cuda" else graph_time(run, repeats=1)
                in_graph = None
                if device == "cuda" and args.layers_in_graph > 0 and B <= 64:
                    in_graph = 1e3 * layers_graph_time(fn, case, args.layers_in_graph, fla if fn is None else None)
                nbytes = step_bytes(B, H, K, W)
                row = {"heads": H, "batch": B, "variant": name, "us": ms * 1e3, "us_in_graph": in_graph, "bytes": nbytes,
                       "roofline_us": nbytes / (copy * 1e9) * 1e6 if copy == copy else None}
                row["roofline_fraction"] = row["roofline_us"] / row["us"] if row["roofline_us"] else None
                rows.append(row)
            previous = "torch + fla" if "torch + fla" in outs else "torch reference"
            checks = []
            for row in rows[-len(variants):]:
                if row["variant"] in kernels:
                    row["vs_previous_rel_rms"] = rel_rms(outs[row["variant"]], outs[previous])
                    row["conv_pages_equal_previous"] = torch.equal(convs[row["variant"]], convs[previous])
                    split = row["variant"].replace("one", "split")
                    if row["variant"].startswith("one") and split in outs:
                        row["bit_equal_split"] = torch.equal(outs[row["variant"]], outs[split])
                    bits = {True: " (= split)", False: " (split's bits differ)"}.get(row.get("bit_equal_split"), "")
                    checks.append(f"{row['variant']} {row['vs_previous_rel_rms']:.1e}"
                                  + ("" if row["conv_pages_equal_previous"] else " CONV PAGES DIFFER") + bits)
                    failed |= not (row["vs_previous_rel_rms"] < 2e-2 and row["conv_pages_equal_previous"])
            print(f"H {H:3d} batch {B:4d}: " + ", ".join(
                      f"{r['variant']} {r['us']:.1f} us" + ("" if r["us_in_graph"] is None else f" ({r['us_in_graph']:.1f} in graph)")
                      for r in rows[-len(variants):])
                  + f"; roofline {rows[-1]['roofline_us'] or float('nan'):.1f} us; rel RMS vs previous: "
                  + ", ".join(checks), flush=True)
            write(rows)  # after every (heads, batch): a run cut by a time limit keeps what it measured
    if failed:
        print("FAILED: a kernel variant's output is over 2e-2 rel RMS from the composition, or its conv pages differ")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
