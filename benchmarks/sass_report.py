"""What the decode (and prefill) kernels compile to on Hopper, without a GPU: compiles the library's index
scan and sparse MLA kernels (and the prefill scan, sparse tiling, KDA short conv and gated norm, and KDA's decode /
verify steps kernel) for sm_90 (Triton's bundled ptxas and cuobjdump) with the launch constants of
Kimi-K3.1-Pro's pages (32 index heads x 128; 96 MLA heads, 512 + 64 latent; batch-1 tilings) and
prints the SASS instruction mix.

A static proxy for where the time goes, for sessions without device time. Scan counts are per
thread per 128-token tile (one program at batch 1, no loop), so e.g. 128 `STS.U16` means every
decoded key value is stored to shared memory on its own; the MLA kernels loop over their tiles, so
theirs are static counts of the code (the loop body once). It measures nothing: timings come from
decode_attention.py on the GPU.

    python benchmarks/sass_report.py [--kernels scan_fp8,scan_fp4,mla_fp8,mla_fp4] [--top 25] [--out PATH]

Integer arguments are specialised as a launch specialises them: strides of 1 become constants,
the rest are marked divisible by 16 where the engine's pages make them so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

try:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("sass_report.py needs Triton (pip install triton); no GPU is needed")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.ops.indexer import triton as indexer  # noqa: E402
from kimiserve.ops.mla import triton as mla  # noqa: E402

SCAN_INTS = ["q_sb", "q_sh", "w_sb", "k_sp", "k_st", "ks_sp", "bt_sb", "out_sb", "H", "max_context"]
MLA_INTS = ["H", "n_sel", "split_len", "s_qlb", "s_qlh", "s_qpb", "s_qph", "s_cp", "s_cr", "s_tb", "s_sb", "s_pb",
            "s_ps", "s_ph", "s_lb", "s_ls"]
MLA_DIV16 = [n for n in MLA_INTS if n not in ("split_len", "s_cr")]  # fp4 rows: 81 words of 4 bytes


def scan_fp8():
    types = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*fp8e4nv", ks_ptr="*fp32", bt_ptr="*i32", cl_ptr="*i32",
                 out_ptr="*fp32", **{n: "i32" for n in SCAN_INTS})
    consts = dict(q_sd=1, k_sd=1, w_sh=1, ks_st=1, bt_sm=1, D=128, PAGE=384, BLOCK_H=32, BLOCK_S=128, TILES=1,
                  HAS_SCALE=True, DT=tl.float16, SPLIT_Q=False, EMULATE=False, PRECISION="tf32", NUM_STAGES=2)
    return indexer._indexer_scores_kernel, types, consts, dict(num_warps=4, num_stages=2), SCAN_INTS


def scan_fp4():
    types = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*u8", ks_ptr="*i32", bt_ptr="*i32", cl_ptr="*i32",
                 out_ptr="*fp32", ks_st="i32", **{n: "i32" for n in SCAN_INTS})
    consts = dict(q_sd=1, w_sh=1, ks_sg=1, bt_sm=1, D=128, GROUPS=4, SCALE_WORDS=True, PAGE=704, BLOCK_H=32,
                  BLOCK_S=128, TILES=1, DT=tl.float16, SPLIT_Q=False, EMULATE=False, PRECISION="tf32",
                  NUM_STAGES=2, ASM=True)
    return indexer._indexer_scores_mxfp4_kernel, types, consts, dict(num_warps=4, num_stages=2), SCAN_INTS


def mla_fp8():
    cfg = mla.default_config(torch.bfloat16)
    types = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", cache_ptr="*fp8e4nv", tables_ptr="*i32", sel_ptr="*i32",
                 part_ptr="*fp32", lse_ptr="*fp32", latent_scale="fp32", qk_scale="fp32", out_scale="fp32",
                 **{n: "i32" for n in MLA_INTS})
    consts = dict(L=512, R=64, BLOCK_L=512, BLOCK_R=64, PAGE=384, SPARSE=True, SCALE_EACH=False, DTYPE=tl.bfloat16,
                  PRECISION="tf32", BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, RELOAD=cfg.reload)
    return mla._split_kernel, types, consts, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), MLA_DIV16 + ["s_cr"]


def mla_fp4():
    cfg = mla.default_fp4_config(torch.bfloat16, 1)
    types = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", cache_ptr="*u8", tables_ptr="*i32", sel_ptr="*i32",
                 part_ptr="*fp32", lse_ptr="*fp32", global_scale="fp32", qk_scale="fp32",
                 **{n: "i32" for n in MLA_INTS})
    consts = dict(L=512, R=64, GROUPS=36, BLOCK_GL=32, BLOCK_GR=4, ROW_ALIGN=4, PAGE=704, SPARSE=True,
                  DTYPE=tl.bfloat16, PRECISION="tf32", BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n)
    return mla._split_fp4_kernel, types, consts, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), MLA_DIV16


PREFILL_SCAN_INTS = ["q_sb", "q_sh", "w_sb", "k_sp", "k_st", "ks_sp", "out_sb", "B", "H", "max_context"]


def scan_prefill_fp8():
    """The query-tiled prefill scan (`ops/indexer/triton_prefill.py`), 4 rows per program, 8 tiles."""
    from kimiserve.ops.indexer import triton_prefill

    types = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*fp8e4nv", ks_ptr="*fp32", bt_ptr="*i64", cl_ptr="*i64",
                 out_ptr="*fp32", **{n: "i32" for n in PREFILL_SCAN_INTS})
    consts = dict(q_sd=1, k_sd=1, w_sh=1, ks_st=1, bt_sm=1, D=128, PAGE=384, BLOCK_H=32, BLOCK_S=128, BLOCK_Q=4,
                  TILES=8, HAS_SCALE=True, DT=tl.float16, SPLIT_Q=False, EMULATE=False, PRECISION="tf32")
    return (triton_prefill._prefill_scores_kernel, types, consts, dict(num_warps=4, num_stages=2),
            [n for n in PREFILL_SCAN_INTS if n not in ("B", "H", "max_context")])


def mla_prefill_fp8():
    """The sparse kernel at a prefill tiling (64-head blocks, 8 warps, no reload), output rounded to bf16 in it."""
    types = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", cache_ptr="*fp8e4nv", tables_ptr="*i64", sel_ptr="*i64",
                 part_ptr="*bf16", lse_ptr="*fp32", latent_scale="fp32", qk_scale="fp32", out_scale="fp32",
                 **{n: "i32" for n in MLA_INTS})
    consts = dict(L=512, R=64, BLOCK_L=512, BLOCK_R=64, PAGE=384, SPARSE=True, SCALE_EACH=False, DTYPE=tl.bfloat16,
                  PRECISION="tf32", BLOCK_H=64, BLOCK_N=64, RELOAD=False)
    return mla._split_kernel, types, consts, dict(num_warps=8, num_stages=1), [n for n in MLA_DIV16 if n != "s_tb"]


def short_conv():
    """KDA's prefill short conv (`ops/conv/triton.py`) with the q / k L2 norm, 128-channel heads, width 4."""
    from kimiserve.ops.conv import triton as conv

    ints = ["T", "s_xt", "s_sc", "s_wc", "s_ot"]
    types = dict(x_ptr="*bf16", state_ptr="*bf16", w_ptr="*fp32", out_ptr="*bf16", eps="fp32", **{n: "i32" for n in ints})
    consts = dict(s_sj=1, s_wj=1, W=4, HD=128, BLOCK_D=128, BLOCK_T=32, NORM=True, DTYPE=tl.bfloat16)
    return conv._short_conv_kernel, types, consts, dict(num_warps=4, num_stages=3), ["s_xt", "s_ot", "s_wc"]


