"""A target for Nsight Compute: fused MoE calls at the K3.1 per-expert shape (3584 -> 3072, top-16, MXFP4 in the shift
layout, the default config), on fewer experts than K3.1's 896 so that the weights are drawn in seconds. Each call
launches the alignment, the gate/up GEMM, the down GEMM and the combine; `--calls` of them run, so ncu can skip the
first (compiling) ones. Session 13 (BENCHMARKS.md, "Where the MoE GEMM stalls"):

    ncu --clock-control none -k regex:_moe_gemm_kernel --launch-skip 4 --launch-count 2 --section SpeedOfLight \\
        --section SchedulerStats --section WarpStateStats --print-details all \\
        python3 benchmarks/moe_ncu_target.py --tokens 16

(ncu's default locks the SM clock to its base, 1.34 GHz on the H200: `--clock-control none` keeps the card's own.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_layer import packed_experts, parse_variant, route, shift_layout  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--routing", default="random", choices=("random", "zipf"))
    parser.add_argument("--variant", default="", help="a benchmarks/moe_layer.py variant spec (shift dequant) "
                        "instead of the default config, e.g. shift-m16-n128-k128-w4-s3-frag")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_ncu_target.py profiles the CUDA kernels: it needs a GPU")
    from kimiserve.ops.moe import triton as tt

    E, k, h, inter, N = args.experts, 16, 3584, 3072, args.tokens
    w = shift_layout(packed_experts(E, h, inter, "cuda"), True)
    x = torch.randn(N, h, device="cuda").bfloat16()
    ids, weights = route(N, E, k, args.routing, "cuda", 0)
    config = parse_variant(args.variant) if args.variant else tt.device_default_config(
        N, k, E, torch.bfloat16, True, "shift", (h, inter), "cuda")
    if config.dequant != "shift":
        raise SystemExit(f"--variant {args.variant!r}: the weights here are in the shift layout (dequant 'shift')")
    for _ in range(args.calls):
        out = tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                           w3_scale=w["w3_scale"], config=config, mxfp4_layout="shift")
    torch.cuda.synchronize()
    print(f"{args.calls} calls, {N} tokens, {E} experts; config {config}; "
          f"mean |out| {out.float().abs().mean().item():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
