"""One routed-experts MoE layer at the Kimi-K3.1 shape on one GPU: the Triton fused MoE against its
bytes and FLOP rooflines and against plain PyTorch.

Shape: 896 experts, top-16, 3584 -> 3072 -> 3584, SiTU, MXFP4 experts (random packed bytes drawn on
the GPU, scale bytes 118..121: 15.7 GB, no float copy), bf16 activations; 1, 16, 64, 256, 1024 and
8192 tokens; routing random (16 distinct uniform experts per token) and zipf (expert e drawn with
weight 1 / (e + 1), a random relabelling; a few experts take most tokens).
- kernel: `ops.moe.triton.fused_moe` (alignment, gate/up, down, combine), median of CUDA-graph
  replays up to 256 tokens (the decode path), of eager CUDA-event timings above. The default config,
  then every launch variant of --variants that applies to the token count (decode variants up to
  256 tokens, prefill variants from 256): the best is reported beside the default.
- bytes: the distinct experts the routing hit x 17.55 MB (packed codes + scales of w1, w3, w2)
  + x and out; roofline_ms = bytes / copy bandwidth (a 4 GiB device copy in the same run, read +
  write counted). bytes_with_workspace adds the kernels' intermediate rows (act, y: written + read).
- FLOPs: 6 N k h I (three GEMMs); flop_roofline_ms from a 8192^3 bf16 torch.matmul in the same run.
- peer: plain PyTorch on bf16 weights already dequantised (all 896 experts resident, 59 GB): pairs
  sorted by expert, `torch._grouped_mm` for the three GEMMs over every expert (empty groups for
  experts not hit: only hit experts are read), the activation, the weighted scatter; a loop of
  torch.mm over the hit experts where _grouped_mm is missing. Dequantisation not timed.
- today: `RoutedExperts` with the fused kernel off (its torch forms: bf16 dequantisation on every
  call), where it fits in memory (3 runs).
--check: before timing, the kernel (default config and every variant) against `fused_moe_reference`
at the same shape for --check-tokens (relative RMS error, bound 1e-2), and the peer against it too.

    python benchmarks/moe_layer.py [--tokens 1,16,64,256,1024,8192] [--routings random,zipf] [--check]
        [--variants default|decode|prefill|all|SPEC,...] [--out benchmarks/results/moe_layer.json]
    python benchmarks/moe_layer.py --dry-run --out /tmp/moe.json   # tiny shapes, Triton's CPU interpreter
    python benchmarks/moe_layer.py --sass [--variants ...]   # no GPU: each variant's sm_90 build (registers,
                                                            # spills, shared memory, SASS per K step)

A variant SPEC is DEQUANT-mBM-nBN-kBK-wWARPS-sSTAGES[-dnBN][-dkBK][-dwWARPS][-dsSTAGES][-rREGS][-drREGS]
[-skS][-dskS][-tNAME][-swap][-frag][-pdl] (dn/dk/dw/ds: the down GEMM's column tile, K step, warps and stages when
they differ from the gate/up GEMM's; frag: MoEConfig.fragments; r/dr: a register cap (maxnreg) per GEMM; sk/dsk:
split-K of the gate/up and down GEMMs, fp32 partials reduced in a fixed order; pdl: MoEConfig.dependent_launch, the
decode chain's programmatic dependent launch; tNAME: MoEConfig.wgmma_tails by the names of `moe_specs.TAILS`, e.g.
t32: the wgmma GEMMs' tails of at most 32 rows as 32-token tiles, two programs an SM), e.g.
lut-m16-n64-k256-w4-s3-swap, shift-m16-n64-k128-w4-s4-sk4-dsk4, shift-m8-n64-k256-w4-s2-dr72-sk2-swap-frag-pdl. A
variant default-shift+OPT[+OPT...] is the shift layout's default config with options (`with_options`: pdl, skS,
dskS, the TAILS names), e.g. default-shift+sk1 or default-shift+t32. An option that does not apply to a size's
default config (t32 where it is not the wgmma GEMMs, at K3.1 up to 1344 tokens) raises there: that size is not timed
for the variant, and a --check at such a size drops the variant at every size.
--stages-each times every variant's stages apart (gate/up, down): the best gate/up and the best down tiling of
a sweep can then be paired.
Writes the JSON after every row (device, date, commit, copy_gbps, matmul_tflops, rows) and prints a
table last. Each row's `clocks`: the SM clock and power draw while its kernel and variants were timed
(`gpu_clocks.py`, nvidia-smi; None without it). From 16 tokens on, the H200 reaches its 700 W cap and lowers its
clock (BENCHMARKS.md, session 18), so a figure is read with the clock it ran at.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
if "--dry-run" in sys.argv:  # before any kernel is defined: Triton's CPU interpreter, with the tests' shims
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import triton_interpreter_shims  # noqa: E402

    triton_interpreter_shims.enable()

import torch  # noqa: E402

from kimiserve.config import load_preset  # noqa: E402
from kimiserve.ops.activation.reference import situ_and_mul  # noqa: E402
from kimiserve.ops.moe import align as moe_align  # noqa: E402
from kimiserve.ops.moe import triton as tt  # noqa: E402
from kimiserve.ops.moe.reference import fused_moe_reference  # noqa: E402
from kimiserve.ops.quant.reference import dequantize_mxfp4  # noqa: E402
from kimiserve.utils.cuda_timing import cuda_time, graph_time, wall_time  # noqa: E402
from kimiserve.utils.run_info import git_commit, results_path  # noqa: E402

from gpu_clocks import ClockLog, summarize  # noqa: E402  (benchmarks/, on sys.path as the script's folder)
from moe_specs import config_spec, default_with_options, parse_variant, with_options  # noqa: E402,F401

# Tilings that compile for sm_90 without spills (Triton 3.6's ptxas, offline: `--sass`). "shift" variants run on
# the experts re-laid once (mxfp4_layout.to_shift_layout); the default config (the checkpoint layout, "lut") is
# always timed first, so it is not listed; lut-m128 is the earlier 8192-token default.
DECODE_VARIANTS = [
    "shift-m16-n64-k256-w4-s3",
    "shift-m16-n64-k128-w4-s4",
    "shift-m16-n128-k128-w4-s3",
    "shift-m16-n128-k256-w8-s3",
    "shift-m16-n64-k256-w4-s3-swap",
    "shift-m16-n32-k256-w2-s3-swap",  # swapped but 32 weight rows: mma.sync (no wgmma), weights from registers
    "shift-m16-n32-k256-w1-s3-swap",
    "shift-m16-n32-k128-w2-s4-swap",
    "shift-m16-n16-k256-w1-s3-swap",  # one warp, 16 weight rows: 3072 / 3584 programs (finer waves at 1 token)
    "shift-m16-n16-k256-w1-s2-swap",
    "shift-m16-n32-k256-w2-s3",
]
PREFILL_VARIANTS = [
    "shift-m32-n64-k128-w4-s3-dn128",
    "shift-m64-n64-k128-w4-s3-dn128",
    "shift-m64-n64-k128-w4-s4-dn128",
    "shift-m64-n64-k128-w4-s2-dn128",  # 3 CTAs per SM (shared memory): one's dequant under another's wgmma
    "shift-m128-n64-k128-w4-s3-dn128",
    "shift-m128-n64-k128-w8-s3-dn128",
    "shift-m256-n32-k128-w8-s3",
    "lut-m128-n64-k128-w8-s3-dn128",
]
# Split-K decode forms (GemmTiles.split_k): S times the programs, each a K slice into fp32 partials
SPLIT_VARIANTS = [
    "shift-m16-n64-k128-w4-s4-sk4-dsk4",
    "shift-m16-n64-k128-w4-s3-sk8-dsk8",
    "shift-m16-n128-k128-w4-s4-sk4-dsk4",
    "shift-m16-n128-k128-w4-s5-sk2-dsk2",
    "shift-m16-n64-k256-w4-s4-sk2-dsk2",
    "shift-m16-n32-k256-w2-s3-swap-sk4-dsk4",
]
DECODE_MAX_TOKENS = 256  # decode variants up to here, prefill variants from here (both at 256)
DRY_VARIANTS = ["lut-m16-n32-k64-w4-s2-swap", "shift-m16-n32-k64-w4-s2", "exact-m32-n32-k32-w4-s2-dn64",
                "shift-m16-n32-k32-w4-s2-sk2-dsk3"]


def variants_for(arg: str, dry: bool) -> list[str]:
    if dry:
        return DRY_VARIANTS
    named = {"default": [], "default-shift": [], "decode": DECODE_VARIANTS, "prefill": PREFILL_VARIANTS,
             "split": SPLIT_VARIANTS, "all": DECODE_VARIANTS + PREFILL_VARIANTS}  # both defaults are always timed
    out = []
    for item in arg.split(","):
        out += named[item] if item in named else [item]
    for spec in out:  # fail before any GPU time is spent
        default_with_options(spec, "default-shift", tt.MoEConfig) or parse_variant(spec)
    return out


def applies(spec: str, tokens: int, explicit: bool) -> bool:
    if explicit:
        return True
    if spec in DECODE_VARIANTS or spec in SPLIT_VARIANTS:
        return tokens <= DECODE_MAX_TOKENS
    return tokens >= DECODE_MAX_TOKENS


# ------------------------------------------------------------------------------------------------
# inputs


def packed_experts(E: int, h: int, inter: int, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    w = {}
    for name, rows, cols in (("w1", inter, h), ("w3", inter, h), ("w2", h, inter)):
        w[name] = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, device=device, generator=g)
        w[f"{name}_scale"] = torch.randint(118, 122, (E, rows, cols // 32), dtype=torch.uint8, device=device,
                                           generator=g)
    return w


def route(N: int, E: int, k: int, routing: str, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    if routing == "random":
        probs = torch.ones(N, E, device=device)
    elif routing == "zipf":
        probs = (1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32)).expand(N, E).contiguous()
    else:
        raise ValueError(f"routing must be random or zipf, got {routing!r}")
    picks = torch.multinomial(probs, k, replacement=False, generator=g)
    ids = torch.randperm(E, device=device, generator=g)[picks]
    weights = torch.rand(N, k, device=device, generator=g)
    return ids, weights / weights.sum(-1, keepdim=True)


def layer_bytes(experts_hit: int, per_expert: int, tokens: int, hidden: int, act_bytes: int, pairs: int) -> int:
    """The bytes a layer must move: the experts it hits (codes and scales), x and out, ids (int64) and weights
    (fp32)."""
    return experts_hit * per_expert + 2 * tokens * hidden * act_bytes + pairs * (8 + 4)


def situ(g, u):
    return situ_and_mul(g, u, 4.0, 25.0)


def kernel_fn(x, w, ids, weights, cfg, out, shifted=None):
    """The fused MoE; a "shift" config runs on `shifted` (the same experts in the shift layout)."""
    layout = "shift" if cfg is not None and cfg.dequant == "shift" else "checkpoint"
    w = shifted if layout == "shift" else w
    return lambda: tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"],
                                w2_scale=w["w2_scale"], w3_scale=w["w3_scale"], activation="situ", out=out,
                                config=cfg, mxfp4_layout=layout)


def shift_layout(w: dict, needed: bool) -> dict | None:
    """The experts re-laid for the "shift" decode (once, as a loader would), if a variant needs them."""
    from kimiserve.ops.moe.mxfp4_layout import to_shift_layout

    if not needed:
        return None
    return {n: (t if n.endswith("_scale") else to_shift_layout(t, w[f"{n}_scale"])) for n, t in w.items()}


def stage_fns(x, w, ids, weights, cfg: tt.MoEConfig) -> dict:
    """The four launches of fused_moe on their own (align; gate/up; down; combine), on fixed buffers."""
    import triton

    from kimiserve.ops.moe.dependent_launch import launch_options

    N, k = ids.shape
    E, inter, h = w["w1"].shape[0], w["w1"].shape[1], x.shape[1]
    act = torch.empty(N * k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(N * k, h, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    align = tt.align_blocks(ids, E, cfg.block_m, dependent_launch=cfg.dependent_launch)
    BH = min(cfg.combine_block, triton.next_power_of_2(h))

    def up():  # with split-K: the partials' GEMM and their reduce
        tt.gate_up(x, w["w1"], w["w1_scale"], w["w3"], w["w3_scale"], act, align, cfg, "situ", 4.0, 25.0)

    def down():
        tt.down_gemm(act, w["w2"], w["w2_scale"], y, align, cfg)

    def combine():
        tt._combine_kernel[(N, triton.cdiv(h, BH))](y, weights, out, h, y.stride(0), *weights.stride(), out.stride(0),
                                                     0, TOP_K=k, BH=BH, PDL=cfg.dependent_launch, num_warps=4,
                                                     **launch_options(cfg.dependent_launch))

    def down_combine():
        tt.down_combine(act, w["w2"], w["w2_scale"], y, weights, out, align, cfg)

    up()
    fns = dict(align=lambda: tt.align_blocks(ids, E, cfg.block_m, dependent_launch=cfg.dependent_launch), up=up)
    if cfg.down.split_k > 1:  # the combine is the partials' reduce: timed together
        return dict(fns, down_combine=down_combine)
    down()
    return dict(fns, down=down, combine=combine)


def reference(x, w, ids, weights):
    return fused_moe_reference(x, w["w1"], w["w2"], w["w3"], ids, weights, situ, w["w1_scale"], w["w2_scale"],
                               w["w3_scale"])


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------
# the plain-PyTorch peer and today's path


def dequantized_experts(w: dict, dtype) -> dict:
    """bf16 copies of every expert (one expert at a time, into preallocated stacks)."""
    out = {}
    for name in ("w1", "w2", "w3"):
        p, s = w[name], w[f"{name}_scale"]
        full = torch.empty(p.shape[0], p.shape[1], p.shape[2] * 2, dtype=dtype, device=p.device)
        for e in range(p.shape[0]):
            full[e] = dequantize_mxfp4(p[e], s[e], dtype)
        out[name] = full
    return out


def grouped_mm_available(device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(32, 32, dtype=torch.bfloat16, device=device)
        b = torch.randn(2, 32, 32, dtype=torch.bfloat16, device=device).transpose(1, 2)
        torch._grouped_mm(a, b, offs=torch.tensor([0, 32], dtype=torch.int32, device=device))  # an empty group
        return True
    except Exception:
        return False


def peer_fn(x, wb: dict, ids, weights, grouped: bool):
    """Plain PyTorch MoE on bf16 weights: sort pairs by expert, three grouped GEMMs, SiTU, weighted scatter."""
    N, k = ids.shape
    E = wb["w1"].shape[0]
    w1t, w3t, w2t = (wb[n].transpose(1, 2) for n in ("w1", "w3", "w2"))  # [E, in, out], column-major

    def run():
        flat = ids.reshape(-1)
        order = torch.argsort(flat)
        tokens = order // k
        xs = x[tokens]
        if grouped:  # counts by scatter_add (bincount reads its max back: no graph capture)
            counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
            offs = torch.cumsum(counts, 0).to(torch.int32)
            act = situ(torch._grouped_mm(xs, w1t, offs=offs), torch._grouped_mm(xs, w3t, offs=offs))
            y = torch._grouped_mm(act, w2t, offs=offs)
        else:  # a loop of torch.mm over the hit experts (host-side counts)
            counts = torch.bincount(flat, minlength=E).tolist()
            ys, start = [], 0
            for e, c in enumerate(counts):
                if c:
                    rows = xs[start:start + c]
                    ys.append(situ(rows @ w1t[e], rows @ w3t[e]) @ w2t[e])
                    start += c
            y = torch.cat(ys)
        out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
        return out.to(x.dtype)

    return run


def todays_experts(w: dict, E: int, k: int, h: int, inter: int):
    """RoutedExperts holding the packed weights, its fused kernel off (the torch forms of today)."""
    from kimiserve.model.moe import RoutedExperts

    config = load_preset("kimi-k3.1-pro").replace(num_experts=E, num_experts_per_token=k, routed_expert_hidden_size=h,
                                                   moe_intermediate_size=inter, num_expert_group=1, topk_group=1)
    with torch.device("meta"):
        experts = RoutedExperts(config, torch.bfloat16)
    for name, t in w.items():  # w1 -> w1_packed, w1_scale -> w1_scale
        setattr(experts, name if name.endswith("_scale") else f"{name}_packed", torch.nn.Parameter(t, requires_grad=False))
    experts.use_fused = False
    return experts


# ------------------------------------------------------------------------------------------------
# ceilings


def copy_gbps(device, nbytes: int, timer) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device, n: int, dtype, timer) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = timer(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------
# static report (no GPU)

_GEMM_INTS = ["N_OUT", "K", "A_ROW_DIV", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"]


def sass_report(specs: list[str], h: int, inter: int) -> int:
    """Compile both GEMMs of each variant for sm_90 (Triton's bundled ptxas) at the given shape and print
    registers, stack (spills), shared memory and the instructions of the K loop per weight per thread."""
    import re
    import subprocess
    import tempfile

    import triton
    import triton.language as tl

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from sass_report import compile_sm90, instruction_mix, sass_of

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    from kimiserve.ops.moe.config import hopper_programs_an_sm

    print("variant                                  gemm    regs stack  smem KB  an SM  loop instr  per weight  moves"
          "   alu   fma  MMA   (moves, alu, fma: per weight; an SM: programs resident on one sm_90 SM; gemm/BM: a "
          "wgmma tail launch)")
    for spec in specs:
        cfg = parse_variant(spec)
        dq = tt._DEQUANT[cfg.dequant]
        for name, gated, tiles, K in (("up", True, cfg.up, h), ("down", False, cfg.down, inter)):
            w_t = "*i32" if dq in (1, 3) else "*u8"
            types = dict(a_ptr="*bf16", w_ptr=w_t, ws_ptr="*u8", v_ptr=w_t, vs_ptr="*u8", out_ptr="*bf16",
                         sorted_ptr="*i32", bexp_ptr="*i32", brows_ptr="*i32", nblk_ptr="*i32", beta="fp32",
                         linear_beta="fp32", s_ps="i32", **{n: "i32" for n in _GEMM_INTS})
            consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, MXFP4=True, DEQUANT=dq, ASM=True, SWAP=tiles.swap,
                          DTYPE=tl.bfloat16, PRECISION="tf32", BM=cfg.block_m, BN=tiles.block_n, BK=tiles.block_k,
                          EVEN_K=K % tiles.block_k == 0, SPLIT=tiles.split_k)
            fn, options = tt._moe_gemm_kernel, tiles.compile_options()
            launches = [(name, consts, options, tiles.num_warps)]
            if cfg.fragments and cfg.block_m > 16:  # the main launch, then each tail launch (at block_m 128)
                from kimiserve.ops.moe import gluon_prefill
                fn = gluon_prefill._wgmma_gemm_kernel
                types.update(s_we="i64", s_se="i64", w_ptr="*i32", ws_ptr="*i32", v_ptr="*i32", vs_ptr="*i32")
                tails = cfg.wgmma_tails if cfg.block_m == 128 else ()
                launches = [(f"{name}{'/' + str(bm) if bm != cfg.block_m else ''}",
                             dict(GATED=gated, PAIRED=not gated and gluon_prefill.paired_down(h), ACT=1,
                                  LINEAR_TANH=True, BM=bm, STAGES=stages, ALIGN_M=cfg.block_m, MIN_ROWS=1, NW=warps),
                             dict(num_warps=warps, **({"maxnreg": regs} if regs else {})), warps)
                            for bm, stages, regs, warps in [(cfg.block_m, tiles.num_stages, tiles.max_registers,
                                                              tiles.num_warps)]
                            + [(t.block_m, t.num_stages, t.max_registers, t.num_warps) for t in tails]]
            elif cfg.fragments:
                from kimiserve.ops.moe import gluon_decode
                fn = gluon_decode._fragment_gemm_kernel
                consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, BN=tiles.block_n, BK=tiles.block_k,
                              OUT_BK=cfg.down.block_k, NUM_WARPS=tiles.num_warps, PDL=cfg.dependent_launch,
                              SWAP=tiles.swap, BM=cfg.block_m, SPLIT=tiles.split_k)
                launches = [(name, consts, gluon_decode.compile_options(tiles), tiles.num_warps)]
                types.update(s_we="i64", s_se="i64", s_ps="i32")
                if tiles.split_k > 1:
                    types.update(out_ptr="*fp32")
            for label, consts, options, warps in launches:
                try:
                    div16 = [n for n in _GEMM_INTS if n != "A_ROW_DIV"] + ["s_ps"]
                    kernel = compile_sm90(fn, types, consts, options, div16)
                except Exception as e:
                    print(f"{spec:<40} {label:<7} does not compile: {type(e).__name__}: {str(e)[:200]}")
                    continue
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(kernel.asm["cubin"])
                    f.flush()
                    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
                m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
                sass = sass_of(kernel)
                ops = _largest_loop(sass)
                mix = loop_mix(ops)
                weights = (2 if gated or consts.get("PAIRED") else 1) * tiles.block_n * tiles.block_k / (32 * warps)
                weights *= 2 if cfg.fragments and cfg.block_m <= 16 else 1  # the decode fragment loop: 2 steps
                mma = ",".join(sorted(op for op in instruction_mix(sass) if "MMA" in op))
                per_sm = hopper_programs_an_sm(int(m.group(1)), warps, kernel.metadata.shared)
                print(f"{spec:<40} {label:<7} {m.group(1):>4} {m.group(2):>5} {kernel.metadata.shared / 1024:8.1f} "
                      f"{per_sm:6d} {len(ops):11d} {len(ops) / weights:11.2f} {mix['moves'] / weights:6.2f} "
                      f"{mix['alu'] / weights:5.2f} {mix['fma'] / weights:5.2f}  {mma}")
    return 0


def _largest_loop(sass: str) -> list[str]:
    """The opcodes (predicates dropped) in the longest backward branch's body (the K loop)."""
    import re

    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addrs = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    best = (0, 0, -1)
    for ln, at in zip(lines, addrs):
        if "BRA" in ln:
            target = re.search(r"0x([0-9a-f]+)", ln.split("BRA", 1)[1])
            if target and int(target.group(1), 16) < at:
                start = int(target.group(1), 16)
                best = max(best, (sum(start <= a <= at for a in addrs), start, at))
    ops = []
    for ln, at in zip(lines, addrs):
        if best[1] <= at <= best[2]:
            words = ln.split("*/", 1)[1].strip().rstrip(" ;").split()
            ops.append(words[1] if words[0].startswith("@") else words[0])
    return ops


# Opcode families by the sm_90 pipe that runs them (integer ALU and FMA are both half rate): where a loop's
# instructions go (session 13's ncu profile showed the decode GEMMs throttled on a math pipe).
_ALU_OPS = ("LOP3", "SHF", "PRMT", "IADD3", "ISETP", "MOV", "SEL", "LEA", "PLOP3", "VIADD", "FSEL")
_FMA_OPS = ("IMAD", "HMUL2", "HFMA2", "HADD2", "FFMA", "FMUL", "FADD")


def loop_mix(ops: list[str]) -> dict[str, int]:
    """Counts of a loop's moves (MOV, IMAD.MOV), integer-ALU and FMA-pipe instructions (moves included)."""
    family = [op.split(".")[0] for op in ops]
    return dict(moves=sum(op == "MOV" or op.startswith("IMAD.MOV") for op in ops),
                alu=sum(f in _ALU_OPS for f in family), fma=sum(f in _FMA_OPS for f in family))


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    with ClockLog() as clocks:  # nvidia-smi in the background (nothing without it): each row's SM clock and power
        return _main(argv, clocks)


def _main(argv: list[str] | None, clocks: ClockLog) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,64,256,1024,8192")
    parser.add_argument("--routings", default="random,zipf")
    parser.add_argument("--variants", default="decode,prefill",
                        help="default or default-shift (none beyond the two defaults), decode, prefill, split, all, "
                             "or SPECs (module doc), comma-separated")
    parser.add_argument("--check", action="store_true", help="check the kernel and every variant first")
    parser.add_argument("--check-tokens", default="1,64,300")
    parser.add_argument("--today-tokens", default="1,16,64,256,1024",
                        help="token counts at which to time today's RoutedExperts path ('' for none)")
    parser.add_argument("--no-peer", action="store_true", help="skip the plain-PyTorch grouped-GEMM peer")
    parser.add_argument("--stages-each", action="store_true",
                        help="time every variant's gate/up and down launches apart (not only the default's)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shape", default="896,16,3584,3072", help="experts,top_k,hidden,intermediate")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under Triton's interpreter (a plumbing check, no figures)")
    parser.add_argument("--sass", action="store_true",
                        help="no GPU: compile the default and every variant for sm_90 and print their resources")
    parser.add_argument("--align-pairs", type=int, default=moe_align.ALIGN_SMALL_PAIRS,
                        help="pairs up to which the align is one program, and the chunk of its chunked kernels above "
                             "(a power of two; patches ops.moe.align.ALIGN_SMALL_PAIRS in this process: an A/B)")
    parser.add_argument("--out", default=None,
                        help="the JSON (default benchmarks/results/moe_layer.json; a CPU smoke run's "
                             "under the temp dir)")
    args = parser.parse_args(argv)
    args.out = args.out or results_path("moe_layer.json", smoke=args.dry_run)
    if args.align_pairs < 16 or args.align_pairs & (args.align_pairs - 1):
        parser.error(f"--align-pairs must be a power of two >= 16, got {args.align_pairs}")
    moe_align.ALIGN_SMALL_PAIRS = args.align_pairs
    if args.sass:
        _, _, h, inter = (int(v) for v in args.shape.split(","))
        defaults = [config_spec(tt.default_config(n, 16, 896, torch.bfloat16, True, layout, dims=(h, inter)))
                    for layout in ("checkpoint", "shift") for n in (1, 1024, 8192)]
        specs = [config_spec(default_with_options(v, "default-shift", lambda: tt.default_config(
            1, 16, 896, torch.bfloat16, True, "shift", dims=(h, inter)))) if v.startswith("default-shift+") else v
            for v in variants_for(args.variants, False)]  # options onto the 1-token default
        return sass_report(list(dict.fromkeys(defaults + specs)), h, inter)

    dry = args.dry_run
    if dry:
        device, dtype = "cpu", torch.bfloat16
        E, k, h, inter = 5, 2, 64, 32
        tokens, check_tokens, today_tokens = [1, 5], [1, 5], [1, 5]
        timer = lambda fn: wall_time(fn, repeats=1, warmup=0)  # noqa: E731
        slow_timer = timer
        copy = copy_gbps(device, 2**24, timer)
        mm = matmul_tflops(device, 256, torch.float32, timer)
    else:
        if not torch.cuda.is_available():
            print("moe_layer.py times CUDA kernels and needs a GPU; --dry-run checks the plumbing on the CPU",
                  file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        E, k, h, inter = (int(v) for v in args.shape.split(","))
        tokens = [int(t) for t in args.tokens.split(",")]
        check_tokens = [int(t) for t in args.check_tokens.split(",")]
        today_tokens = [int(t) for t in args.today_tokens.split(",") if t]
        timer = lambda fn: cuda_time(fn, repeats=args.repeats, warmup=3)  # noqa: E731
        slow_timer = lambda fn: cuda_time(fn, repeats=3, warmup=1)  # noqa: E731
        copy = copy_gbps(device, 2**32, timer)
        mm = matmul_tflops(device, 8192, torch.bfloat16, timer)
    variants = variants_for(args.variants, dry)
    explicit = dry or any(v not in ("default", "default-shift", "decode", "prefill", "split", "all")
                          for v in args.variants.split(","))
    routings = args.routings.split(",")

    def fast_time(fn, n: int) -> tuple[float, str]:
        if device == "cuda" and n <= DECODE_MAX_TOKENS:
            try:
                return graph_time(fn, repeats=max(args.repeats, 20)), "graph"
            except Exception as e:  # a path that cannot be captured: eager
                print(f"graph capture failed ({type(e).__name__}: {e}); eager timing", file=sys.stderr)
        return timer(fn), "eager" if device == "cuda" else "wall"

    result = dict(benchmark="moe_layer", device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  commit=git_commit(), command=" ".join(sys.argv), dry_run=dry,
                  shape=dict(experts=E, top_k=k, hidden=h, intermediate=inter, weights="mxfp4", activations=str(dtype)),
                  copy_gbps=copy, matmul_tflops=mm, variants=variants, checks=[], rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print(f"{result['device']}: copy {copy:.0f} GB/s (read + write), matmul {mm:.1f} TFLOP/s; "
          f"{E} experts, top-{k}, {h} -> {inter} -> {h}", flush=True)
    gen_x = torch.Generator(device=device).manual_seed(1)
    w = packed_experts(E, h, inter, device)
    shifted = shift_layout(w, not dry or any(v.startswith("shift") for v in variants))
    # "default": default_config for the checkpoint layout; "default-shift": for the shift layout (re-laid copy)
    defaults = ["default", "default-shift"] if shifted is not None else ["default"]
    result["defaults"] = defaults

    def config_for(spec: str, n: int) -> tt.MoEConfig | None:
        if spec == "default":
            return None
        def shift_default():
            return tt.device_default_config(n, k, E, dtype, True, "shift", (h, inter), device)

        if spec == "default-shift":
            return shift_default()
        return default_with_options(spec, "default-shift", shift_default) or parse_variant(spec)
    per_expert = sum(w[n][0].numel() for n in w)  # bytes: uint8 codes and scales
    act_bytes = torch.tensor([], dtype=dtype).element_size()

    def inputs(n: int, routing: str, seed: int):
        x = torch.randn(n, h, device=device, generator=gen_x).to(dtype)
        ids, weights = route(n, E, k, routing, device, seed)
        return x, ids, weights

    # 1. correctness at the timed shape
    if args.check or dry:
        for n in check_tokens:
            x, ids, weights = inputs(n, "random", 100 + n)
            want = reference(x, w, ids, weights)
            for spec in defaults + variants:
                cfg = config_for(spec, n)
                out = torch.full_like(x, float("nan"))
                try:
                    got = kernel_fn(x, w, ids, weights, cfg, out, shifted)()
                except Exception as e:  # e.g. a tiling that does not compile or fit: recorded, not timed
                    result["checks"].append(dict(tokens=n, variant=spec, error=f"{type(e).__name__}: {e}"[:500],
                                                 ok=False))
                    print(f"check {n:>5} tokens {spec:<40} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                err = rel_rms(got, want)
                ok = bool(torch.isfinite(got).all()) and err < 1e-2
                result["checks"].append(dict(tokens=n, variant=spec, rel_rms=err, ok=ok))
                print(f"check {n:>5} tokens {spec:<40} rel RMS {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
            save()
    failed = {c["variant"] for c in result["checks"] if not c["ok"]}

    # 2. the kernel: default config and variants
    rows = {}
    for routing in routings:
        for n in tokens:
            row_start = time.time()
            x, ids, weights = inputs(n, routing, n)
            hit = int(torch.unique(ids).numel())
            nbytes = layer_bytes(hit, per_expert, n, h, act_bytes, ids.numel())
            workspace = 2 * n * k * (inter + h) * act_bytes
            flops = 6 * n * k * h * inter
            out = torch.empty_like(x)
            default_cfg = tt.device_default_config(n, k, E, dtype, True, "checkpoint", (h, inter), device)
            row = dict(kind="moe_layer", routing=routing, tokens=n, experts_hit=hit, bytes=nbytes,
                       bytes_with_workspace=nbytes + workspace, roofline_ms=nbytes / (copy * 1e9) * 1e3,
                       flops=flops, flop_roofline_ms=flops / (mm * 1e12) * 1e3, default_config=config_spec(default_cfg))
            ms, how = fast_time(kernel_fn(x, w, ids, weights, None, out), n)
            row.update(kernel_ms=ms, timing=how)
            timed = [dict(variant="default", config=row["default_config"], ms=ms)]
            for spec in defaults[1:] + variants:
                if spec in failed or not (spec in defaults or applies(spec, n, explicit)):
                    continue
                try:
                    vms, _ = fast_time(kernel_fn(x, w, ids, weights, config_for(spec, n), out, shifted), n)
                except Exception as e:  # a tiling that does not compile (shared memory, registers)
                    print(f"variant {spec} at {n} tokens failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                timed.append(dict(variant=spec, config=config_spec(config_for(spec, n)) if spec.startswith("default")
                                  else spec,
                                  ms=vms))
                if args.stages_each:
                    cfg = config_for(spec, n)
                    fns = stage_fns(x, shifted if cfg.dequant == "shift" else w, ids, weights, cfg)
                    timed[-1]["stages_ms"] = {name: fast_time(fns[name], n)[0] for name in ("up", "down") if name in fns}
            for t in timed:
                t.update(bytes_roofline_fraction=row["roofline_ms"] / t["ms"],
                         matmul_fraction=row["flop_roofline_ms"] / t["ms"], tflops=flops / (t["ms"] * 1e-3) / 1e12)
            best = min(timed, key=lambda t: t["ms"])
            stage_cfg = config_for(defaults[-1], n) or default_cfg  # the shift layout's default where there is one
            stage_w = shifted if stage_cfg.dequant == "shift" else w
            stages = {name: fast_time(fn, n)[0] for name, fn in stage_fns(x, stage_w, ids, weights, stage_cfg).items()}
            up_bytes = hit * sum(w[n_][0].numel() for n_ in ("w1", "w3", "w1_scale", "w3_scale"))
            row.update(stages=dict(config=config_spec(stage_cfg), ms=stages,
                                   up_gbps=up_bytes / (stages["up"] * 1e-3) / 1e9,
                                   down_gbps=(hit * per_expert - up_bytes)
                                   / (stages.get("down") or stages["down_combine"]) / 1e6))
            row.update(bytes_roofline_fraction=row["roofline_ms"] / ms, matmul_fraction=row["flop_roofline_ms"] / ms,
                       tflops=flops / (ms * 1e-3) / 1e12, best_variant=best["config"], best_ms=best["ms"],
                       best_bytes_roofline_fraction=best["bytes_roofline_fraction"],
                       best_matmul_fraction=best["matmul_fraction"], variants=timed)
            row["_span"] = (row_start, time.time())
            rows[(routing, n)] = row
            result["rows"] = list(rows.values())
            save()
            print(f"{routing:>6} {n:>5} tokens: {hit} experts hit, kernel {ms:.4f} ms ({how}), roofline "
                  f"{row['roofline_ms']:.4f} ms ({100 * row['bytes_roofline_fraction']:.1f}%), "
                  f"{row['tflops']:.1f} TFLOP/s ({100 * row['matmul_fraction']:.1f}% of matmul); "
                  f"best {best['config']} {best['ms']:.4f} ms", flush=True)
            st = row["stages"]
            print(f"       stages of {st['config']}: " + ", ".join(f"{k_} {v:.4f} ms" for k_, v in st["ms"].items())
                  + f"; up {st['up_gbps']:.0f} GB/s, down {st['down_gbps']:.0f} GB/s of weights", flush=True)

    # 3. today's path (packed weights dequantised on every call), where it fits
    if today_tokens:
        experts = todays_experts(w, E, k, h, inter)
        for (routing, n), row in rows.items():
            if n not in today_tokens or routing != routings[0]:
                continue
            x, ids, weights = inputs(n, routing, n)
            try:
                with torch.inference_mode():
                    row["today_ms"] = slow_timer(lambda: experts(x, ids, weights))
            except torch.cuda.OutOfMemoryError:
                row["today_ms"] = None
                row["today"] = "out of memory"
                torch.cuda.empty_cache()
            print(f"today's path, {n} tokens: {row.get('today_ms') or row.get('today')}", flush=True)
            save()
        del experts

    # 4. the plain-PyTorch peer on resident bf16 weights
    if not args.no_peer:
        grouped = grouped_mm_available(device)
        try:
            wb = dequantized_experts(w, dtype)
        except torch.cuda.OutOfMemoryError:
            wb = None
            print("peer skipped: the bf16 experts do not fit", flush=True)
        for (routing, n), row in rows.items() if wb is not None else []:
            x, ids, weights = inputs(n, routing, n)
            for use_grouped in ([True, False] if grouped else [False]):
                fn = peer_fn(x, wb, ids, weights, use_grouped)
                try:
                    if (args.check or dry) and n in check_tokens and routing == routings[0]:
                        row["peer_rel_rms"] = rel_rms(fn(), reference(x, w, ids, weights))
                    row["peer_ms"], row["peer_timing"] = fast_time(fn, n) if use_grouped else (timer(fn), "eager")
                except Exception as e:  # e.g. _grouped_mm refusing a shape: the torch.mm loop instead
                    print(f"peer ({'_grouped_mm' if use_grouped else 'mm loop'}) at {n} tokens failed: "
                          f"{type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                row["peer"] = "torch._grouped_mm" if use_grouped else "torch.mm loop"
                row["kernel_over_peer"] = row["kernel_ms"] / row["peer_ms"]
                break
            save()
        del wb

    samples = clocks.samples(wait=0.5)
    for r in result["rows"]:  # the SM clock and power while the row's kernel and variants were timed
        r["clocks"] = summarize(samples, *r.pop("_span"))
    save()
    print(f"\n{result['device']}, commit {result['commit']}: copy {copy:.0f} GB/s, bf16 matmul {mm:.1f} TFLOP/s; "
          f"MoE {E} x top-{k}, {h} -> {inter}, MXFP4 ({per_expert * E / 1e9:.2f} GB)")
    print("routing tokens  hit  kernel ms  roofline ms  %bytes  TFLOP/s  %matmul    best ms  %bytes(best)  peer ms"
          "  today ms  SM MHz  best variant")
    for r in result["rows"]:
        peer = f"{r['peer_ms']:8.3f}" if r.get("peer_ms") else "       -"
        today = f"{r['today_ms']:9.2f}" if r.get("today_ms") else ("      oom" if r.get("today") else "        -")
        clock = f"{r['clocks']['sm_mhz_mean']:7.0f}" if r.get("clocks") else "      -"
        print(f"{r['routing']:>7} {r['tokens']:>6} {r['experts_hit']:>4} {r['kernel_ms']:10.4f} {r['roofline_ms']:12.4f} "
              f"{100 * r['bytes_roofline_fraction']:7.1f} {r['tflops']:8.1f} {100 * r['matmul_fraction']:8.1f} "
              f"{r['best_ms']:10.4f} {100 * r['best_bytes_roofline_fraction']:13.1f} {peer} {today} {clock}  "
              f"{r['best_variant']}")
    print_variant_table(result["rows"])
    if failed:
        print(f"FAILED checks (not timed): {', '.join(sorted(failed))}")
    return 1 if failed else 0


def print_variant_table(rows: list[dict]):
    """Every timed config's ms per (routing, tokens), then its % of the bytes roofline (decode columns)
    or of the matmul rate (1024 tokens and up); * marks each column's fastest."""
    cols = [(r["routing"], r["tokens"]) for r in rows]
    specs = list(dict.fromkeys(["default"] + [v["variant"] for r in rows for v in r["variants"]]))
    cell = {(r["routing"], r["tokens"], v["variant"]): v for r in rows for v in r["variants"]}
    best = {c: min((v["ms"] for v in rows[i]["variants"]), default=None) for i, c in enumerate(cols)}
    print("\nms (and % bytes roofline up to 256 tokens, % matmul above) per variant; * = fastest")
    print(f"{'variant':<36}" + "".join(f"{r[:4] + ' ' + str(n):>17}" for r, n in cols))
    for spec in specs:
        line = f"{spec:<36}"
        for r, n in cols:
            v = cell.get((r, n, spec))
            if v is None:
                line += f"{'-':>17}"
                continue
            pct = 100 * (v["bytes_roofline_fraction"] if n <= DECODE_MAX_TOKENS else v["matmul_fraction"])
            mark = "*" if v["ms"] == best[(r, n)] else " "
            line += f"{v['ms']:>9.3f}{mark}({pct:4.1f}%)"
        print(line)
    if any("stages_ms" in v for v in cell.values()):
        print("\ngate/up ms / down ms per variant (--stages-each)")
        print(f"{'variant':<36}" + "".join(f"{r[:4] + ' ' + str(n):>17}" for r, n in cols))
        for spec in specs:
            line = f"{spec:<36}"
            for r, n in cols:
                st = (cell.get((r, n, spec)) or {}).get("stages_ms") or {}
                line += f"{st['up']:>8.3f} /{st['down']:>7.3f}" if "up" in st and "down" in st else f"{'-':>17}"
            print(line)


if __name__ == "__main__":
    raise SystemExit(main())