def gated_rms_norm():
    """KDA's gated output norm (`ops/norm/triton.py`), 16 rows of 128 per program."""
    from kimiserve.ops.norm import triton as norm

    ints = ["N", "D", "s_x", "s_g", "s_o"]
    types = dict(x_ptr="*bf16", g_ptr="*bf16", w_ptr="*fp32", out_ptr="*bf16", eps="fp32", **{n: "i32" for n in ints})
    consts = dict(DTYPE=tl.bfloat16, BLOCK_R=16, BLOCK=128)
    return norm._gated_rms_norm_kernel, types, consts, dict(num_warps=4, num_stages=3), ["s_x", "s_g", "s_o"]


def kda_steps():
    """KDA's decode / verify kernel (`ops/kda/triton_decode.py`, `_kda_steps_kernel`) at K3.1's 96 heads of 128,
    bf16 rows: the arguments a decode and a verify launch share specialised as the engine's pages make them (16-float
    aligned), the per-call ones (`_PER_CALL_ARGS`) not."""
    from kimiserve.ops.kda import triton_decode

    fn = triton_decode._kda_steps_kernel
    per_call = set(triton_decode._PER_CALL_ARGS)
    rows = {"q_ptr", "k_ptr", "v_ptr", "f_ptr", "b_ptr", "gate_ptr", "out_ptr", "conv_ptr", "conv_dst_ptr"}
    ids = {"pages_ptr", "grid_ptr", "lengths_ptr"}
    types = {n: ("*bf16" if n in rows else "*i64" if n in ids else "*fp32") if n.endswith("_ptr")
             else "fp32" if n in ("lower_bound", "scale", "norm_eps") else "i32" for n in fn.arg_names}
    consts = dict(H=96, K=128, V=128, W=4, BK=128, BV=128, BW=4, HAS_LOWER_BOUND=True)
    for name in consts:
        types.pop(name)
    div16 = [n for n in fn.arg_names if n.endswith("stride") and n not in per_call]
    return fn, types, consts, dict(num_warps=triton_decode.STEPS_NUM_WARPS), div16


