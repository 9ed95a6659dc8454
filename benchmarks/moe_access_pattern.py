"""The decode MoE GEMMs' weight reads alone (loads, no math) on the GPU: how fast can a grid of (expert, column tile)
programs stream the K3.1 gate/up weights when each K step reads BN weight rows of B bytes each?

Session 14 (BENCHMARKS.md, "Session 14 on the H200") found with it that rows of 64 bytes a step (128-wide K steps of
MXFP4 codes, the layout every decode GEMM read until then) cap a load-only kernel at 56-61% of the copy bandwidth
whatever the tile, warps or pipeline depth, while 128-byte rows (256-wide steps) or a tiled layout (each step's rows
contiguous) reach 88-110%: the decode GEMMs' plateau near 56% was the access pattern, not the instruction count.

    python3 benchmarks/moe_access_pattern.py [--hits 16,231,624] [--out benchmarks/results/moe_access_pattern.json]

Strided: word (n, k) of expert e at e * N * KW + n * KW + k (the checkpoint's row-major codes). Tiled: the same
words with each (column tile, K step) block of BN x BKW words contiguous. Both read gate and up (two tensors) as the
gate/up GEMM does; a program XORs what it loads so that nothing is optimised away. Timed as CUDA-graph replays;
bytes = 2 x experts hit x N x KW x 4; the copy bandwidth (read + write of 256 MiB) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILINGS = ((128, 16, 4, 3), (128, 16, 4, 4), (128, 32, 4, 3), (64, 16, 4, 4), (128, 16, 8, 4), (256, 16, 8, 3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hits", default="16,231,624", help="experts read (K3.1 random routing: 1, 16, 64 tokens)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "moe_access_pattern.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_access_pattern.py times GPU loads: it needs CUDA")
    import triton
    import triton.language as tl

    sys.path.insert(0, REPO)
    from kimiserve.utils.cuda_timing import capture_graph

    @triton.jit
    def pattern_kernel(w_ptr, v_ptr, e_ptr, out_ptr, KW, n_tiles, s_e, TILED: tl.constexpr, BN: tl.constexpr,
                       BKW: tl.constexpr):
        pid = tl.program_id(0)
        e = tl.load(e_ptr + pid // n_tiles).to(tl.int64)
        nt = pid % n_tiles
        steps = KW // BKW
        acc = tl.zeros((BN, BKW), tl.int32)
        rows = tl.arange(0, BN)
        cols = tl.arange(0, BKW)
        for s in range(steps):
            if TILED:
                offs = e * s_e + (nt * steps + s) * (BN * BKW) + rows[:, None] * BKW + cols[None, :]
            else:
                offs = e * s_e + (nt * BN + rows)[:, None] * KW + s * BKW + cols[None, :]
            acc ^= tl.load(w_ptr + offs)
            acc ^= tl.load(v_ptr + offs)
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))

    E, N, KW = 896, 3072, 448  # K3.1's gate (and up): 3072 rows x 3584 codes = 448 int32 words a row
    w = torch.randint(-2**31, 2**31 - 1, (E, N, KW), dtype=torch.int32, device="cuda")
    v = torch.randint(-2**31, 2**31 - 1, (E, N, KW), dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    a = torch.empty(2**28, dtype=torch.int8, device="cuda")
    b = torch.empty_like(a)
    copy = 2 * a.numel() / (timed(lambda: b.copy_(a), 20) * 1e-3) / 1e9
    del a, b
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (read + write)")
    rows = []
    for hit in (int(x) for x in args.hits.split(",")):
        experts = torch.randperm(E, device="cuda")[:hit].sort().values.int()
        for tiled in (False, True):
            for bn, bkw, warps, stages in TILINGS:
                n_tiles = N // bn
                out = torch.empty(hit * n_tiles, dtype=torch.int32, device="cuda")

                def run():
                    pattern_kernel[(hit * n_tiles,)](w, v, experts, out, KW, n_tiles, N * KW, TILED=tiled, BN=bn,
                                                     BKW=bkw, num_warps=warps, num_stages=stages)

                run()
                graph = capture_graph(run)
                ms = timed(graph.replay, 10)
                gbps = 2 * hit * N * KW * 4 / (ms * 1e-3) / 1e9
                rows.append(dict(experts_hit=hit, layout="tiled" if tiled else "strided", rows_per_step=bn,
                                 bytes_per_row_step=4 * bkw, num_warps=warps, num_stages=stages, ms=ms, gbps=gbps,
                                 fraction_of_copy=gbps / copy))
                print(f"hit {hit:4d} {'tiled  ' if tiled else 'strided'} {bn:3d} rows x {4 * bkw:3d} B a step, "
                      f"w{warps} s{stages}: {ms:.3f} ms {gbps:6.0f} GB/s ({100 * gbps / copy:.1f}% of copy)")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=copy, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
