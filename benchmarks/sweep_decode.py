"""Tuning sweep of the sparse decode step's Triton kernels (index scan, top-k, sparse MLA) on the GPU.

On decode_attention.py's inputs (K3.1 per-layer sizes, the engine's packed FP8 pages, the `small`
preset's 4608-token pages, shuffled page ids), each kernel runs under a grid of its launch knobs.
Every variant is checked against the kernel's default launch on the same inputs (scan: relative
RMS < 1e-5; top-k: the same selected sets; sparse MLA: relative RMS < 1e-3) and timed as a
CUDA-graph replay. Bytes: scan 132 B read + 4 B written per context token; top-k the scores read
once (4 B per token) + k int64 positions written; sparse MLA 576 B per selected latent. After each
case the whole sparse step is timed with the defaults and with each kernel's best variant.

Variants that fail to compile or launch are recorded (status "error: ...") and skipped. The time
budget (--max-seconds) covers the whole run: worker processes first compile every variant in
parallel into Triton's on-disk cache (on a few-page pool of the same layout, so the same kernel
specialisations; at most half the budget), then the cases share what is left: defaults first, then
the three kernels' variants in turn; those left when a case's share runs out are recorded as
"skipped".

    python benchmarks/sweep_decode.py [--contexts 131072,1048576] [--batches 1,64] [--kernels scan,topk,mla]
                                      [--max-seconds 240] [--compile-workers N] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import itertools
import json
import math
import multiprocessing
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_attention import INDEX_BYTES, LATENT_BYTES, build_case, copy_bandwidth_gbps  # noqa: E402
from kimiserve.cache.layout import CacheLayout  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

KERNELS = ("scan", "topk", "mla")
PRESET = "small"


def grids(block_size: int) -> dict[str, list[dict]]:
    """Each kernel's knob dicts (keyword arguments of its wrapper; MLA: DecodeConfig fields), the
    default launch first."""
    from kimiserve.ops.indexer.triton import _default_block_s, paged_indexer_scores
    from kimiserve.ops.mla.triton import default_config
    from kimiserve.ops.topk.triton import topk_indices

    def defaults(fn, names):
        params = inspect.signature(fn).parameters
        return {n: params[n].default for n in names}

    scan_default = defaults(paged_indexer_scores, ("block_s", "tiles", "num_warps", "num_stages"))
    scan_default["block_s"] = scan_default["block_s"] or _default_block_s(block_size)
    scan = [dict(block_s=b, tiles=t, num_warps=w, num_stages=s)
            for b, t, w, s in itertools.product((64, 128, 256), (1, 2, 4, 8, 16), (4, 8), (2, 3, 4))]
    topk_default = defaults(topk_indices, ("block", "num_warps", "window", "cap"))
    topk = [dict(block=b, num_warps=w, window=win, cap=c)
            for b, w, win, c in itertools.product((2048, 4096, 8192, 16384), (4, 8), (128, 256), (128, 256, 512))]
    mla_default = dataclasses.asdict(default_config(torch.bfloat16))
    mla = [dict(mla_default, block_n=n, num_warps=w, num_stages=s, waves=v)
           for n, w, s, v in itertools.product((16, 32, 64), (4, 8), (1, 2, 3), (1, 2, 4))]
    mla += [dict(mla_default, **extra) for extra in (
        dict(block_h=16), dict(block_h=16, num_warps=4), dict(block_h=64), dict(reload=False),
        dict(reload=False, num_stages=3), dict(min_split_tokens=32), dict(min_split_tokens=128),
        dict(min_split_tokens=256), dict(waves=8), dict(block_n=16, min_split_tokens=16))]
    out = {}
    for name, default, grid in (("scan", scan_default, scan), ("topk", topk_default, topk), ("mla", mla_default, mla)):
        out[name] = [default]
        for g in grid:
            if g not in out[name]:
                out[name].append(g)
    return out


def kernel_fns() -> dict:
    """kernel name -> fn(case, knobs): one launch on the case's inputs."""
    from kimiserve.ops.indexer.triton import paged_indexer_scores
    from kimiserve.ops.mla.triton import DecodeConfig, paged_sparse_mla_decode
    from kimiserve.ops.topk.triton import topk_indices

    bf16 = torch.bfloat16

    def scan(c, knobs):
        pool = c["pool"]
        return paged_indexer_scores(c["iq"], c["iw"], pool.index_key[0], pool.index_scale[0], c["tables"], c["lens"],
                                    bf16, max_context=c["context"], **knobs)

    def topk(c, knobs):
        return topk_indices(c["scores"], c["topk"], c["lens"], **knobs)

    def mla(c, knobs):
        return paged_sparse_mla_decode(c["q_latent"], c["q_pe"], c["pool"].latent[0], 1.0, c["tables"], c["idx"],
                                       c["scale"], bf16, config=DecodeConfig(**knobs))

    return dict(scan=scan, topk=topk, mla=mla)


