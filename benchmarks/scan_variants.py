"""How close can the decode index scan get to memory bandwidth? Variants of the scan on the engine's
FP8 pages at real sizes (32 index heads x 128, the `small` preset's 4608-token pages), under CUDA
graphs, against two ceilings measured in the same run: a 4 GiB device copy and a read-only kernel
that loads exactly the scan's bytes (keys + scales, same tiles and grid) and does nothing else.

Variants (each checked against the library kernel's scores):
  library  kimiserve.ops.indexer.triton.paged_indexer_scores (keys dequantised to bf16 per element, as
           the reference does);
  rowscale keys converted e4m3 -> bf16 (exact) and the fp32 key scale applied once per token after
           the head sum (ReLU commutes with a positive scale): no per-element multiply or rounding;
  fp16     as rowscale with an fp16 dot (e4m3 -> fp16 is one conversion; bf16 q is exact in fp16).
  fp8dot   the query quantised to e4m3 per head (scale amax / 448, folded into the head weights, as
           DeepSeek-V3.2's indexer does) and an e4m3 x e4m3 tensor-core dot: the keys need no
           conversion at all (sm_90 SASS: 360 instructions per 128-token tile against the library's
           592, `benchmarks/sass_report.py`). It changes the scores (the query loses mantissa bits),
           so its rows also carry the top-2048 overlap with the library's selection; the time
           includes the query's quantisation.

    python benchmarks/scan_variants.py [--contexts 1048576] [--batches 1,64] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("scan_variants.py needs a CUDA GPU (and Triton)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_attention import build_case, copy_bandwidth_gbps  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.utils.cuda_timing import graph_time  # noqa: E402


@triton.jit
def _read_only_kernel(k_ptr, ks_ptr, bt_ptr, cl_ptr, out_ptr, k_sp, k_st, ks_sp, bt_sb, out_sb,
                      D: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr, TILES: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(cl_ptr + b).to(tl.int32)
    rows = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        s0 = (chunk * TILES + t) * BLOCK_S
        page = tl.load(bt_ptr + b * bt_sb + s0 // PAGE, mask=s0 < ctx, other=0).to(tl.int64)
        slot = s0 % PAGE + rows
        valid = s0 + rows < ctx
        k = tl.load(k_ptr + page * k_sp + slot[:, None] * k_st + d[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32), axis=1) * tl.load(ks_ptr + page * ks_sp + slot, mask=valid, other=0.0)
    tl.store(out_ptr + b * out_sb + chunk * BLOCK_S + rows, acc)


@triton.jit
def _rowscale_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, cl_ptr, out_ptr,
                     q_sb, q_sh, w_sb, k_sp, k_st, ks_sp, bt_sb, out_sb, H, max_context,
                     D: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                     TILES: tl.constexpr, DT: tl.constexpr, NUM_STAGES: tl.constexpr):
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(cl_ptr + b).to(tl.int32)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    if DT == tl.float8e4nv:  # q quantised beforehand (fp8dot): e4m3 [H, D], the dot's K-major operand
        qt = tl.trans(tl.load(q_ptr + b * q_sb + h[:, None] * q_sh + d[None, :], mask=h[:, None] < H, other=0.0))
    else:
        qt = tl.load(q_ptr + b * q_sb + d[:, None] + h[None, :] * q_sh, mask=h[None, :] < H, other=0.0).to(DT)
    w = tl.load(w_ptr + b * w_sb + h, mask=h < H, other=0.0).to(tl.float32)
    rows = tl.arange(0, BLOCK_S)
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        s0 = (chunk * TILES + t) * BLOCK_S
        page = tl.load(bt_ptr + b * bt_sb + s0 // PAGE, mask=s0 < ctx, other=0).to(tl.int64)
        slot = s0 % PAGE + rows
        valid = s0 + rows < ctx
        k = tl.load(k_ptr + page * k_sp + slot[:, None] * k_st + d[None, :], mask=valid[:, None], other=0.0)
        acc = tl.dot(k.to(DT), qt)
        scale = tl.load(ks_ptr + page * ks_sp + slot, mask=valid, other=0.0)
        score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * scale
        pos = s0 + rows
        tl.store(out_ptr + b * out_sb + pos, tl.where(valid, score, float("-inf")), mask=pos < max_context)


def run_fp8dot(c, context, block_s, tiles, warps, stages, out):
    from kimiserve.ops.quant.reference import quantize_fp8_rowwise

    q8, q_scale = quantize_fp8_rowwise(c["iq"])  # [B, H, D] e4m3, [B, H]
    return run_rowscale(dict(c, iq=q8, iw=c["iw"].float() * q_scale), context, tl.float8e4nv, block_s, tiles,
                        warps, stages, out)


def topk_overlap(scores: torch.Tensor, ref: torch.Tensor, k: int = 2048) -> float:
    """Mean over rows of |top-k(scores) & top-k(ref)| / k."""
    a, b = scores.topk(k, dim=1).indices, ref.topk(k, dim=1).indices
    hits = [len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)]
    return sum(hits) / (k * len(hits))


def run_rowscale(c, context, dot_dtype, block_s, tiles, warps, stages, out):
    pool, q, w = c["pool"], c["iq"], c["iw"]
    keys, scales, tables, lens = pool.index_key[0], pool.index_scale[0], c["tables"], c["lens"]
    B, H, D = q.shape
    grid = (triton.cdiv(context, block_s * tiles), B)
    _rowscale_kernel[grid](q, w, keys, scales, tables, lens, out, q.stride(0), q.stride(1), w.stride(0),
                           keys.stride(0), keys.stride(1), scales.stride(0), tables.stride(0), out.stride(0),
                           H, context, D=D, PAGE=keys.shape[1], BLOCK_H=max(16, triton.next_power_of_2(H)),
                           BLOCK_S=block_s, TILES=tiles, DT=dot_dtype, NUM_STAGES=stages, num_warps=warps)
    return out


def run_read_only(c, context, block_s, tiles, warps, stages, out):
    pool, tables, lens = c["pool"], c["tables"], c["lens"]
    keys, scales = pool.index_key[0], pool.index_scale[0]
    B = tables.shape[0]
    grid = (triton.cdiv(context, block_s * tiles), B)
    _read_only_kernel[grid](keys, scales, tables, lens, out, keys.stride(0), keys.stride(1), scales.stride(0),
                            tables.stride(0), out.stride(0), D=keys.shape[2], PAGE=keys.shape[1], BLOCK_S=block_s,
                            TILES=tiles, NUM_STAGES=stages, num_warps=warps)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1048576")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--out", default="benchmarks/results/scan_variants.json")
    args = parser.parse_args()
    from kimiserve.ops.indexer.triton import paged_indexer_scores

    config = load_preset("small")
    copy = copy_bandwidth_gbps()
    rows = []
    # (tokens per tile, tiles per program, warps, stages): around the sweep's best for batch 1 and 64
    knobs = [(128, 1, 4, 2), (128, 2, 4, 2), (128, 2, 8, 3), (256, 1, 8, 2), (256, 2, 8, 3), (64, 4, 4, 2),
             (128, 4, 4, 3), (128, 16, 4, 3), (64, 16, 4, 4)]
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            c = build_case(config, batch, context)
            nbytes = batch * context * 132
            ref = paged_indexer_scores(c["iq"], c["iw"], c["pool"].index_key[0], c["pool"].index_scale[0],
                                       c["tables"], c["lens"], torch.bfloat16, max_context=context)
            lib_ms = graph_time(lambda: paged_indexer_scores(c["iq"], c["iw"], c["pool"].index_key[0],
                                                             c["pool"].index_scale[0], c["tables"], c["lens"],
                                                             torch.bfloat16, max_context=context, out=ref))
            best = {"library": (lib_ms, None, 0.0)}
            out = torch.empty_like(ref)
            overlap = {}
            for variant, dt in (("rowscale", tl.bfloat16), ("fp16", tl.float16), ("fp8dot", None),
                                ("read-only", None)):
                for bs, t, wp, st in knobs:
                    try:
                        if variant == "read-only":
                            fn = lambda: run_read_only(c, context, bs, t, wp, st, out)  # noqa: E731
                            err = 0.0
                        elif variant == "fp8dot":
                            fn = lambda: run_fp8dot(c, context, bs, t, wp, st, out)  # noqa: E731
                            fn()
                            finite = torch.isfinite(ref)
                            err = float((out[finite] - ref[finite]).norm() / ref[finite].norm())
                            if variant not in overlap:
                                overlap[variant] = topk_overlap(out, ref)
                        else:
                            fn = lambda: run_rowscale(c, context, dt, bs, t, wp, st, out)  # noqa: E731
                            fn()
                            finite = torch.isfinite(ref)
                            err = float((out[finite] - ref[finite]).norm() / ref[finite].norm())
                        ms = graph_time(fn)
                    except Exception as e:  # out of resources: record and go on
                        rows.append(dict(batch=batch, context=context, variant=variant, knobs=[bs, t, wp, st],
                                         error=str(e)[:200]))
                        continue
                    rows.append(dict(batch=batch, context=context, variant=variant, knobs=[bs, t, wp, st], ms=ms,
                                     gbps=nbytes / ms / 1e6, rel_rms_vs_library=err))
                    if variant not in best or ms < best[variant][0]:
                        best[variant] = (ms, [bs, t, wp, st], err)
            for variant, (ms, kn, err) in best.items():
                line = dict(batch=batch, context=context, variant=variant, best_knobs=kn, ms=ms,
                            read_gbps=nbytes / ms / 1e6, rel_rms_vs_library=err, copy_gbps=copy,
                            top2048_overlap_vs_library=overlap.get(variant))
                rows.append(dict(line, summary=True))
                extra = f"  top-2048 overlap {overlap[variant]:.4f}" if variant in overlap else ""
                print(f"B={batch:3d} ctx={context:8d} {variant:9s} {ms * 1e3:7.1f} us  {nbytes / ms / 1e6:6.0f} GB/s read "
                      f"({100 * nbytes / ms / 1e6 / copy:3.0f}% of copy {copy:.0f})  err {err:.1e}  knobs {kn}{extra}")
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
