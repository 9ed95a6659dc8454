"""The Triton fused MoE (kimiserve/ops/moe/triton.py) against the references, on CUDA.

Random inputs at awkward sizes (expert and token counts that are not multiples of the block,
experts that get no token, every token on the same experts, one token on all its experts, k = 1),
MXFP4 and bf16 weights, SiTU and SiLU, every dequantisation and both MMA orientations; the real
shapes (Kimi-K3.1: 896 experts, top-16, 3584 -> 3072; the `small` preset: 16 experts, top-4;
Kimi-Linear: 256 experts, top-8, 2304 -> 1024, bf16, SiLU); CUDA-graph capture; the tiny engine
with the kernel against the full forward through the torch expert forms. Outputs and the
kernels' workspace are NaN before each run, so a row no kernel writes fails. Accuracy: relative
RMS error of the whole output against `fused_moe_reference` (the same math with cuBLAS matmuls):
fp32 1e-5, bf16 1e-2 (both round gate, up, act and each expert's output to bf16; the accumulation
orders differ).

The helpers are shared with tests/test_triton_moe_interpret.py (the same checks, tiny, on the CPU).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_rms
from kimiserve.ops.activation.reference import silu_and_mul, situ_and_mul
from kimiserve.ops.moe.reference import fused_moe_reference
from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4

pytestmark = pytest.mark.gpu

ROUTINGS = ("random", "subset", "same", "zipf")


def route_ids(N: int, E: int, k: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """[N, k] distinct experts per token. random: uniform; subset: only the first max(k, E // 2)
    experts (the rest get no token); same: every token on the same k experts; zipf: skewed,
    expert e drawn with weight 1 / (e + 1) (after a random relabelling)."""
    if routing == "same":
        return torch.randperm(E, generator=gen)[:k].repeat(N, 1)
    pool = max(k, E // 2) if routing == "subset" else E
    probs = torch.ones(N, pool)
    if routing == "zipf":
        probs = (1.0 / torch.arange(1, pool + 1, dtype=torch.float64)).expand(N, pool).contiguous()
    picks = torch.multinomial(probs, k, replacement=False, generator=gen)
    return torch.randperm(E, generator=gen)[picks] if routing == "zipf" else picks


def expert_weights(E: int, h: int, inter: int, mxfp4: bool, dtype: torch.dtype, gen: torch.Generator,
                   scale: float = 2.0) -> dict:
    """Stacked random experts: w1/w3 [E, I, h], w2 [E, h, I] with entries ~ N(0, scale^2 / fan_in),
    quantised to MXFP4 (packed + w*_scale) or cast to dtype."""
    out = {}
    for name, rows, cols in (("w1", inter, h), ("w3", inter, h), ("w2", h, inter)):
        w = torch.randn(E, rows, cols, generator=gen) * (scale / cols**0.5)
        if mxfp4:
            out[name], out[f"{name}_scale"] = quantize_mxfp4(w)
        else:
            out[name] = w.to(dtype)
    return out


def random_packed_experts(E: int, h: int, inter: int, device, seed: int = 0) -> dict:
    """MXFP4 experts drawn directly as bytes (the K3.1 layer is 15.6 GB: no float copy): uniform
    random codes, scale bytes 118..121 (values up to 6 * 2^-6), so gate/up and expert outputs are O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, rows, cols in (("w1", inter, h), ("w3", inter, h), ("w2", h, inter)):
        out[name] = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, device=device, generator=g)
        out[f"{name}_scale"] = torch.randint(118, 122, (E, rows, cols // 32), dtype=torch.uint8, device=device,
                                             generator=g)
    return out


def activation(name: str):
    return silu_and_mul if name == "silu" else (lambda g, u: situ_and_mul(g, u, 4.0, 25.0))


def reference(x, w: dict, ids, weights, act: str) -> torch.Tensor:
    return fused_moe_reference(x, w["w1"], w["w2"], w["w3"], ids, weights, activation(act), w.get("w1_scale"),
                               w.get("w2_scale"), w.get("w3_scale"))


def shift_layout(w: dict) -> dict:
    """The MXFP4 experts with their packed codes in the shift layout (scales as they are)."""
    from kimiserve.ops.moe.mxfp4_layout import to_shift_layout

    return {n: (t if n.endswith("_scale") else to_shift_layout(t, w[f"{n}_scale"])) for n, t in w.items()}


def run_kernel(tt, x, w: dict, ids, weights, act: str, config=None, poison: bool = True):
    """fused_moe with a NaN output and NaN workspace; returns (out, act rows, expert outputs). A
    "shift" config runs on the weights re-laid by `shift_layout`."""
    N, k, inter = x.shape[0], ids.shape[1], w["w1"].shape[1]
    nan = float("nan")
    out = torch.full_like(x, nan)
    workspace = (torch.full((N * k, inter), nan, dtype=x.dtype, device=x.device),
                 torch.full((N * k, x.shape[1]), nan, dtype=x.dtype, device=x.device))
    layout = "shift" if config is not None and config.dequant == "shift" else "checkpoint"
    if layout == "shift":
        w = shift_layout(w)
    got = tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w.get("w1_scale"),
                       w2_scale=w.get("w2_scale"), w3_scale=w.get("w3_scale"), activation=act, out=out,
                       workspace=workspace if poison else None, config=config, mxfp4_layout=layout)
    assert got is out
    return got, workspace