def prepare(c: dict, context: int, topk: int, fns: dict, defaults: dict) -> dict:
    """The case plus the default scan's scores and top-k's indices (the inputs of the later kernels)."""
    c.update(context=context, topk=topk)
    c["scores"] = fns["scan"](c, defaults["scan"])
    c["idx"] = fns["topk"](c, defaults["topk"])
    return c


def kernel_bytes(kernel: str, batch: int, context: int, topk: int) -> int:
    per_seq = dict(scan=context * (INDEX_BYTES + 4), topk=context * 4 + topk * 8, mla=min(topk, context) * LATENT_BYTES)
    return batch * per_seq[kernel]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def agreement(kernel: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(agrees with the default, error): relative RMS (scan, MLA) or the fraction of rows whose sets differ."""
    if kernel == "topk":
        err = float((out.sort(dim=-1).values != ref.sort(dim=-1).values).any(dim=-1).float().mean())
        return err == 0.0, err
    if kernel == "scan":
        finite = torch.isfinite(ref)
        if not torch.equal(finite, torch.isfinite(out)):
            return False, math.inf
        err = rel_rms(out[finite], ref[finite])
        return err < 1e-5, err
    err = rel_rms(out, ref)
    return err < 1e-3, err


def error_text(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"error: {type(e).__name__}: {first[:300]}"


# parallel precompile -------------------------------------------------------------------------------
def warm_case(config, batch: int, context: int) -> dict:
    """decode_attention's shapes over an 8-page pool (block tables point anywhere in it): the same
    kernel specialisations for a fraction of the memory."""
    bs = CacheLayout.from_config(config, "fp8", torch.bfloat16).block_size
    c = build_case(config, 1, 8 * bs)
    c["tables"] = torch.randint(0, c["pool"].num_pages, (batch, math.ceil(context / bs)), device="cuda")
    c["lens"] = torch.full((batch,), context, device="cuda", dtype=torch.int64)
    for name in ("q_latent", "q_pe", "iq", "iw"):
        c[name] = c[name].repeat(batch, *[1] * (c[name].dim() - 1))
    return c


def _warm_worker(job) -> tuple[int, int, str | None]:
    """Compile (by launching once) each (kernel, knobs) task on every case; (launched, failed, first error)."""
    tasks, cases, defaults, deadline = job
    config, fns = load_preset(PRESET), kernel_fns()
    launched = failed = 0
    first_error = None
    for batch, context in cases:
        if time.time() > deadline:
            break
        try:
            c = prepare(warm_case(config, batch, context), context, config.index_topk, fns, defaults)
        except Exception as e:
            failed, first_error = failed + 1, first_error or error_text(e)
            continue
        for kernel, knobs in tasks:
            if time.time() > deadline:
                break
            try:
                fns[kernel](c, knobs)
                launched += 1
            except Exception as e:
                failed, first_error = failed + 1, first_error or f"{kernel} {knobs}: {error_text(e)}"
        torch.cuda.synchronize()
        del c
        torch.cuda.empty_cache()
    return launched, failed, first_error


def precompile(tasks: list, cases: list, defaults: dict, workers: int, deadline: float) -> dict:
    """Run `_warm_worker` over `workers` spawned processes (tasks dealt round-robin) until the deadline."""
    t0 = time.time()
    if workers < 1 or not tasks:
        return dict(workers=0, seconds=0.0)
    jobs = [(tasks[i::workers], cases, defaults, deadline) for i in range(workers)]
    counts, status = None, "done"
    try:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:  # leaving the block terminates the workers
            counts = pool.map_async(_warm_worker, jobs).get(timeout=max(1.0, deadline - time.time() + 20))
    except multiprocessing.TimeoutError:
        status = "timed out"
    except Exception as e:
        status = error_text(e)
    info = dict(workers=workers, seconds=time.time() - t0, status=status)
    if counts:
        info.update(launched=sum(c[0] for c in counts), failed=sum(c[1] for c in counts),
                    first_error=next((c[2] for c in counts if c[2]), None))
    return info


# the sweep ------------------------------------------------------------------------------------------
def sweep_case(c: dict, batch: int, fns: dict, grid: dict, kernels: list, deadline: float, repeats: int) -> list[dict]:
    """Rows of every (kernel, knobs) of this case: defaults first, then the kernels' variants in turn."""
    from kimiserve.utils.cuda_timing import graph_time

    context, topk = c["context"], c["topk"]
    ref, rows = {}, []

    def measure(kernel, knobs, is_default):
        row = dict(kernel=kernel, context=context, batch=batch, config=knobs, default=is_default, ms=None, gbps=None,
                   error=None)
        t0 = time.time()
        try:
            out = fns[kernel](c, knobs)
            if is_default:
                ref[kernel], ok = out, True
            else:
                ok, row["error"] = agreement(kernel, out, ref[kernel])
            del out
            row["ms"] = graph_time(lambda: fns[kernel](c, knobs), repeats=repeats)
            row["gbps"] = kernel_bytes(kernel, batch, context, topk) / (row["ms"] * 1e-3) / 1e9
            row["status"] = "ok" if ok else "mismatch"
        except Exception as e:
            row["status"] = error_text(e)
        row["seconds"] = time.time() - t0
        torch.cuda.empty_cache()
        return row

    queues = {k: list(grid[k][1:]) for k in kernels}
    rows += [measure(k, grid[k][0], True) for k in kernels]
    while any(queues.values()):
        for k in kernels:
            if queues[k] and time.time() < deadline:
                rows.append(measure(k, queues[k].pop(0), False))
        if time.time() >= deadline:
            rows += [dict(kernel=k, context=context, batch=batch, config=q, default=False, ms=None, gbps=None,
                          error=None, status="skipped: time budget") for k in kernels for q in queues[k]]
            break
    return rows


def best_rows(rows: list[dict]) -> dict:
    """(kernel, context, batch) -> (default row, fastest row agreeing with the default)."""
    out = {}
    for r in rows:
        key = (r["kernel"], r["context"], r["batch"])
        d, b = out.get(key, (None, None))
        if r["default"]:
            d = r
        if r["status"] == "ok" and (b is None or r["ms"] < b["ms"]):
            b = r
        out[key] = (d, b)
    return out


def step_times(c: dict, fns: dict, knobs: dict, defaults: dict, repeats: int) -> dict:
    """The whole sparse step (scan -> top-k -> sparse MLA) with the default and with the best knobs."""
    from kimiserve.utils.cuda_timing import graph_time

    def step(kn):
        d = dict(c)
        d["scores"] = fns["scan"](d, kn["scan"])
        d["idx"] = fns["topk"](d, kn["topk"])
        return fns["mla"](d, kn["mla"])

    out = dict(context=c["context"], batch=c["lens"].numel(), best_config=knobs)
    for name, kn in (("default", defaults), ("best", knobs)):
        try:
            out[f"{name}_ms"] = graph_time(lambda: step(kn), repeats=repeats)
        except Exception as e:
            out[f"{name}_ms"], out[f"{name}_status"] = None, error_text(e)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="131072,1048576")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="a subset of scan,topk,mla")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="wall-clock budget of the whole run")
    parser.add_argument("--compile-workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes compiling the variants in parallel first (0: compile on first use)")
    parser.add_argument("--repeats", type=int, default=20, help="CUDA-graph replays timed per variant")
    parser.add_argument("--out", default="benchmarks/results/sweep_decode.json")
    args = parser.parse_args()
    start = time.time()
    deadline = start + args.max_seconds
    kernels = [k for k in args.kernels.split(",") if k]
    if set(kernels) - set(KERNELS):
        parser.error(f"--kernels takes a subset of {','.join(KERNELS)}")
    if not torch.cuda.is_available():
        print("sweep_decode.py times Triton kernels and needs a CUDA device (none found)", file=sys.stderr)
        return 2
    import triton

    config = load_preset(PRESET)
    layout = CacheLayout.from_config(config, "fp8", torch.bfloat16)
    grid, fns = grids(layout.block_size), kernel_fns()
    defaults = {k: g[0] for k, g in grid.items()}
    cases = [(int(b), int(s)) for b in args.batches.split(",") for s in args.contexts.split(",")]
    rounds = itertools.zip_longest(*(grid[k] for k in kernels))  # kernels in turn: each worker gets a mix
    tasks = [(k, g) for variants in rounds for k, g in zip(kernels, variants) if g is not None]
    compile_info = precompile(tasks, cases, defaults, args.compile_workers, start + args.max_seconds / 2)
    print(f"precompile: {json.dumps(compile_info)}", flush=True)
    copy_gbps = copy_bandwidth_gbps()
    commit = git_commit()
    result = dict(benchmark="sweep_decode", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  commit=commit, command=" ".join(sys.argv), preset=PRESET, max_seconds=args.max_seconds,
                  precompile=compile_info, copy_gbps=copy_gbps, grid_sizes={k: len(grid[k]) for k in kernels},
                  defaults=defaults, rows=[], steps=[], skipped_cases=[])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save():  # after every case: a run cut short keeps what it measured
        result["wall_seconds"] = time.time() - start
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    save()
    for i, (batch, context) in enumerate(cases):
        need = batch * math.ceil(context / layout.block_size) * layout.page_bytes * 1.2 + batch * context * 16
        if need > torch.cuda.mem_get_info()[0]:
            result["skipped_cases"].append(dict(batch=batch, context=context, reason=f"needs ~{need / 2**30:.0f} GiB"))
            save()
            continue
        case_deadline = time.time() + (deadline - time.time()) / (len(cases) - i)
        c = prepare(build_case(config, batch, context), context, config.index_topk, fns, defaults)
        rows = sweep_case(c, batch, fns, grid, kernels, case_deadline, args.repeats)
        result["rows"] += rows
        if set(kernels) == set(KERNELS):
            best = {k: (b or d)["config"] for (k, _, _), (d, b) in best_rows(rows).items()}
            result["steps"].append(step_times(c, fns, best, defaults, args.repeats))
        del c
        torch.cuda.empty_cache()
        save()
        n = {s: sum(r["status"].startswith(s) for r in rows) for s in ("ok", "mismatch", "error", "skipped")}
        print(f"batch {batch} context {context}: {n} ({time.time() - start:.0f} s)", flush=True)

    print(f"\ncopy bandwidth {copy_gbps:.0f} GB/s (read + write); times in ms, CUDA graph replay; "
          f"{time.time() - start:.0f} s")
    print("kernel  context  batch  default     best  speedup  GB/s default  GB/s best  % copy  best config")
    for (k, s, b), (d, r) in best_rows(result["rows"]).items():
        if d is None or d["ms"] is None or r is None:
            print(f"{k:<6} {s:>8} {b:>6}  default failed: {d and d['status']}")
            continue
        cfg = {key: v for key, v in r["config"].items() if v != d["config"].get(key)} or "default"
        print(f"{k:<6} {s:>8} {b:>6} {d['ms']:8.4f} {r['ms']:8.4f} {d['ms'] / r['ms']:8.2f} {d['gbps']:13.0f} "
              f"{r['gbps']:10.0f} {100 * r['gbps'] / copy_gbps:7.1f}  {cfg}")
    for st in result["steps"]:
        if st.get("default_ms") and st.get("best_ms"):
            print(f"sparse step, context {st['context']} batch {st['batch']}: default {st['default_ms']:.4f} ms, "
                  f"best knobs {st['best_ms']:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
