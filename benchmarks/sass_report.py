"""What the decode index scan compiles to on Hopper, without a GPU: compiles the library's scan kernels
for sm_90 (Triton's bundled ptxas and cuobjdump) with the launch constants of Kimi-K3.1-Pro's pages
(32 index heads x 128, batch 1 tiling) and prints the SASS instruction mix of one program.

A static proxy for where the per-token time goes, for sessions without device time: the counts are
per thread per 128-token tile (one program at batch 1), so e.g. 128 `STS.U16` means every decoded
key value is stored to shared memory on its own. It measures nothing: timings come from
decode_attention.py on the GPU.

    python benchmarks/sass_report.py [--kernels scan_fp8,scan_fp4] [--top 25] [--out PATH]

Integer arguments are specialised as a launch specialises them: strides of 1 become constants,
the rest are marked divisible by 16 (true of every stride of the engine's pages).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("sass_report.py needs Triton (pip install triton); no GPU is needed")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.ops.indexer import triton as indexer  # noqa: E402

SCAN_INTS = ["q_sb", "q_sh", "w_sb", "k_sp", "k_st", "ks_sp", "bt_sb", "out_sb", "H", "max_context"]


def scan_fp8():
    types = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*fp8e4nv", ks_ptr="*fp32", bt_ptr="*i32", cl_ptr="*i32",
                 out_ptr="*fp32", **{n: "i32" for n in SCAN_INTS})
    consts = dict(q_sd=1, k_sd=1, w_sh=1, ks_st=1, bt_sm=1, D=128, PAGE=384, BLOCK_H=32, BLOCK_S=128, TILES=1,
                  HAS_SCALE=True, DT=tl.float16, SPLIT_Q=False, EMULATE=False, PRECISION="tf32", NUM_STAGES=2)
    return indexer._indexer_scores_kernel, types, consts, dict(num_warps=4, num_stages=2)


def scan_fp4():
    types = dict(q_ptr="*bf16", w_ptr="*fp32", k_ptr="*u8", ks_ptr="*i32", bt_ptr="*i32", cl_ptr="*i32",
                 out_ptr="*fp32", ks_st="i32", **{n: "i32" for n in SCAN_INTS})
    consts = dict(q_sd=1, w_sh=1, ks_sg=1, bt_sm=1, D=128, GROUPS=4, SCALE_WORDS=True, PAGE=704, BLOCK_H=32,
                  BLOCK_S=128, TILES=1, DT=tl.float16, SPLIT_Q=False, EMULATE=False, PRECISION="tf32",
                  NUM_STAGES=2, ASM=True)
    return indexer._indexer_scores_mxfp4_kernel, types, consts, dict(num_warps=4, num_stages=2)


KERNELS = dict(scan_fp8=scan_fp8, scan_fp4=scan_fp4)


def compile_sm90(fn, types: dict, consts: dict, options: dict):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        else:
            signature[name] = types[name]
            if types[name].startswith("*") or name in SCAN_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(kernel) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


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
        results[name] = dict(instructions=sum(mix.values()), shared_bytes=kernel.metadata.shared, mix=mix)
        print(f"{name}: {sum(mix.values())} instructions per thread, {kernel.metadata.shared} B shared memory")
        top = sorted(mix.items(), key=lambda kv: -kv[1])[: args.top]
        print("  " + ", ".join(f"{op} {n}" for op, n in top))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(triton=triton.__version__, target="sm_90", kernels=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