def check_case(tt, N, h, inter, E, k, dtype, mxfp4, act, routing, device, config=None, seed=0, tol=None):
    """One random case through the kernel and the reference: every workspace row written, the output
    finite and within the dtype's bound. Returns the error."""
    gen = torch.Generator().manual_seed(seed)
    w = {n: t.to(device) for n, t in expert_weights(E, h, inter, mxfp4, dtype, gen).items()}
    x = torch.randn(N, h, generator=gen).to(dtype).to(device)
    ids = route_ids(N, E, k, routing, gen).to(device)
    weights = torch.rand(N, k, generator=gen).to(device)
    got, (act_rows, y_rows) = run_kernel(tt, x, w, ids, weights, act, config)
    want = reference(x, w, ids, weights, act)
    err = rel_rms(got, want)
    tol = tol or (1e-5 if dtype == torch.float32 else 1e-2)
    y_written = config is None or config.down.split_k == 1  # split-K down: the combine reduces fp32 partials
    assert torch.isfinite(act_rows).all() and (not y_written or torch.isfinite(y_rows).all()), \
        "a workspace row was not written"
    assert torch.isfinite(got).all() and err < tol, (err, tol)
    return err


def check_align_matches_torch(tt, ids: torch.Tensor, E: int, block_m: int):
    """The Triton align and the torch ops both keep check_align's contract and give the same blocks: each block's
    expert, real rows and the pairs on them."""
    a = check_align(tt, ids, E, block_m, use_triton=True)
    b = check_align(tt, ids, E, block_m, use_triton=False)
    nb = int(a[3][0])
    assert torch.equal(a[1][:nb], b[1][:nb]) and torch.equal(a[2][:nb], b[2][:nb])
    for blk in range(nb):
        rows = slice(blk * block_m, blk * block_m + int(a[2][blk]))
        assert torch.equal(a[0][rows], b[0][rows])


def check_align(tt, ids: torch.Tensor, E: int, block_m: int, use_triton: bool):
    """align_blocks' contract: each pair on exactly one row, blocks of one expert in ascending expert
    order, pairs ascending inside an expert, block_rows real rows per block, the fewest blocks."""
    sorted_pairs, bexp, brows, nblk = (t.cpu() for t in tt.align_blocks(ids, E, block_m, use_triton=use_triton))
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=E)
    nb = int(nblk[0])
    assert nb == int(((counts + block_m - 1) // block_m).sum()) <= bexp.numel()
    assert bexp.numel() == max(1, tt.max_blocks(flat.numel(), E, block_m))
    rows = [sorted_pairs[b * block_m: b * block_m + int(brows[b])] for b in range(nb)]
    assert all(1 <= int(brows[b]) <= block_m for b in range(nb))
    assert torch.equal(torch.sort(torch.cat(rows)).values, torch.arange(flat.numel(), dtype=torch.int32))
    for b in range(nb):
        assert (flat[rows[b].long()] == bexp[b]).all()
    assert (bexp[1:nb] >= bexp[: nb - 1]).all()
    for e in range(E):
        mine = torch.cat([rows[b] for b in range(nb) if bexp[b] == e] or [torch.empty(0, dtype=torch.int32)])
        assert (mine[1:] > mine[:-1]).all()
        full = [int(brows[b]) for b in range(nb) if bexp[b] == e]
        assert all(r == block_m for r in full[:-1])  # only an expert's last block is partial
    return sorted_pairs, bexp, brows, nblk


@pytest.fixture(scope="module")
def tt():
    from kimiserve.ops.moe import triton as tt
    return tt


# ------------------------------------------------------------------------------------------------
# small, awkward sizes (the interpreter's cases, on the GPU)

SMALL_CASES = [  # N, h, I, E, k
    (5, 64, 32, 5, 2),
    (37, 96, 64, 9, 3),
    (1, 64, 96, 3, 3),  # one token on all of its k experts
    (19, 64, 32, 7, 1),  # k = 1
    (133, 128, 96, 6, 2),
]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype,mxfp4,act", [(torch.float32, True, "situ"), (torch.bfloat16, True, "situ"),
                                             (torch.bfloat16, False, "silu"), (torch.float32, False, "silu")])
