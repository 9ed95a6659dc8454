"""The decode step's glue kernels against the reference compositions they replace, microseconds per call
replayed from a CUDA graph (20 calls per graph, so launch gaps inside a graph count, as in the engine's
decode graphs), at the `small` preset's widths (hidden 7168, q-LoRA 1536, latent MoE 3584, shared
experts 6144, 16 experts top-4; the K3.1 router: 896 experts top-16; 9 attention-residual candidates
as K3.1's last layers have; MLA's kv_b per-head matmuls at 96 heads x 128 <-> latent 512). Writes benchmarks/results/glue_ops.json.

    python benchmarks/glue_ops.py [--batches 1,64] [--out benchmarks/results/glue_ops.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("glue_ops.py needs a CUDA GPU (and Triton)")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.ops.activation import reference as act_ref, triton as act_tt  # noqa: E402
from kimiserve.ops.attn_res import reference as arn_ref, triton as arn_tt  # noqa: E402
from kimiserve.ops.mla import head_matmul_triton, reference as mla_ref  # noqa: E402
from kimiserve.ops.moe import reference as moe_ref, route_triton  # noqa: E402
from kimiserve.ops.norm import reference as norm_ref, triton as norm_tt  # noqa: E402
from kimiserve.utils.cuda_timing import graph_time  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

CALLS = 20


def cases(batch: int):
    dev, bf = "cuda", torch.bfloat16
    rnd = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
    d = 7168
    for width in (7168, 3584, 1536):
        x, w = rnd(batch, width).to(bf), (1 + 0.1 * rnd(width)).to(bf)
        yield f"rms_norm d={width}", (lambda f, x=x, w=w: f(x, w, 1e-5)), norm_ref.rms_norm, norm_tt.rms_norm, 2 * x.nbytes
    keys, kw, kb = rnd(batch, 128).to(bf), (1 + 0.1 * rnd(128)).to(bf), (0.1 * rnd(128)).to(bf)
    yield ("layer_norm d=128 (index keys)", (lambda f: f(keys, kw, kb, 1e-6)), norm_ref.layer_norm, norm_tt.layer_norm,
           2 * keys.nbytes)
    store = rnd(8, batch, d).to(bf)
    running, addend = rnd(batch, d).to(bf), rnd(batch, d).to(bf)
    rn, rp, nw = (1 + 0.1 * rnd(d)).to(bf), (0.01 * rnd(1, d)).to(bf), (1 + 0.1 * rnd(d)).to(bf)
    for n_blocks, add in ((0, True), (1, False), (4, True), (8, True)):
        blocks = [store[i] for i in range(n_blocks)]
        a = addend if add else None
        moved = (n_blocks + 2 + (2 if add else 0)) * running.nbytes
        yield (f"add_read_norm blocks={n_blocks} add={add}",
               (lambda f, blocks=blocks, a=a: f(running, a, blocks, rn, rp, nw, 1e-5)),
               arn_ref.add_read_norm, arn_tt.add_read_norm, moved)
    for E, k in ((16, 4), (896, 16)):
        logits, bias = rnd(batch, E), 0.05 * rnd(E)
        yield (f"route E={E} k={k}", (lambda f, logits=logits, bias=bias, k=k: f(logits, bias, k)),
               moe_ref.route, route_triton.route, logits.nbytes)
    kv_b = (0.04 * rnd(96 * 256, 512)).to(bf)
    w_kc, w_vc = mla_ref.split_kv_b(kv_b, 96, 128)
    q, o = rnd(batch, 96, 128).to(bf), rnd(batch, 96, 512)
    yield ("head_matmul absorb (96 x 128 -> 512)", (lambda f: f(q, w_kc)), mla_ref.head_matmul,
           head_matmul_triton.head_matmul, w_kc.numel() * 2 + q.nbytes + o.nbytes)
    yield ("head_matmul output (96 x 512 -> 128)", (lambda f: f(o, w_vc.transpose(1, 2))), mla_ref.head_matmul,
           head_matmul_triton.head_matmul, w_vc.numel() * 2 + o.nbytes + q.nbytes * 2)
    for width in (6144, 33792):
        g, u = rnd(batch, width).to(bf), rnd(batch, width).to(bf)
        yield (f"situ_and_mul I={width}", (lambda f, g=g, u=u: f(g, u, 4.0, 25.0)), act_ref.situ_and_mul,
               act_tt.situ_and_mul, 3 * g.nbytes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--out", default="benchmarks/results/glue_ops.json")
    args = parser.parse_args()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, call, ref, kernel, nbytes in cases(batch):
            ref_us = graph_time(lambda: call(ref), calls=CALLS) * 1e3
            kernel_us = graph_time(lambda: call(kernel), calls=CALLS) * 1e3
            rows.append(dict(op=name, batch=batch, reference_us=ref_us, kernel_us=kernel_us, bytes=nbytes,
                             kernel_gbps=nbytes / kernel_us / 1e3))
            print(f"batch {batch:3d} {name:34s} reference {ref_us:8.2f} us   kernel {kernel_us:7.2f} us   "
                  f"x{ref_us / kernel_us:5.1f}   {nbytes / kernel_us / 1e3:7.1f} GB/s", flush=True)
    out = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=git_commit(),
               torch=torch.__version__, calls_per_graph=CALLS, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