KERNELS = dict(scan_fp8=scan_fp8, scan_fp4=scan_fp4, mla_fp8=mla_fp8, mla_fp4=mla_fp4, scan_prefill_fp8=scan_prefill_fp8,
               mla_prefill_fp8=mla_prefill_fp8, short_conv=short_conv, gated_rms_norm=gated_rms_norm, kda_steps=kda_steps)


def compile_sm90(fn, types: dict, consts: dict, options: dict, div16: list[str]):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        else:
            signature[name] = types[name]
            if types[name].startswith("*") or name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(kernel) -> dict[str, int]:
    """cuobjdump's per-thread registers and stack bytes (spills land on the stack) of the kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK):(\d+)", text)}


def instruction_mix(sass: str) -> dict[str, int]:
    """Opcode (with its modifiers, e.g. LDG.E.128) -> count, predicates dropped."""
    mix: dict[str, int] = {}
    for line in sass.splitlines():
        if not re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            continue
        words = line.split("*/", 1)[1].strip().rstrip(" ;").split()
        op = words[1] if words[0].startswith("@") else words[0]
        mix[op.rstrip(";")] = mix.get(op.rstrip(";"), 0) + 1
    return mix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"a subset of {','.join(KERNELS)}")
    parser.add_argument("--top", type=int, default=25, help="opcodes listed per kernel")
    parser.add_argument("--out", help="write the full instruction mixes as JSON here")
    args = parser.parse_args(argv)
    results = {}
    for name in args.kernels.split(","):
        if name not in KERNELS:
            parser.error(f"unknown kernel {name!r} (choose from {', '.join(KERNELS)})")
        kernel = compile_sm90(*KERNELS[name]())
        mix = instruction_mix(sass_of(kernel))
        usage = resource_usage(kernel)
        results[name] = dict(instructions=sum(mix.values()), shared_bytes=kernel.metadata.shared, mix=mix, **usage)
        print(f"{name}: {sum(mix.values())} instructions per thread, {kernel.metadata.shared} B shared memory, "
              f"{usage.get('reg')} registers and {usage.get('stack')} B of stack a thread")
        top = sorted(mix.items(), key=lambda kv: -kv[1])[: args.top]
        print("  " + ", ".join(f"{op} {n}" for op, n in top))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90", kernels=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