def test_small_cases(tt, case, routing, dtype, mxfp4, act):
    check_case(tt, *case, dtype, mxfp4, act, routing, "cuda")


VARIANTS = {  # bf16 MXFP4: each dequantisation, both orientations, tails in N and K
    "lut": dict(dequant="lut"),
    "lut swap": dict(dequant="lut", swap=True),
    "exact": dict(dequant="exact"),
    "exact swap": dict(dequant="exact", swap=True),
    "dot_scaled": dict(dequant="dot_scaled"),
    "dot_scaled swap": dict(dequant="dot_scaled", swap=True),
    "shift": dict(dequant="shift"),
    "shift swap": dict(dequant="shift", swap=True),
}


def variant_config(tt, dequant: str, swap: bool = False, block_m: int = 16, block_n: int = 64, block_k: int = 64):
    tiles = tt.GemmTiles(block_n=block_n, block_k=block_k, num_warps=4, num_stages=2, swap=swap)
    return tt.MoEConfig(block_m=block_m, up=tiles, down=tiles, dequant=dequant)


@pytest.mark.parametrize("variant,block_m", [(v, 16) for v in VARIANTS] + [("lut", 64), ("lut swap", 64),
                                                                           ("shift", 64), ("shift", 32)])
def test_dequant_variants(tt, variant, block_m):
    """h = 96 and I = 160 leave partial 64-wide K steps and column tiles."""
    cfg = variant_config(tt, block_m=block_m, **VARIANTS[variant])
    check_case(tt, 45, 96, 160, 7, 3, torch.bfloat16, True, "situ", "subset", "cuda", cfg)


SPLIT_CASES = [  # dequant, swap, block_k, split_k (gate/up), split_k (down): h = 96, I = 160
    ("shift", False, 32, 2, 3),  # 3 and 5 K steps: uneven slices (2 + 1; 2 + 2 + 1)
    ("shift", True, 32, 4, 1),
    ("shift", False, 64, 1, 4),  # down: 3 K steps (a K tail) over 4 slices, the last past K stores zeros
    ("lut", False, 32, 3, 2),
    ("exact", True, 64, 2, 2),
]


def split_config(tt, dequant: str, swap: bool, block_k: int, split_up: int, split_down: int, block_m: int = 16):
    up = tt.GemmTiles(block_n=64, block_k=block_k, num_warps=4, num_stages=2, swap=swap, split_k=split_up)
    down = tt.GemmTiles(block_n=64, block_k=block_k, num_warps=4, num_stages=2, swap=swap, split_k=split_down)
    return tt.MoEConfig(block_m=block_m, up=up, down=down, dequant=dequant)


SPLIT_BATCHES = ((45, "subset"), (1, "random"), (7, "same"))  # experts with no token; one token on its k


