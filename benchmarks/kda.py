"""KDA on the GPU: fla-core prefill and decode through the engine's state pages vs fla-core on plain
tensors (the cost of the page indirection), and the plain-PyTorch reference.

Real per-layer Kimi-K3.1-Pro sizes (the `kimi-k3.1-pro` preset: 96 heads x 128, an fp32 state
[H, K, V] of 6 MiB per sequence), states in a real PagePool (the preset's fp8 layout: 6.2 MiB pages,
state view with a page stride), bf16 q/k/v, fp32 g and beta as the model makes them.
- decode, B sequences of one token: paged = `ops.kda.fla.kda_decode` updating B random distinct
  state pages in place (ssm_state_indices), as the engine does; plain = fla's
  `fused_recurrent_kda_fwd` in place on a contiguous [B, H, K, V] state; reference = the pure-torch
  gather / recurrent step / scatter (`ops.kda.paged.kda_decode`). CUDA-graph replays (eager too).
- prefill, S sequences of T tokens: paged = the S sequences packed into one varlen `kda_prefill`
  from their state pages, the final states written back (as `KimiDeltaAttention.prefill_segments`;
  one fla varlen launch);
  plain = one `chunk_kda` over the [S, T] batch from a plain initial state; reference = the
  pure-torch chunked form through the pages. Eager CUDA-event timings.
The short conv is left out (the same work on both sides). Bytes: the state read + written
(2 H K V x 4 per sequence) plus q, k, v, g, beta and o; the copy bandwidth is measured in the same run.

    python benchmarks/kda.py [--decode-batches 1,8,64,256] [--prefill 1x512,1x2048,1x8192,4x2048] [--quick] [--out PATH]
    python benchmarks/kda.py --cpu-smoke --out PATH   # reference ops on tiny sizes on the CPU (plumbing check)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.cache.layout import CacheLayout  # noqa: E402
from kimiserve.cache.pool import PagePool  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.ops.kda import paged as paged_ref  # noqa: E402
from kimiserve.ops.kda.reference import chunk_kda, kda_gate, recurrent_kda  # noqa: E402
from kimiserve.ops.norm.reference import l2_normalize  # noqa: E402
from kimiserve.utils.cuda_timing import cuda_time, graph_time, wall_time  # noqa: E402
from kimiserve.utils.run_info import git_commit, results_path  # noqa: E402


def reference_ops() -> SimpleNamespace:
    """The pure-torch ops, paged and plain (the CPU smoke run)."""
    def decode_plain(q, k, v, g, beta, state):
        o, new = recurrent_kda(q, k, v, g, beta, initial_state=state)
        state.copy_(new)
        return o

    return SimpleNamespace(decode=paged_ref.kda_decode, decode_plain=decode_plain, prefill=paged_ref.kda_prefill,
                           prefill_plain=lambda q, k, v, g, beta, s: chunk_kda(q, k, v, g, beta, initial_state=s))


def fla_ops() -> SimpleNamespace:
    """The engine's fla wrappers (paged) and fla's kernels called directly on plain tensors."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from kimiserve.ops.kda import fla

    def decode_plain(q, k, v, g, beta, state):
        return fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, inplace_final_state=True,
                                       use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False)[0]

    def prefill_plain(q, k, v, g, beta, state):
        return fla_chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False)

    return SimpleNamespace(decode=fla.kda_decode, decode_plain=decode_plain, prefill=fla.kda_prefill,
                           prefill_plain=prefill_plain)


