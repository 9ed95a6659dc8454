"""Is the fused MoE kernel's row independent of the batch? The first N of 4096 tokens through
`ops.moe.triton.fused_moe` against all 4096, counting output elements that differ bit for bit, with the config
picked from the token count (`default_config`) and with one config (the decode one, the prefill one) for every N;
and each variant's time at 1, 64 and 4096 tokens. bf16 activations, MXFP4 experts in the shift layout, random
routing. CUDA only: `python3 benchmarks/moe_invariance_probe.py [--out PATH]`."""
import argparse
import json
import time

import torch
from kimiserve.ops.moe import triton as tt
from kimiserve.ops.moe.mxfp4_layout import to_shift_layout
from kimiserve.ops.quant.reference import quantize_mxfp4
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--out", default="benchmarks/results/moe_invariance_probe.json")
args = ap.parse_args()
torch.manual_seed(0)
dev = "cuda"
E, h, I, k = 128, 2048, 1024, 8
def q(o, i):
    w = torch.randn(E, o, i, device=dev) * 0.05
    p, s = quantize_mxfp4(w)
    return to_shift_layout(p, s), s
w1, s1 = q(I, h); w3, s3 = q(I, h); w2, s2 = q(h, I)
NMAX = 4096
x = torch.randn(NMAX, h, device=dev, dtype=torch.bfloat16)
ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(NMAX)]).int()
wts = torch.rand(NMAX, k, device=dev)
def run(n, config=None):
    return tt.fused_moe(x[:n], w1, w2, w3, ids[:n], wts[:n], w1_scale=s1, w2_scale=s2, w3_scale=s3,
                        config=config, mxfp4_layout="shift")
ref = run(NMAX)
res = {}
fixed = {"decode": tt.default_config(1, k, E, torch.bfloat16, True, "shift"),
         "prefill": tt.default_config(NMAX, k, E, torch.bfloat16, True, "shift")}
for name, cfg in [("default", None)] + list(fixed.items()):
    big = run(NMAX, cfg)
    for n in (1, 3, 16, 64, 257, 1024):
        o = run(n, cfg)
        res[f"{name} N={n} vs same-config N=4096"] = int((o != big[:n]).sum())
        res[f"{name} N={n} vs default N=4096"] = int((o != ref[:n]).sum())
    torch.cuda.synchronize()
    for n in (1, 64, 4096):
        for _ in range(3): run(n, cfg)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): run(n, cfg)
        torch.cuda.synchronize(); res[f"{name} time N={n} ms"] = round((time.perf_counter() - t) / 20 * 1e3, 4)
res["decode_config"] = str(fixed["decode"]); res["prefill_config"] = str(fixed["prefill"])
json.dump(res, open(args.out, "w"), indent=1)
for key, v in res.items(): print(f"{key}: {v}")