@pytest.mark.parametrize("dequant,swap,block_k,split_up,split_down", SPLIT_CASES)
def test_split_k(tt, dequant, swap, block_k, split_up, split_down):
    """Split-K gate/up and down (fp32 partials, fixed-order reduces): partial column tiles (I = 160, h = 96
    in 64-wide tiles), padding rows, slices of uneven length and slices past K; bitwise run to run."""
    cfg = split_config(tt, dequant, swap, block_k, split_up, split_down)
    for N, routing in SPLIT_BATCHES:
        check_case(tt, N, 96, 160, 7, 3, torch.bfloat16, True, "situ", routing, "cuda", cfg, seed=N)
    gen = torch.Generator().manual_seed(0)
    w = {n: t.cuda() for n, t in expert_weights(7, 96, 160, True, torch.bfloat16, gen).items()}
    x = torch.randn(9, 96, generator=gen).bfloat16().cuda()
    ids = route_ids(9, 7, 3, "random", gen).cuda()
    weights = torch.rand(9, 3, generator=gen).cuda()
    a, _ = run_kernel(tt, x, w, ids, weights, "situ", cfg)
    b, _ = run_kernel(tt, x, w, ids, weights, "situ", cfg)
    assert torch.equal(a, b)


CLAMPED_CASES = [  # dequant, swap, block_m, block_n, block_k: whole K steps (no K mask) with tail column tiles
    ("shift", False, 16, 64, 32), ("shift", True, 16, 64, 32), ("shift", False, 32, 64, 32),
    ("shift", True, 32, 64, 32), ("shift", False, 64, 128, 32),
]


@pytest.mark.parametrize("layout", ["shift", "checkpoint"])
def test_default_decode_config_of_many_experts(tt, layout):
    """The decode default of 64+ experts (16 x 128 x 128 tiles, session 13) at awkward sizes: h = 160 leaves a
    32-wide K tail in the gate/up GEMM and a partial column tile in the down GEMM, I = 256 the reverse; 64 experts,
    most with no token at 1-5 tokens, one token on its 4 experts, every token on the same 4."""
    for N, routing in ((5, "random"), (1, "random"), (3, "same"), (40, "zipf")):
        cfg = tt.default_config(N, 4, 64, torch.bfloat16, True, layout)
        assert (cfg.block_m, cfg.up.block_n, cfg.up.block_k) == (16, 128, 128)
        check_case(tt, N, 160, 256, 64, 4, torch.bfloat16, True, "situ", routing, "cuda", cfg, seed=N)


@pytest.mark.parametrize("dequant,swap,block_m,block_n,block_k", CLAMPED_CASES)
def test_shift_clamped_rows(tt, dequant, swap, block_m, block_n, block_k):
    """The shift path loads without row masks (weight rows clamped to the last row, padding rows reading
    pair 0's row): h = 96 and I = 160 in 32-wide K steps leave every K step whole but the last column tile
    of both GEMMs partial, and the few rows per expert leave padding rows in every block."""
    cfg = variant_config(tt, dequant, swap, block_m, block_n, block_k)
    for N, routing in ((45, "subset"), (3, "same"), (1, "random")):
        check_case(tt, N, 96, 160, 7, 3, torch.bfloat16, True, "situ", routing, "cuda", cfg, seed=N)


FRAGMENT_TILES = [  # block_n, num_warps, block_k of gate/up, of down
    (128, 4, 128, 128), (256, 8, 128, 128), (64, 2, 256, 256), (64, 4, 256, 128), (32, 2, 128, 256)]


SWAPPED_TILES = [  # block_n (16 a warp), num_warps, block_k of gate/up, of down, block_m
    (64, 4, 256, 256, 8), (64, 4, 128, 256, 16), (32, 2, 256, 128, 8), (128, 8, 128, 128, 8)]


def fragment_config(tt, block_n: int = 128, warps: int = 4, block_k: int = 128, down_block_k: int = 128,
                    block_m: int = 16, swap: bool = False):
    up = tt.GemmTiles(block_n=block_n, block_k=block_k, num_warps=warps, swap=swap)
    down = tt.GemmTiles(block_n=block_n, block_k=down_block_k, num_warps=warps, swap=swap)
    return tt.MoEConfig(block_m=block_m, up=up, down=down, dequant="shift", fragments=True)