def copy_bandwidth_gbps(device: str, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy of nbytes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer = cuda_time if device == "cuda" else wall_time
    ms = timer(lambda: dst.copy_(src), repeats=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_pool(config, seqs: int, device: str, gen: torch.Generator) -> tuple[PagePool, torch.Tensor]:
    """A pool of 2 * seqs + 8 pages (the preset's fp8 layout) and `seqs` random distinct page ids
    whose states hold random values."""
    pool = PagePool(CacheLayout.from_config(config, "fp8", torch.bfloat16), 2 * seqs + 8, device)
    pool.recurrent.zero_()
    pages = torch.randperm(pool.num_pages, generator=gen, device=device)[:seqs]
    H, K, V = pool.recurrent.shape[1:]
    pool.recurrent[pages] = 0.1 * torch.randn(seqs, H, K, V, generator=gen, device=device)
    return pool, pages


def make_inputs(B: int, T: int, H: int, K: int, device: str, gen: torch.Generator):
    """q, k (L2-normalised), v bf16; the K3 gate (lower bound -5) with mostly mild decay; beta."""
    r = lambda *s: torch.randn(*s, generator=gen, device=device)
    q, k = (l2_normalize(r(B, T, H, K).bfloat16()) for _ in range(2))
    v = r(B, T, H, K).bfloat16()
    g = kda_gate(r(B, T, H, K) - 3.0, torch.zeros(H, device=device), torch.zeros(H * K, device=device), -5.0)
    return q, k, v, g, torch.sigmoid(r(B, T, H))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


@torch.inference_mode()  # as the engine runs
def measure_decode(ops, config, batch: int, device: str, gen, timers) -> dict:
    H, K = config.kda_num_heads, config.kda_head_dim
    pool, pages = make_pool(config, batch, device, gen)
    plain = pool.recurrent[pages].clone()
    ref_states = pool.recurrent.clone()
    q, k, v, g, beta = make_inputs(batch, 1, H, K, device, gen)
    paged_fn = lambda: ops.decode(q, k, v, g, beta, pool.recurrent, pages)
    plain_fn = lambda: ops.decode_plain(q, k, v, g, beta, plain)
    ref_fn = lambda: paged_ref.kda_decode(q, k, v, g, beta, ref_states, pages)
    o_paged, o_plain, o_ref = paged_fn(), plain_fn(), ref_fn()
    row = dict(phase="decode", batch=batch, seq_len=1, tokens=batch,
               paged_vs_plain_rel_rms=rel_rms(o_paged, o_plain), paged_vs_reference_rel_rms=rel_rms(o_paged, o_ref),
               paged_eager_ms=timers.eager(paged_fn), plain_eager_ms=timers.eager(plain_fn),
               reference_ms=timers.slow(ref_fn), bytes=2 * batch * H * K * K * 4 + nbytes(q, k, v, g, beta, o_paged))
    row["paged_ms"], row["plain_ms"], row["timing"] = timers.graph(paged_fn), timers.graph(plain_fn), timers.graph_name
    if row["paged_ms"] is None or row["plain_ms"] is None:  # capture failed: eager figures
        row.update(paged_ms=row["paged_eager_ms"], plain_ms=row["plain_eager_ms"], timing=timers.eager_name)
    return row


@torch.inference_mode()
def measure_prefill(ops, config, seqs: int, T: int, device: str, gen, timers) -> dict:
    H, K = config.kda_num_heads, config.kda_head_dim
    pool, pages = make_pool(config, seqs, device, gen)
    plain = pool.recurrent[pages].clone()
    q, k, v, g, beta = make_inputs(seqs, T, H, K, device, gen)

    packed = [t.reshape(1, seqs * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    cu_seqlens = torch.arange(seqs + 1, dtype=torch.int64) * T

    def through_pages(prefill):
        def run():  # as KimiDeltaAttention.prefill_segments: one varlen call from the pages, states written back
            o, states = prefill(*packed, pool.recurrent[pages], cu_seqlens)
            pool.recurrent[pages] = states
            return o.view(seqs, T, *o.shape[2:])
        return run

    paged_fn, ref_fn = through_pages(ops.prefill), through_pages(paged_ref.kda_prefill)
    plain_fn = lambda: ops.prefill_plain(q, k, v, g, beta, plain)
    o_plain = plain_fn()[0]
    saved = pool.recurrent[pages].clone()
    o_paged = paged_fn()
    pool.recurrent[pages] = saved
    o_ref = ref_fn()
    row = dict(phase="prefill", batch=seqs, seq_len=T, tokens=seqs * T,
               paged_vs_plain_rel_rms=rel_rms(o_paged, o_plain), paged_vs_reference_rel_rms=rel_rms(o_paged, o_ref),
               paged_ms=timers.eager(paged_fn), plain_ms=timers.eager(plain_fn), reference_ms=timers.slow(ref_fn),
               timing=timers.eager_name, bytes=2 * seqs * H * K * K * 4 + nbytes(q, k, v, g, beta, o_paged))
    return row


def finish_row(row: dict, copy_gbps: float) -> dict:
    for name in ("paged", "plain", "reference"):
        ms = row[f"{name}_ms"]
        row[f"{name}_tok_s"] = row["tokens"] / (ms * 1e-3)
        row[f"{name}_gbps"] = row["bytes"] / (ms * 1e-3) / 1e9
    row["paged_over_plain"] = row["paged_ms"] / row["plain_ms"]
    row["copy_gbps"] = copy_gbps
    return row


def graph_or_none(fn):
    try:
        return graph_time(fn)
    except Exception as e:  # a path that cannot be captured: report eager figures instead
        print(f"CUDA graph capture failed ({type(e).__name__}: {e}); eager timings", file=sys.stderr)
        return None


def parse_prefill(spec: str) -> list[tuple[int, int]]:
    """'1x512,4x2048' -> [(1, 512), (4, 2048)] (sequences x tokens)."""
    out = []
    for item in spec.split(","):
        s, _, t = item.partition("x")
        out.append((int(s), int(t)) if t else (1, int(s)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-batches", default="1,8,64,256")
    parser.add_argument("--prefill", default="1x512,1x2048,1x8192,4x2048", help="SEQSxTOKENS,... (prefill cases)")
    parser.add_argument("--quick", action="store_true", help="decode batches 1,8 and one 1x512 prefill")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the reference ops on the tiny preset on the CPU (a plumbing check, no useful figures)")
    parser.add_argument("--out", default=None,
                        help="the JSON (default benchmarks/results/kda.json; a CPU smoke run's under the temp dir)")
    args = parser.parse_args()
    args.out = args.out or results_path("kda.json", smoke=args.cpu_smoke)
    if args.cpu_smoke:
        torch.set_num_threads(1)
        device, config, ops = "cpu", load_preset("tiny"), reference_ops()
        batches, prefill = [1, 2], [(1, 64), (2, 32)]
        timers = SimpleNamespace(eager=wall_time, slow=wall_time, graph=lambda fn: None, graph_name=None,
                                 eager_name="wall")
        copy_gbps = copy_bandwidth_gbps(device, 2**24)
    else:
        if not torch.cuda.is_available():
            print("kda.py measures fla-core's CUDA kernels and needs a CUDA device (none found); "
                  "--cpu-smoke runs the plumbing on the CPU", file=sys.stderr)
            return 2
        try:
            ops = fla_ops()
        except Exception as e:  # ImportError, or fla failing to set itself up
            print(f"kda.py needs fla-core (pip install fla-core): {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        device, config = "cuda", load_preset("kimi-k3.1-pro")
        batches = [1, 8] if args.quick else [int(b) for b in args.decode_batches.split(",")]
        prefill = [(1, 512)] if args.quick else parse_prefill(args.prefill)
        timers = SimpleNamespace(eager=lambda fn: cuda_time(fn, repeats=10, warmup=2),
                                 slow=lambda fn: cuda_time(fn, repeats=3, warmup=1),
                                 graph=graph_or_none, graph_name="graph", eager_name="eager")
        copy_gbps = copy_bandwidth_gbps(device, 2**32)
    gen = torch.Generator(device=device).manual_seed(0)
    commit = git_commit()
    result = dict(benchmark="kda", device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  commit=commit, command=" ".join(sys.argv), model="tiny" if args.cpu_smoke else "kimi-k3.1-pro",
                  heads=config.kda_num_heads, head_dim=config.kda_head_dim, quick=args.quick,
                  cpu_smoke=args.cpu_smoke, copy_gbps=copy_gbps, rows=[], skipped=[])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    cases = [(measure_decode, (b,)) for b in batches] + [(measure_prefill, p) for p in prefill]
    for measure, case in cases:
        try:
            row = finish_row(measure(ops, config, *case, device, gen, timers), copy_gbps)
        except torch.cuda.OutOfMemoryError:
            result["skipped"].append(dict(phase=measure.__name__[len("measure_"):], case=case, reason="out of memory"))
            print(f"skip {result['skipped'][-1]}", flush=True)
            torch.cuda.empty_cache()
            continue
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{result['device']}: copy bandwidth {copy_gbps:.0f} GB/s (read + write); KDA {config.kda_num_heads} heads"
          f" x {config.kda_head_dim}; " + ("decode: CUDA graph replay, prefill: eager" if device == "cuda" else "host clock"))
    print("phase    seqs x len   paged ms   plain ms  paged/plain  paged tok/s  plain tok/s  paged GB/s  plain GB/s"
          "  % copy  reference ms")
    for r in result["rows"]:
        print(f"{r['phase']:<8} {r['batch']:>4} x {r['seq_len']:<5} {r['paged_ms']:9.4f} {r['plain_ms']:10.4f} "
              f"{r['paged_over_plain']:12.3f} {r['paged_tok_s']:12.0f} {r['plain_tok_s']:12.0f} "
              f"{r['paged_gbps']:11.1f} {r['plain_gbps']:11.1f} {100 * r['paged_gbps'] / copy_gbps:7.1f} "
              f"{r['reference_ms']:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
