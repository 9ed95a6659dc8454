"""Does the fused MoE GEMM of this tree compile to the same sm_90 code as at another commit? No GPU needed.

For each tiling (benchmarks/moe_layer.py variant SPECs, both GEMMs at the K3.1 shape, plus small fp32
and bf16-weight tilings with K tails), compiles `_moe_gemm_kernel` of this tree and of
`kimiserve/ops/moe/triton.py` at REV (Triton's bundled ptxas) and compares the SASS instruction by
instruction (addresses dropped). "identical" means a kernel the GPU ran at REV is the kernel this tree
runs; a session without a device uses it to keep GPU-verified paths unchanged.

    python benchmarks/moe_sass_diff.py REV [--variants SPEC,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import triton.language as tl  # noqa: E402

from kimiserve.ops.moe import triton as current  # noqa: E402
from moe_layer import parse_variant  # noqa: E402
from sass_report import compile_sm90, sass_of  # noqa: E402

INTS = ["N_OUT", "K", "A_ROW_DIV", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"]
DEFAULT_SPECS = ",".join(["lut-m16-n64-k256-w4-s3", "lut-m32-n64-k128-w4-s3-dn128", "lut-m64-n64-k128-w4-s3-dn128",
                          "lut-m16-n64-k256-w4-s3-swap"])
# (dequant, mxfp4, block_m, block_n, block_k, warps, stages, swap, gated, K, dtype): small tilings with K tails
EXTRA = [(0, True, 16, 32, 32, 4, 2, False, True, 96, "fp32"), (0, False, 16, 64, 128, 4, 3, True, True, 2304, "bf16"),
         (0, False, 16, 32, 32, 4, 2, False, False, 40, "fp32"), (1, True, 64, 64, 128, 4, 3, False, True, 96, "bf16")]


def module_at(rev: str):
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:kimiserve/ops/moe/triton.py"], capture_output=True,
                         text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "moe_triton_at_rev.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("moe_triton_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def sass_lines(mod, dq, mx, bm, bn, bk, warps, stages, swap, gated, K, dt) -> list[str]:
    wt = ("*i32" if dq in (1, 3) else "*u8") if mx else ("*bf16" if dt == "bf16" else "*fp32")
    at = "*bf16" if dt == "bf16" else "*fp32"
    types = dict(a_ptr=at, w_ptr=wt, ws_ptr="*u8", v_ptr=wt, vs_ptr="*u8", out_ptr=at, sorted_ptr="*i32",
                 bexp_ptr="*i32", brows_ptr="*i32", nblk_ptr="*i32", beta="fp32", linear_beta="fp32", s_ps="i32",
                 **{n: "i32" for n in INTS})
    consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, MXFP4=mx, DEQUANT=dq, ASM=True, SWAP=swap,
                  DTYPE=tl.bfloat16 if dt == "bf16" else tl.float32, PRECISION="tf32" if dt == "bf16" else "ieee",
                  BM=bm, BN=bn, BK=bk, EVEN_K=K % bk == 0, SPLIT=1)  # names a kernel lacks are not looked up
    kernel = compile_sm90(mod._moe_gemm_kernel, types, consts, dict(num_warps=warps, num_stages=stages),
                          [n for n in INTS if n != "A_ROW_DIV"])
    return [re.sub(r"/\*[0-9a-f]{4}\*/", "", ln).split(";")[0].strip() for ln in sass_of(kernel).splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the commit to compare against (e.g. the tree of the last GPU run)")
    parser.add_argument("--variants", default=DEFAULT_SPECS, help="moe_layer.py SPECs (not 'shift': new at REV)")
    args = parser.parse_args(argv)
    old = module_at(args.rev)
    cases = []
    for spec in args.variants.split(","):
        cfg = parse_variant(spec)
        dq = current._DEQUANT[cfg.dequant]
        for gated, tiles, K in ((True, cfg.up, 3584), (False, cfg.down, 3072)):
            cases.append((spec + (" up" if gated else " down"), (dq, True, cfg.block_m, tiles.block_n, tiles.block_k,
                          tiles.num_warps, tiles.num_stages, tiles.swap, gated, K, "bf16")))
    cases += [(f"small {c}", c) for c in EXTRA]
    different = 0
    for name, case in cases:
        a, b = sass_lines(old, *case), sass_lines(current, *case)
        same = a == b
        different += not same
        print(f"{name:<48} {'identical' if same else f'DIFFERENT ({len(a)} vs {len(b)} instructions)'}", flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    raise SystemExit(main())