@pytest.mark.parametrize("block_n,warps,block_k,down_block_k", FRAGMENT_TILES)
def test_fragment_gemms(tt, block_n, warps, block_k, down_block_k):
    """The Gluon fragment GEMMs (MoEConfig.fragments, ops.moe.gluon_decode) against the reference. Shapes of 3 and 2
    K steps (the loop's odd tail step; 256-wide tiles on h = 384 leave a partial column tile) and of 1 and 5 steps
    (the tail alone); gate/up and down steps of different widths (the activation stored in the down GEMM's order);
    experts with no token, one token on its k experts, every token on the same k, zipf; SiTU and SiLU;
    NaN-poisoned output and workspace."""
    cfg = fragment_config(tt, block_n, warps, block_k, down_block_k)
    big = max(block_k, down_block_k)
    for h, inter in ((3 * block_k, 2 * big), (block_k, 5 * big)):
        for N, routing, act in ((45, "subset", "situ"), (1, "random", "situ"), (7, "same", "silu"),
                                (33, "zipf", "situ")):
            check_case(tt, N, h, inter, 9, 3, torch.bfloat16, True, act, routing, "cuda", cfg, seed=N)


@pytest.mark.parametrize("block_n,warps,block_k,down_block_k,block_m", SWAPPED_TILES)
def test_swapped_fragment_gemms(tt, block_n, warps, block_k, down_block_k, block_m):
    """The fragment GEMMs with swapped operands (GemmTiles.swap: the weights as mma.sync's A, 16 rows a warp, the
    block's 8 or 16 pairs as N) against the reference, as test_fragment_gemms; 20 tokens on the same k experts fill
    blocks of 8 twice and a third with 4; two runs bitwise equal."""
    cfg = fragment_config(tt, block_n, warps, block_k, down_block_k, block_m, swap=True)
    big = max(block_k, down_block_k)
    for h, inter in ((3 * block_k, 2 * big), (block_k, 5 * big)):
        for N, routing, act in ((45, "subset", "situ"), (1, "random", "situ"), (7, "same", "silu"),
                                (20, "same", "situ"), (33, "zipf", "situ")):
            check_case(tt, N, h, inter, 9, 3, torch.bfloat16, True, act, routing, "cuda", cfg, seed=N)


def test_fragment_gemms_graph_capture(tt):
    """The default fragment config captured in a CUDA graph (its MMA-k copy of x included) replays other routings
    bitwise as eager calls compute them."""
    from kimiserve.utils.cuda_timing import capture_graph

    gen = torch.Generator().manual_seed(3)
    w_checkpoint = {n: t.cuda() for n, t in expert_weights(9, 768, 512, True, torch.bfloat16, gen).items()}
    w = shift_layout(w_checkpoint)
    assert tt.default_config(7, 3, 9, torch.bfloat16, True, "shift", dims=(768, 512)).fragments

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(7, 768, generator=g).bfloat16().cuda(), route_ids(7, 9, 3, "random", g).cuda(),
                torch.rand(7, 3, generator=g).cuda())

    def call(x, ids, weights, out=None):
        return tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                            w3_scale=w["w3_scale"], out=out, mxfp4_layout="shift")

    sx, sids, sw = inputs(0)
    out = torch.empty_like(sx)
    graph = capture_graph(lambda: call(sx, sids, sw, out))
    for seed in (1, 2):
        x, ids, weights = inputs(seed)
        sx.copy_(x), sids.copy_(ids), sw.copy_(weights)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, call(x, ids, weights))
        assert rel_rms(out, reference(x, w_checkpoint, ids, weights, "situ")) < 1e-2



@pytest.mark.parametrize("N,K,block_k", [(1, 3584, 256), (5, 384, 128), (300, 768, 256), (3, 2304, 128)])
def test_mma_order_kernel(N, K, block_k):
    """x's MMA-k copy as a Triton kernel (`ops.moe.mma_order`, with and without PDL) is `fragment_order` bit for
    bit: one program a row (K = 384), two (3584, 2304: partial second chunk)."""
    from kimiserve.ops.moe.fragment_order import fragment_order
    from kimiserve.ops.moe.mma_order import mma_order

    x = torch.randn(N, K + 64, device="cuda").bfloat16()[:, 32:32 + K]  # rows strided, last dim contiguous
    for pdl in (False, True):
        assert torch.equal(mma_order(x, block_k, pdl), fragment_order(x, block_k))


def test_decode_chain_launch_and_split_options(tt):
    """The decode chain launched with PDL (MoEConfig.dependent_launch) and the fragment GEMMs split along K
    (GemmTiles.split_k: gate/up in 2 of its 2 K steps, down in 3 of 3, then 2 of 3, fp32 partials reduced by the
    activation's reduce and by the combine): every size regime of the align (pairwise, one program, chunks), unswapped
    and swapped, against the reference; PDL alone bit for bit the same as without it, a split config bit for bit the
    same run to run; three MoE calls back to back in one CUDA graph (each call's kernels may start before the last
    one's finish) replay other routings as eager calls compute them."""
    import dataclasses

    from kimiserve.utils.cuda_timing import capture_graph

    def split(config, up, down):
        return dataclasses.replace(config, up=dataclasses.replace(config.up, split_k=up),
                                   down=dataclasses.replace(config.down, split_k=down))

    off = fragment_config(tt, 64, 4, 256, 256)
    pdl = dataclasses.replace(off, dependent_launch=True)
    on = split(pdl, 2, 3)
    swapped_on = split(dataclasses.replace(fragment_config(tt, 64, 4, 256, 256, 8, swap=True), dependent_launch=True),
                       2, 2)
    # 1-135 pairs: the pairwise align; 900: one program; 2100: chunks
    for N, routing in ((1, "random"), (7, "same"), (45, "subset"), (300, "zipf"), (700, "random")):
        check_case(tt, N, 512, 768, 9, 3, torch.bfloat16, True, "situ", routing, "cuda", on, seed=N)
    for N, act, config in ((1, "situ", swapped_on), (45, "situ", swapped_on), (45, "silu", split(swapped_on, 2, 1))):
        check_case(tt, N, 512, 768, 9, 3, torch.bfloat16, True, act, "random", "cuda", config, seed=N)
    gen = torch.Generator().manual_seed(5)
    w = shift_layout({n: t.cuda() for n, t in expert_weights(9, 512, 768, True, torch.bfloat16, gen).items()})

    def call(x, ids, weights, config, out=None):
        return tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                            w3_scale=w["w3_scale"], out=out, config=config, mxfp4_layout="shift")

    def inputs(seed, N=5):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(N, 512, generator=g).bfloat16().cuda(), route_ids(N, 9, 3, "random", g).cuda(),
                torch.rand(N, 3, generator=g).cuda())

    for N in (1, 45, 700):
        x, ids, weights = inputs(N, N)
        assert torch.equal(call(x, ids, weights, pdl), call(x, ids, weights, off))
        for config in (on, swapped_on):
            assert torch.equal(call(x, ids, weights, config), call(x, ids, weights, config))
    layers = [inputs(seed) for seed in range(3)]

    def chain():  # each layer's input is the last one's output, as in a model
        h = layers[0][0]
        for _, ids, weights in layers:
            h = call(h, ids, weights, on)
        return h

    graph_out = torch.empty_like(layers[0][0])
    graph = capture_graph(lambda: graph_out.copy_(chain()))
    for seed in (10, 20):
        for layer, new in zip(layers, [inputs(seed + i) for i in range(3)]):
            for buf, value in zip(layer, new):
                buf.copy_(value)
        graph_out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(graph_out, chain())  # the same calls, eager


def test_fragment_config_errors(tt):
    """MoEConfig.fragments outside its scope is a ValueError that says what to change."""
    gen = torch.Generator().manual_seed(0)
    w = shift_layout(expert_weights(4, 160, 256, True, torch.bfloat16, gen))
    ids, weights = torch.tensor([[0, 1]]), torch.rand(1, 2)
    with pytest.raises(ValueError, match="CUDA"):  # a CPU tensor
        tt.fused_moe(torch.randn(1, 160).bfloat16(), w["w1"], w["w2"], w["w3"], ids, weights,
                     w1_scale=w["w1_scale"], w2_scale=w["w2_scale"], w3_scale=w["w3_scale"],
                     config=fragment_config(tt), mxfp4_layout="shift")
    w = {n: t.cuda() for n, t in w.items()}
    with pytest.raises(ValueError, match="dividing their K"):  # h = 160
        tt.fused_moe(torch.randn(1, 160).bfloat16().cuda(), w["w1"], w["w2"], w["w3"], ids.cuda(), weights.cuda(),
                     w1_scale=w["w1_scale"], w2_scale=w["w2_scale"], w3_scale=w["w3_scale"],
                     config=fragment_config(tt), mxfp4_layout="shift")


def wgmma_config(tt, block_m: int = 64, stages: int = 4, down_stages: int | None = None, tails: str = "t64",
                 registers: int | None = None, warps: int = 8, down_warps: int | None = None):
    """tails: a name of benchmarks/moe_specs.py's TAILS (MoEConfig.wgmma_tails); registers: both GEMMs' cap."""
    up = tt.GemmTiles(block_n=128, block_k=128, num_warps=warps, num_stages=stages, max_registers=registers)
    down = tt.GemmTiles(block_n=128, block_k=128, num_warps=down_warps or warps, num_stages=down_stages or stages,
                        max_registers=registers)
    return tt.MoEConfig(block_m=block_m, up=up, down=down, dequant="shift", fragments=True,
                        wgmma_tails=moe_specs().TAILS[tails])


def moe_specs():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import moe_specs

    return moe_specs


@pytest.mark.parametrize("block_m,stages,down_stages,tails,registers,warps", [
    (64, 4, 4, "t64", None, 8), (64, 3, 5, "t64", None, 8), (128, 3, 4, "t64", None, 8),
    (128, 3, 3, "t64", None, 8), (128, 3, 3, "t32", None, 8), (128, 3, 4, "t32r", None, 8),
    (64, 3, 3, "t64", 128, 8), (128, 3, 3, "t64", None, 16), (64, 4, 4, "t64", None, 16),
    (128, 3, 3, "t64w", None, 16)])
def test_wgmma_fragment_gemms(tt, block_m, stages, down_stages, tails, registers, warps):
    """The prefill fragment GEMMs (block_m 64 / 128, ops.moe.gluon_prefill: wgmma with the dequantised weights as
    the register A operand) against the reference. K of 1, 2, 3 and 5 steps (fewer steps than stages in flight:
    the clamped copies past the end), several column tiles; experts with no token, one token on its k experts,
    experts of 100 rows (at block_m 128: one block in the 128-token launch, none in the tail launch), of 190 rows
    (128 + a tail of 62 in the 64-token launch) and of 150 rows (128 + a tail of 22: with the tails t32 / t32r in
    the 32-token launch, capped at 128 registers), zipf; SiTU and SiLU; 64-row blocks capped at 128 registers
    (two programs an SM, GemmTiles.max_registers); 16 warps (gate/up, and the down GEMM at h = 512: the two
    weight tiles as one on four warpgroups);
    NaN-poisoned output and workspace (a row no launch wrote stays NaN). h = 512: the down GEMM's programs
    take two 128-row weight tiles (gluon_prefill.paired_down); 384 and 128: one."""
    for h, inter in ((384, 256), (512, 384), (128, 640)):
        if h % 256 and tails == "t64w":  # the down GEMM's tails would run one tile on 16 warps: an error
            continue
        cfg = wgmma_config(tt, block_m, stages, down_stages, tails, registers, warps, 8 if h % 256 else warps)
        for N, routing, act in ((45, "subset", "situ"), (1, "random", "situ"), (190, "same", "silu"),
                                (100, "same", "situ"), (150, "same", "situ"), (300, "zipf", "situ")):
            check_case(tt, N, h, inter, 9, 3, torch.bfloat16, True, act, routing, "cuda", cfg, seed=N)


def test_wgmma_fragment_config_errors(tt):
    """The prefill fragment GEMMs outside their scope: a ValueError that says what to change."""
    gen = torch.Generator().manual_seed(0)
    w = {n: t.cuda() for n, t in shift_layout(expert_weights(4, 160, 256, True, torch.bfloat16, gen)).items()}
    ids, weights = torch.tensor([[0, 1]]).cuda(), torch.rand(1, 2).cuda()
    x = torch.randn(1, 160).bfloat16().cuda()
    with pytest.raises(ValueError, match="multiples of 128"):  # h = 160
        tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                     w3_scale=w["w3_scale"], config=wgmma_config(tt), mxfp4_layout="shift")
    bad = tt.MoEConfig(block_m=64, up=tt.GemmTiles(block_n=64, block_k=128, num_warps=8, num_stages=4),
                       down=tt.GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=4), dequant="shift",
                       fragments=True)
    w = {n: t.cuda() for n, t in shift_layout(expert_weights(4, 256, 256, True, torch.bfloat16, gen)).items()}
    with pytest.raises(ValueError, match="block_n 128"):
        tt.fused_moe(torch.randn(1, 256).bfloat16().cuda(), w["w1"], w["w2"], w["w3"], ids, weights,
                     w1_scale=w["w1_scale"], w2_scale=w["w2_scale"], w3_scale=w["w3_scale"], config=bad,
                     mxfp4_layout="shift")
    for block_m, tails, match in ((128, (tt.WgmmaTail(32), tt.WgmmaTail(64)), "largest first"),
                                  (64, (tt.WgmmaTail(), tt.WgmmaTail(32)), "128-row blocks")):
        cfg = dataclasses.replace(wgmma_config(tt, block_m, 3), wgmma_tails=tails)
        with pytest.raises(ValueError, match=match):
            tt.fused_moe(torch.randn(1, 256).bfloat16().cuda(), w["w1"], w["w2"], w["w3"], ids, weights,
                         w1_scale=w["w1_scale"], w2_scale=w["w2_scale"], w3_scale=w["w3_scale"], config=cfg,
                         mxfp4_layout="shift")


def dequant_bytes(first_scale: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code byte (256 per row: all code pairs) with every scale byte first_scale..254, one row
    each, and a row of zero codes with scale byte 0 (how quantize_mxfp4 stores an all-zero group)."""
    rows = 255 - first_scale
    codes = torch.cat([torch.arange(256, dtype=torch.uint8).repeat(rows, 1), torch.zeros(1, 256, dtype=torch.uint8)])
    scales = torch.cat([torch.arange(first_scale, 255, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)])
    return codes.to(device), scales[:, None].repeat(1, 16).to(device)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor):
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    assert got.dtype == want.dtype and torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("dequant,dtype", [("exact", torch.float32), ("exact", torch.bfloat16),
                                           ("lut", torch.bfloat16)])
def test_dequantize_weights_bit_exact(tt, dequant, dtype):
    """The in-register dequantisation (for "lut" the real inline PTX) bit for bit as dequantize_mxfp4, for
    every code byte and scale byte. "lut" from scale byte 2: below, its bf16 fma would meet subnormal
    scales or products (2^-127), which quantize_mxfp4 gives only to all-zero groups."""
    codes, scales = dequant_bytes(2 if dequant == "lut" else 1, "cuda")
    assert_bitwise(tt.dequantize_weights(codes, scales, dtype, dequant), dequantize_mxfp4(codes, scales, dtype))


def shift_dequant_bytes(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code byte (all code pairs, 256 per row) with every scale byte 0..128 the shift layout
    takes (products down to bf16 subnormals at scale byte 0), codes in the shift layout."""
    from kimiserve.ops.moe.mxfp4_layout import MAX_SHIFT_SCALE, to_shift_layout

    codes = torch.arange(256, dtype=torch.uint8).repeat(MAX_SHIFT_SCALE + 1, 1)
    scales = torch.arange(0, MAX_SHIFT_SCALE + 1, dtype=torch.uint8)[:, None].repeat(1, 16)
    return codes.to(device), to_shift_layout(codes).to(device), scales.to(device)


def test_shift_dequant_bit_exact(tt):
    """The shift decode (the real inline PTX: rotates, masks, a bf16x2 fma on subnormal inputs) bit for
    bit as dequantize_mxfp4 of the checkpoint codes, every code pair and scale byte 0..128."""
    codes, shifted, scales = shift_dequant_bytes("cuda")
    want = dequantize_mxfp4(codes, scales, torch.bfloat16)
    assert_bitwise(tt.dequantize_weights(shifted, scales, torch.bfloat16, "shift"), want)


# x 16 pairs: the pairwise kernel (1, 7), one program (50), the chunked kernels (200: 4 chunks of 1024)
@pytest.mark.parametrize("num_tokens", [1, 7, 50, 200])
def test_align_on_gpu(tt, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    for E, k, routing in [(896, 16, "random"), (13, 3, "zipf"), (13, 3, "same")]:
        k = min(k, E)
        check_align_matches_torch(tt, route_ids(num_tokens, E, k, routing, gen).cuda(), E, 16)

