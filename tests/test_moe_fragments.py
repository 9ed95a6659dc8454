"""The K order of the fragment MoE GEMMs (kimiserve/ops/moe/fragment_order.py) on the CPU, and the sm_90 builds of
their Gluon kernels offline (when Triton is installed). The kernels themselves run against the reference on CUDA in
tests/test_triton_moe.py (`test_fragment_gemms`, `test_wgmma_fragment_gemms`). Also `default_config`'s choice of
them."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import re

import pytest
import torch

from kimiserve.ops.moe import config
from kimiserve.ops.moe.config import GemmTiles, MoEConfig, default_config, hopper_programs_an_sm
from kimiserve.ops.moe.fragment_order import (check_fragment_shapes, fragment_order, from_fragment_order,
                                              mma_position)
from kimiserve.ops.moe.mxfp4_layout import to_shift_layout
from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4


@pytest.fixture
def gluon_importable(monkeypatch):
    """`default_config` as on a CUDA machine whose Triton has Gluon: the fragment GEMMs' modules importable."""
    monkeypatch.setattr(config, "_gluon_kernels", lambda module: True)


def test_default_config_takes_fragments(gluon_importable):
    """The decode regime's default (<= DECODE_MAX_ROWS rows per expert) is the fragment GEMMs with 256-wide K steps
    where those fit: the shift layout, bf16, dims given and multiples of 256 (kimi-demo's 128 x 128 experts keep the
    Triton tiles); swapped on blocks of 8 pairs up to SWAPPED_DECODE_MAX_ROWS, chained with PDL where the device
    runs it."""
    bf16 = torch.bfloat16
    for E, N, swapped in ((896, 1, True), (896, 256, True), (16, 32, False)):  # 0.02, 4.6 and 8 rows an expert
        cfg = default_config(N, 16 if E == 896 else 4, E, bf16, True, "shift", dims=(3584, 3072))
        assert cfg.fragments and (cfg.up.block_n, cfg.up.block_k, cfg.down.block_k) == (64, 256, 256)
        assert (cfg.block_m, cfg.up.swap, cfg.down.swap) == ((8, True, True) if swapped else (16, False, False))
        assert not cfg.dependent_launch
        assert default_config(N, 16 if E == 896 else 4, E, bf16, True, "shift", dims=(3584, 3072),
                              dependent_launch=True) == dataclasses.replace(cfg, dependent_launch=True)
    one_wave = default_config(1, 16, 896, bf16, True, "shift", dims=(3584, 3072), num_sms=132)
    assert one_wave.down.max_registers == 72 and one_wave.up.max_registers is None  # 896 swapped down programs
    several_waves = default_config(64, 16, 896, bf16, True, "shift", dims=(3584, 3072), num_sms=132)
    assert several_waves.down.max_registers is None
    assert not default_config(16, 16, 896, bf16, True, "shift", dims=(384, 256)).fragments
    assert not default_config(16, 2, 16, bf16, True, "shift", dims=(128, 128)).fragments
    assert not default_config(512, 16, 896, bf16, True, "shift", dims=(3584, 3072)).fragments  # 9 rows/expert
    assert not default_config(16, 16, 896, bf16, True, "checkpoint", dims=(3584, 3072)).fragments
    assert not default_config(16, 16, 896, bf16, True, "shift", dims=(160, 256)).fragments
    assert not default_config(16, 16, 896, bf16, True, "shift").fragments  # dims unknown
    assert not default_config(16, 16, 896, torch.float32, True, "shift", dims=(3584, 3072)).fragments
    assert not default_config(1024, 16, 896, bf16, True, "shift", dims=(3584, 3072),
                              dependent_launch=True).dependent_launch  # the prefill GEMMs: no PDL


def test_default_config_takes_wgmma_fragments(gluon_importable):
    """Above WGMMA_MIN_ROWS rows per expert the default is the prefill fragment GEMMs where they fit (shift layout,
    bf16, dims multiples of 256, the measured shapes): 128-row blocks; below 256 rows on 16 warps with 32-token
    tails, 3 stages; from 256 rows on 8 warps with 64-token tails, 4 stages for the down GEMM."""
    bf16 = torch.bfloat16
    for N in (1024, 8192):  # 18 and 146 rows an expert
        cfg = default_config(N, 16, 896, bf16, True, "shift", dims=(3584, 3072))
        assert cfg.fragments and (cfg.block_m, cfg.up.num_stages, cfg.down.num_stages) == (128, 3, 3)
        assert (cfg.up.num_warps, cfg.down.num_warps) == (16, 16)
        assert [t.block_m for t in cfg.wgmma_tails] == [64, 32] and cfg.wgmma_tails[1].max_registers == 128
    cfg = default_config(8192, 4, 16, bf16, True, "shift", dims=(3584, 3072))
    assert cfg.fragments and (cfg.block_m, cfg.up.num_stages, cfg.down.num_stages) == (128, 3, 4)
    assert (cfg.up.num_warps, cfg.wgmma_tails) == (8, MoEConfig.wgmma_tails)
    assert default_config(2048, 16, 896, bf16, True, "shift", dims=(512, 768)).fragments
    assert not default_config(2048, 16, 896, bf16, True, "shift", dims=(384, 640)).fragments
    assert not default_config(512, 2, 16, bf16, True, "shift", dims=(128, 128)).fragments  # kimi-demo
    assert default_config(512, 16, 896, bf16, True, "shift", dims=(3584, 3072)).block_m == 32  # 9 rows
    assert not default_config(8192, 16, 896, bf16, True, "checkpoint", dims=(3584, 3072)).fragments
    assert not default_config(8192, 16, 896, bf16, True, "shift", dims=(3584, 3000)).fragments
    assert not default_config(8192, 16, 896, bf16, True, "shift").fragments


@pytest.mark.parametrize("block_k", [128, 256])
def test_order_is_the_documented_permutation(block_k):
    """Physical k = (block_k / 4) t + 4s + 2b1 + b0 of each step sits at 16s + 8b1 + 2t + b0, for K = 3 steps."""
    x = torch.arange(3 * block_k).reshape(1, -1)
    got = fragment_order(x, block_k)[0]
    for step, t, s, b1, b0 in itertools.product(range(3), range(4), range(block_k // 16), range(2), range(2)):
        assert got[block_k * step + 16 * s + 8 * b1 + 2 * t + b0] == block_k * (step + t / 4) + 4 * s + 2 * b1 + b0
    assert torch.equal(mma_position(x[0], block_k).argsort(), got)  # the gate/up kernel's store positions agree
    assert torch.equal(from_fragment_order(fragment_order(x, block_k), block_k), x)


@pytest.mark.parametrize("block_k", [128, 256])
def test_thread_words_are_its_fragments(block_k):
    """The index algebra of gluon_decode._b_fragments: word (g, u) of quad thread t (shift layout, physical k
    (block_k / 4) t + 32g + 8u .. + 7, pair r = codes 2r, 2r + 1) holds MMA positions
    128g + 32u + 16 (r >> 1) + 8 (r & 1) + 2t + b0, i.e. the thread's B fragments (k 2t, 2t + 1 and 2t + 8, 2t + 9
    of a k16 step) of steps 8g + 2u and 8g + 2u + 1; its scale is group (block_k / 128) t + g of the step."""
    gen = torch.Generator().manual_seed(0)
    packed, scales = quantize_mxfp4(torch.randn(5, 2 * block_k, generator=gen))
    words = to_shift_layout(packed, scales)  # the kernel reads these bytes; its decode is checked bit-exact on CUDA
    assert words.shape == packed.shape
    w = dequantize_mxfp4(packed, scales, torch.float32)
    mma = fragment_order(w, block_k)
    G = block_k // 128
    for step, t, g, u, r, b0 in itertools.product(range(2), range(4), range(G), range(4), range(4), range(2)):
        phys = block_k * step + (block_k // 4) * t + 32 * g + 8 * u + 2 * r + b0
        pos = block_k * step + 128 * g + 32 * u + 16 * (r >> 1) + 8 * (r & 1) + 2 * t + b0
        assert torch.equal(mma[:, pos], w[:, phys])
        assert (phys % block_k) // 32 == G * t + g  # the scale group the kernel loads for this word
        s, half = divmod(pos % block_k - 2 * t - b0, 16)
        assert (s >> 1, half) == (4 * g + u, 8 * (r & 1)) and (s & 1) == (r >> 1)


@pytest.mark.parametrize("nw", [8, 16])
def test_wgmma_row_algebra(nw):
    """The row algebra of gluon_prefill's kernel, its reshapes and permutes written in torch: the copies put tile
    row n = 8 NW rep + 8 w + g in lane 4 g + t of warp w; `_a_chunk` makes it wgmma row m = 16 w + 8 rep + g (the
    rows g and g + 8 of warp w's 16-row slab: that thread's); `_m_to_n` takes each accumulator row back to its tile
    row; the gate/up epilogue stores weight column q at its MMA-k position for the down GEMM
    (`fragment_order.mma_position`): on 8 warps from the two tiles' m order, on 16 after the split on rep pairs W
    row q (rep 0) with V row q (rep 1) in one thread."""
    BN = 16 * nw
    n = torch.arange(BN)
    m_rows = n.reshape(2, BN // 64, 4, 8).permute(1, 2, 0, 3).reshape(BN)  # _a_chunk: wgmma row m holds tile row
    for m, row in enumerate(m_rows.tolist()):
        rep, w, g = row // (8 * nw), row % (8 * nw) // 8, row % 8
        assert m == 16 * w + 8 * rep + g
    assert torch.equal(m_rows.reshape(BN // 64, 4, 2, 8).permute(2, 0, 1, 3).reshape(BN), n)  # _m_to_n
    q = torch.arange(128)
    if nw == 8:  # acc (W) and acc2 (V) in m order, tile row = weight column q
        y = m_rows.reshape(2, 4, 2, 2, 2, 2).permute(1, 3, 4, 2, 0, 5).reshape(128)
    else:
        gate, up = m_rows.reshape(nw, 2, 8).permute(0, 2, 1).unbind(-1)
        assert torch.equal(gate.reshape(128), q) and torch.equal(up.reshape(128), q + 128)  # W row q, V row q
        y = gate.reshape(128).reshape(4, 8, 2, 2).permute(1, 2, 0, 3).reshape(128)
    assert torch.equal(y[mma_position(q, 128)], q)  # stored row i holds the column whose MMA-k position is i


@pytest.mark.parametrize("block_k", [128, 256])
def test_sums_are_the_same_sums(block_k):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 512, generator=gen, dtype=torch.float64)
    w = torch.randn(9, 512, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fragment_order(x, block_k) @ fragment_order(w, block_k).T, x @ w.T)


@pytest.mark.parametrize("h,inter,block_m,block_n,warps,block_k,fits", [
    (3584, 3072, 16, 128, 4, 128, True), (3584, 3072, 16, 64, 4, 256, True), (256, 384, 16, 256, 8, 128, True),
    (256, 128, 16, 64, 2, 128, True), (384, 256, 16, 64, 4, 256, False), (160, 256, 16, 128, 4, 128, False),
    (256, 256, 32, 128, 4, 128, False), (256, 256, 16, 128, 4, 64, False), (256, 256, 16, 96, 4, 128, False),
    # the prefill (wgmma) kernels: 128 x 128 tiles on 8 warps, dims multiples of 128
    (3584, 3072, 64, 128, 8, 128, True), (384, 640, 128, 128, 8, 128, True), (384, 200, 64, 128, 8, 128, False),
    (384, 256, 64, 64, 8, 128, False), (384, 256, 64, 128, 4, 128, False), (384, 256, 64, 128, 8, 256, False)])
def test_fragment_shape_checks(h, inter, block_m, block_n, warps, block_k, fits):
    tiles = GemmTiles(block_n=block_n, block_k=block_k, num_warps=warps)
    assert (check_fragment_shapes(h, inter, block_m, tiles, tiles) is None) == fits
    with pytest.raises(ValueError, match="dividing K"):
        fragment_order(torch.zeros(2, 160))
    with pytest.raises(ValueError, match="dividing K"):
        fragment_order(torch.zeros(2, 384), 256)


def test_grouped_gemm_args_are_the_kernels_leading_arguments():
    """`grouped_gemm_args`: the codes as int32 words (strides in words), the scales as bytes or int32, w standing in
    for v in the down GEMM; in the order of both Gluon kernels' leading parameters (checked when Triton imports)."""
    from kimiserve.ops.moe.fragment_order import grouped_gemm_args

    E, N, K, rows = 3, 256, 384, 10
    w = torch.zeros(E, N, K // 2, dtype=torch.uint8)
    ws = torch.zeros(E, N, K // 32, dtype=torch.uint8)
    a, out = torch.zeros(rows, K, dtype=torch.bfloat16), torch.zeros(rows, N, dtype=torch.bfloat16)
    align = tuple(torch.zeros(n, dtype=torch.int32) for n in (64, 4, 4, 1))
    args, gated = grouped_gemm_args(a, w, ws, None, None, out, align, 3, 4.0, None, int32_scales=True)
    names = ["a_ptr", "w_ptr", "ws_ptr", "v_ptr", "vs_ptr", "out_ptr", "sorted_ptr", "bexp_ptr", "brows_ptr",
             "nblk_ptr", "N_OUT", "K", "A_ROW_DIV", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om", "beta",
             "linear_beta"]
    got = dict(zip(names, args, strict=True))
    assert not gated and got["v_ptr"].data_ptr() == w.data_ptr() and got["vs_ptr"].data_ptr() == ws.data_ptr()
    assert got["w_ptr"].dtype == torch.int32 and got["ws_ptr"].dtype == torch.int32
    assert (got["N_OUT"], got["K"], got["A_ROW_DIV"], got["s_am"], got["s_om"]) == (N, K, 3, K, N)
    assert (got["s_we"], got["s_wn"], got["s_se"], got["s_sn"]) == (N * K // 8, K // 8, N * K // 128, K // 128)
    assert (got["beta"], got["linear_beta"]) == (4.0, 1.0)
    args, gated = grouped_gemm_args(a, w, ws, w.clone(), ws.clone(), out, align, 1, 4.0, 25.0, int32_scales=False)
    assert gated and args[2].dtype == torch.uint8 and args[17] == K // 32 and args[20] == 25.0
    if importlib.util.find_spec("triton") is not None:
        from kimiserve.ops.moe import gluon_decode, gluon_prefill

        for kernel in (gluon_decode._fragment_gemm_kernel, gluon_prefill._wgmma_gemm_kernel):
            assert kernel.arg_names[:len(names)] == names


def _sm90_build(module: str, kernel: str, scale_type: str, consts: dict, num_warps: int, div16: list[str],
                out_type: str = "*bf16"):
    """Kernel `kernel` of `kimiserve.ops.moe.<module>` built for sm_90 (Triton's ptxas, offline; skips without
    Triton), asserted spill-free -> (its SASS, the opcodes of its K loop, benchmarks/moe_layer.py's loop_mix)."""
    _benchmark_helpers()
    from moe_layer import _largest_loop, loop_mix
    from sass_report import resource_usage, sass_of

    built = _sm90_compile(module, kernel, scale_type, consts, dict(num_warps=num_warps), div16, out_type)
    assert resource_usage(built)["stack"] == 0
    sass = sass_of(built)
    return sass, _largest_loop(sass), loop_mix


def _benchmark_helpers():
    """Skips without Triton; puts benchmarks/ (sass_report, moe_layer's SASS helpers) on sys.path."""
    pytest.importorskip("triton")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _sm90_compile(module: str, kernel: str, scale_type: str, consts: dict, options: dict, div16: list[str],
                  out_type: str = "*bf16"):
    """The sm_90 build of a kernel of `kimiserve.ops.moe.<module>` with Triton's compile options (skips without
    Triton)."""
    _benchmark_helpers()
    import importlib

    from sass_report import compile_sm90

    types = dict(a_ptr="*bf16", w_ptr="*i32", ws_ptr=scale_type, v_ptr="*i32", vs_ptr=scale_type, out_ptr=out_type,
                 sorted_ptr="*i32", bexp_ptr="*i32", brows_ptr="*i32", nblk_ptr="*i32", N_OUT="i32", K="i32",
                 A_ROW_DIV="i32", s_am="i32", s_we="i64", s_wn="i32", s_se="i64", s_sn="i32", s_om="i32",
                 beta="fp32", linear_beta="fp32", s_ps="i32")
    fn = getattr(importlib.import_module(f"kimiserve.ops.moe.{module}"), kernel)
    types = {n: t for n, t in types.items() if n in fn.arg_names}
    if "SPLIT" in fn.arg_names:  # gluon_decode's split-K, off unless a test sets it
        consts = {"SPLIT": 1, **consts}
    return compile_sm90(fn, types, consts, options, div16)


WGMMA_DIV16 = ["N_OUT", "K", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"]


def test_wgmma_stages_fit_the_shared_memory():
    """The prefill kernels' stages: the exact shared memory of their sm_90 builds (a stage holds the token tile and
    each weight tile's codes and scales: 135168 bytes for 4 stages of gate/up at block_m 64, 200704 for 4 at 128);
    more than an sm_90 program may take is a ValueError's message that says to take fewer."""
    def tiles(stages):
        return GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=stages)

    assert check_fragment_shapes(3584, 3072, 64, tiles(6), tiles(6)) is None
    assert check_fragment_shapes(3584, 3072, 128, tiles(4), tiles(4)) is None
    # the down GEMM runs two weight tiles a program where h is a multiple of 256, one where it is not
    assert "fewer stages" in check_fragment_shapes(3584, 3072, 128, tiles(3), tiles(5))
    assert check_fragment_shapes(3456, 3072, 128, tiles(3), tiles(5)) is None
    assert "fewer stages" in check_fragment_shapes(3584, 3072, 64, tiles(7), tiles(3))
    assert "fewer stages" in check_fragment_shapes(3584, 3072, 128, tiles(5), tiles(4))
    assert ">= 3 stages" in check_fragment_shapes(3584, 3072, 64, tiles(2), tiles(3))
    # 16 warps: two weight tiles as one, so not for a down GEMM of one tile (h not a multiple of 256)
    sixteen = GemmTiles(block_n=128, block_k=128, num_warps=16, num_stages=3)
    assert check_fragment_shapes(3584, 3072, 128, sixteen, sixteen) is None
    assert "take 8 warps" in check_fragment_shapes(3456, 3072, 128, sixteen, sixteen)
    assert check_fragment_shapes(3456, 3072, 128, sixteen, tiles(3)) is None
    assert "8 or 16 warps" in check_fragment_shapes(3584, 3072, 128, dataclasses.replace(sixteen, num_warps=4),
                                                    tiles(3))


@pytest.mark.parametrize("gated", [True, False])
def test_sm90_build_has_no_fragment_moves(gated):
    """The Gluon kernel's sm_90 build (Triton's ptxas, offline): the B operand's layout conversion is trivial
    (the kernel asserts it), no spills, and the K loop has almost no register moves (Triton's own decode GEMM:
    0.89 a weight for gate/up) and two K steps of mma.sync per iteration."""
    consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, BN=128, BK=128, OUT_BK=128, NUM_WARPS=4, PDL=False,
                  SWAP=False, BM=16)
    sass, ops, loop_mix = _sm90_build("gluon_decode", "_fragment_gemm_kernel", "*u8", consts, 4,
                                      ["K", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"])
    weights = 2 * (2 if gated else 1) * 128 * 128 / 128  # per thread: two K steps of one or two weight tiles
    assert sum(op.startswith("HMMA.16816") for op in ops) == 2 * (2 if gated else 1) * 8 * 4
    assert loop_mix(ops)["moves"] / weights < 0.2
    assert len(ops) / weights < 3.2


@pytest.mark.parametrize("gated,paired,block_m,stages", [(True, False, 64, 4), (False, False, 64, 4),
                                                         (False, True, 64, 4), (True, False, 128, 3),
                                                         (False, True, 128, 3)])
def test_sm90_build_of_the_wgmma_kernel(gated, paired, block_m, stages):
    """The prefill kernel's sm_90 build (offline): its A operands' layout conversions are trivial (asserted in the
    kernel), no spills, eight wgmmas (k16) per weight tile and K step taking A from registers (two tiles: gate/up,
    or the down GEMM's two 128-row tiles where paired), and ptxas keeps them asynchronous: the loop's waits leave
    the last chunk's wgmmas in flight (a serialised build waits for 0)."""

    consts = dict(GATED=gated, PAIRED=paired, ACT=1, LINEAR_TANH=True, BM=block_m, STAGES=stages, ALIGN_M=128,
                  MIN_ROWS=1, NW=8)
    sass, ops, loop_mix = _sm90_build("gluon_prefill", "_wgmma_gemm_kernel", "*i32", consts, 8,
                                      ["N_OUT", "K", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"])
    tiles = 2 if gated or paired else 1
    assert sum(op == f"HGMMA.64x{block_m}x16.F32.BF16" for op in ops) == 8 * tiles
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    assert waits.count(hex(tiles)) == 4 and waits.count("0x0") == 1, waits  # in the loop, then the epilogue's
    weights = tiles * 128 * 128 / 256
    assert loop_mix(ops)["moves"] / weights < 0.2  # Triton's decode GEMMs: 0.9 (mma.sync) / 0.04 (wgmma)
    assert len(ops) / weights < 3.6


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("block_m,stages,loop_spills", [(32, 4, 0), (64, 3, 4)])
def test_sm90_build_of_the_capped_tail_tiles(gated, block_m, stages, loop_spills):
    """The capped tail tiles of benchmarks/moe_specs.py's TAILS (`MoEConfig.wgmma_tails`: 32 tokens on 4 stages, 64
    on 3, at 128 registers), built for sm_90 offline as `wgmma_gemm_tails` launches them: two programs' registers
    and shared memory fit an SM, their wgmmas are 64xBMx16, and the K loop spills at most a few words (none at 32
    tokens; uncapped they take 146-172 registers, one program an SM)."""
    _benchmark_helpers()
    from moe_layer import _largest_loop
    from sass_report import resource_usage, sass_of

    consts = dict(GATED=gated, PAIRED=not gated, ACT=1, LINEAR_TANH=True, BM=block_m, STAGES=stages, ALIGN_M=128,
                  MIN_ROWS=1, NW=8)
    cap = 128
    built = _sm90_compile("gluon_prefill", "_wgmma_gemm_kernel", "*i32", consts, dict(num_warps=8, maxnreg=cap),
                          WGMMA_DIV16)
    assert resource_usage(built)["reg"] <= cap and 2 * 8 * 32 * cap <= 65536
    assert 2 * built.metadata.shared <= 228 * 1024  # the H100/H200 SM's shared memory
    ops = _largest_loop(sass_of(built))
    assert sum(op == f"HGMMA.64x{block_m}x16.F32.BF16" for op in ops) == 16
    assert sum(op.startswith(("LDL", "STL")) for op in ops) <= loop_spills


@pytest.mark.parametrize("gated,loop_spills", [(True, 5), (False, 0)])
def test_sm90_build_of_the_16_warp_wgmma_kernel(gated, loop_spills):
    """The prefill kernel on 16 warps (GemmTiles.num_warps 16: W's and V's 128 rows as one 256-row tile on four
    warpgroups), built for sm_90 offline at block_m 128, 3 stages: 128 registers (one program of 512 threads an SM,
    four warps a scheduler against two), the same shared memory as two 128-row tiles on 8 warps, a wgmma of one
    tile per chunk and warpgroup kept asynchronous, and per thread about half the 8-warp loop's decode (HMUL2,
    LOP3) and copies, under 0.7 of its instructions (a program's warps issue 27% more in all, for twice the warps a
    scheduler). The gate/up build spills a few words inside the loop."""

    _benchmark_helpers()
    from moe_layer import _largest_loop
    from sass_report import resource_usage, sass_of

    mix = {}
    for nw in (8, 16):
        consts = dict(GATED=gated, PAIRED=not gated, ACT=1, LINEAR_TANH=True, BM=128, STAGES=3, ALIGN_M=128,
                      MIN_ROWS=1, NW=nw)
        built = _sm90_compile("gluon_prefill", "_wgmma_gemm_kernel", "*i32", consts, dict(num_warps=nw), WGMMA_DIV16)
        sass = sass_of(built)
        ops = _largest_loop(sass)
        mix[nw] = collections.Counter(op.split(".")[0] for op in ops)
        if nw == 16:
            assert resource_usage(built)["reg"] <= 128 and built.metadata.shared == 150528
            assert sum(op == "HGMMA.64x128x16.F32.BF16" for op in ops) == 8
            waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
            assert waits.count("0x1") == 4 and waits.count("0x0") == 1, waits
            assert sum(op.startswith(("LDL", "STL")) for op in ops) <= loop_spills
    for op in ("HMUL2", "LOP3", "LDGSTS", "HGMMA"):  # the decode's shifts: SHF or IMAD.SHL, as ptxas picks
        assert mix[8][op] // 2 <= mix[16][op] <= mix[8][op] // 2 + 2, (op, mix[8][op], mix[16][op])
    assert sum(mix[16].values()) < 0.7 * sum(mix[8].values())  # 249-256 against 393 a thread


def test_decode_down_register_cap_only_where_it_makes_one_wave(monkeypatch):
    """The decode down GEMM is capped at DOWN_CAPPED_REGISTERS only where that turns two waves into one: K3.1 at 1
    token is 16 blocks x 56 column tiles = 896 programs, 5 an SM uncapped, 7 capped."""
    monkeypatch.setattr(config, "_fragments_fit", lambda h, inter: True)  # the Gluon kernels' check (CUDA builds)

    def tiles(tokens, num_sms):
        cfg = config.default_config(tokens, 16, 896, torch.bfloat16, True, "shift", dims=(3584, 3072),
                                    num_sms=num_sms)
        assert cfg.fragments and cfg.up.max_registers is None
        return cfg.down.max_registers

    assert tiles(1, 132) == config.DOWN_CAPPED_REGISTERS  # 660 < 896 <= 924
    assert tiles(1, 180) is None  # one wave of 5 an SM already
    assert tiles(1, 114) is None  # two waves either way
    assert tiles(16, 132) is None  # many waves: the spills cost more than the wave saves
    assert tiles(1, None) is None  # SM count unknown
    assert config.max_blocks(16, 896, 16) == 16 and config.max_blocks(1024, 896, 16) == 904


def test_decode_gate_up_split_where_its_grid_makes_one_to_two_waves(monkeypatch):
    """The swapped decode gate/up GEMM (4 programs an SM) is split along K in two where its grid makes more than one
    wave and under two (the last wave then about as full as the first); at one wave or under, at two or more,
    unswapped, with the SM count unknown or K one step, not. The down GEMM is not split."""
    monkeypatch.setattr(config, "_fragments_fit", lambda h, inter: True)

    def split(tokens, top_k=16, experts=896, num_sms=132, dims=(3584, 3072)):
        cfg = config.default_config(tokens, top_k, experts, torch.bfloat16, True, "shift", dims=dims,
                                    num_sms=num_sms)
        assert cfg.fragments and cfg.down.split_k == 1
        return cfg.up.split_k

    assert split(1) == 2  # 16 blocks x 48 tiles = 768 programs, 528 a wave
    assert split(2) == 1  # 1536: 2.9 waves
    assert split(1, num_sms=None) == 1  # SM count unknown
    assert split(1, num_sms=192) == 1  # 768 = 1 wave of 4 x 192: none to even out
    assert split(1, num_sms=191) == 2
    assert split(1, top_k=4, experts=16) == 1  # the small preset at batch 1: 192 programs, under a wave
    assert split(8, top_k=4, experts=16) == 2  # 18 blocks: 864 programs
    assert split(1, dims=(256, 3072)) == 1  # K = 256: one step
    assert split(24, top_k=4, experts=16, num_sms=130) == 1  # 6 rows an expert: unswapped (1008 programs)


def _sass_ops(sass: str) -> list[str]:
    """The SASS instructions in order, predicates kept (`@!P1 LDG.E.128 ...` -> "@!P1 LDG.E.128")."""

    ops = []
    for line in sass.splitlines():
        if re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            words = line.split("*/", 1)[1].strip().rstrip(" ;").split()
            ops.append(" ".join(words[:2]) if words[0].startswith("@") else words[0])
    return ops


@pytest.mark.parametrize("gated,split", [(True, 1), (False, 1), (True, 2), (False, 3)])
def test_sm90_build_with_dependent_launch(gated, split):
    """The decode fragment kernel with PDL (MoEConfig.dependent_launch, offline sm_90 build): one wait
    (griddepcontrol.wait: ACQBULK) and after it the trigger of the next launch (PREEXIT); before the wait the first
    K step's weights (64 rows x 128 bytes of each weight tile a step: 4 unpredicated 16-byte loads a thread a tile)
    and nothing written; every activation load (predicated on the block's real rows) after it; without PDL neither
    instruction. Split along K (GemmTiles.split_k) the same, and the split's fp32 sums stored unrounded (no F2FP)."""
    consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, BN=64, BK=256, OUT_BK=256, NUM_WARPS=4, PDL=True,
                  SWAP=False, BM=16, SPLIT=split)
    div16 = ["K", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"]
    sass, _, _ = _sm90_build("gluon_decode", "_fragment_gemm_kernel", "*u8", consts, 4, div16,
                             out_type="*fp32" if split > 1 else "*bf16")
    ops = _sass_ops(sass)
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
    wait = ops.index("ACQBULK")
    assert ops.index("PREEXIT") > wait
    before, after = ops[:wait], ops[wait:]
    assert before.count("LDG.E.128") == 4 * (2 if gated else 1)
    assert not any(op.split()[-1].startswith(("STG", "STS", "LDSM", "RED", "ATOM")) for op in before)
    activation = [op for op in after if op.startswith("@") and op.endswith("LDG.E.128")]
    assert len(activation) >= 4 and not any(op.startswith("@") and op.endswith("LDG.E.128") for op in before)
    assert (split > 1) != any(op.startswith("F2FP") for op in ops)
    sass, _, _ = _sm90_build("gluon_decode", "_fragment_gemm_kernel", "*u8", dict(consts, PDL=False), 4, div16,
                             out_type="*fp32" if split > 1 else "*bf16")
    assert not {"ACQBULK", "PREEXIT"} & set(_sass_ops(sass))


def test_sm90_builds_of_the_chain_wait_before_reading_what_the_last_launch_wrote():
    """The chain's Triton kernels with PDL (offline sm_90 builds): the align and the combine wait before any load;
    x's MMA-k copy loads x (the MoE's input) first and waits before its store; the split gate/up's reduce triggers
    the next launch, then waits, and loads and stores nothing before."""
    _benchmark_helpers()
    import triton.language as tl
    from sass_report import compile_sm90, sass_of

    from kimiserve.ops.moe import align, epilogue, mma_order

    def build(fn, types, consts):
        types = {n: types.get(n, "i32") for n in fn.arg_names if n not in consts}
        return _sass_ops(sass_of(compile_sm90(fn, types, consts, dict(num_warps=4, launch_pdl=True), [])))

    ints = {n: "*i32" for n in ("ids_ptr", "sorted_ptr", "bexp_ptr", "brows_ptr", "nblk_ptr")}
    chain = [
        (build(align._align_few_kernel, ints, dict(BM=16, PB=16, PDL=True)), "align"),
        (build(epilogue._combine_kernel, dict(y_ptr="*bf16", w_ptr="*fp32", out_ptr="*bf16"),
               dict(TOP_K=4, BH=512, SPLIT=1, DTYPE=tl.bfloat16, PDL=True)), "combine"),
    ]
    for ops, name in chain:
        loads = [i for i, op in enumerate(ops) if "LDG" in op]
        assert ops.count("ACQBULK") == 1 and loads and ops.index("ACQBULK") < loads[0], name
    ops = build(mma_order._mma_order_kernel, dict(x_ptr="*bf16", out_ptr="*bf16"), dict(BK=256, CH=2048, PDL=True))
    wait = ops.index("ACQBULK")
    assert any("LDG" in op for op in ops[:wait]) and not any("STG" in op for op in ops[:wait])
    assert any("STG" in op for op in ops[wait:])
    reduce = build(epilogue._reduce_act_kernel, dict(part_ptr="*fp32", out_ptr="*bf16", beta="fp32",
                                                     linear_beta="fp32"),
                   dict(SPLIT=2, ACT=1, LINEAR_TANH=True, DTYPE=tl.bfloat16, BR=1024, OUT_BK=256, PDL=True))
    wait = reduce.index("ACQBULK")  # the split gate/up's reduce lets the down GEMM launch, then waits, then loads
    assert reduce.index("PREEXIT") < wait and not any("LDG" in op or "STG" in op for op in reduce[:wait])


def test_decode_chain_options_are_checked():
    """MoEConfig.dependent_launch on the CPU (or under the interpreter) is a ValueError that says to leave it off;
    wgmma_tails off the wgmma GEMMs, a ValueError that says what they take."""
    pytest.importorskip("triton")
    import dataclasses

    from kimiserve.ops.moe import triton as tt

    gen = torch.Generator().manual_seed(0)
    E, h, inter = 3, 64, 32
    w1, w3 = torch.randn(E, inter, h, generator=gen), torch.randn(E, inter, h, generator=gen)
    w2 = torch.randn(E, h, inter, generator=gen)
    x, ids, weights = torch.randn(2, h, generator=gen), torch.tensor([[0, 1], [2, 0]]), torch.rand(2, 2)
    config = dataclasses.replace(tt.default_config(2, 2, E, torch.float32, False), dependent_launch=True)
    with pytest.raises(ValueError, match="dependent_launch.*leave it off"):
        tt.fused_moe(x, w1, w2, w3, ids, weights, config=config)
    config = dataclasses.replace(tt.default_config(2, 2, E, torch.float32, False),
                                 wgmma_tails=(tt.WgmmaTail(), tt.WgmmaTail(32)))  # off the wgmma GEMMs
    with pytest.raises(ValueError, match="wgmma_tails applies to the wgmma fragment GEMMs on 128-row blocks"):
        tt.fused_moe(x, w1, w2, w3, ids, weights, config=config)


def test_wgmma_tails_are_checked():
    """MoEConfig.wgmma_tails that the tail launches cannot run: a message that says what they take (CPU: the
    check behind fused_moe's ValueError)."""
    from kimiserve.ops.moe.config import GemmTiles, WgmmaTail
    from kimiserve.ops.moe.fragment_order import check_fragment_shapes

    tiles = GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3)

    def why(*tails):
        return check_fragment_shapes(3584, 3072, 128, tiles, tiles, tails)

    assert why(WgmmaTail()) is None and why(WgmmaTail(), WgmmaTail(32, 4, 128)) is None
    assert why(WgmmaTail(32)) is None and why(WgmmaTail(64, 3, 128)) is None
    for bad in ((), (WgmmaTail(32), WgmmaTail(64)), (WgmmaTail(16),), (WgmmaTail(), WgmmaTail()),
                (WgmmaTail(128),)):
        assert "tiles of (64, 32) tokens, largest first" in why(*bad)
    assert ">= 3 stages" in why(WgmmaTail(64, 2))
    assert "max_registers None or 24..255" in why(WgmmaTail(64, 4, 300))
    assert "8 or 16 warps" in why(WgmmaTail(64, 4, None, 4)) and why(WgmmaTail(64, 4, None, 16)) is None
    assert "take 8 warps" in check_fragment_shapes(3456, 3072, 128, tiles, tiles, (WgmmaTail(64, 4, None, 16),))
    assert "take fewer stages" in why(WgmmaTail(64, 7))
    assert check_fragment_shapes(3584, 3072, 64, tiles, tiles, ()) is None  # 64-row blocks have no tails


def test_sass_report_lists_each_wgmma_launch(capsys):
    """`benchmarks/moe_layer.py --sass` on a wgmma spec builds each launch as fused_moe runs it: the main launches on
    their warps and register cap, then each tail launch (`gemm/BM`) on its own (here the t32 tails: 32-token tiles at
    128 registers)."""
    _benchmark_helpers()
    from moe_layer import sass_report

    assert sass_report(["shift-m128-n128-k128-w16-s3-t32-frag"], 3584, 3072) == 0
    rows = {line.split()[1]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"up", "up/64", "up/32", "down", "down/64", "down/32"}
    assert int(rows["up"][2]) <= 128 and int(rows["down"][2]) <= 128  # 16 warps
    assert int(rows["up/32"][2]) == 128 and int(rows["up/64"][2]) > 128  # the capped 32-token tail; the 64 uncapped
    assert all(row[-1].startswith("HGMMA.64x") for row in rows.values())


def test_wgmma_gemm_refuses_sixteen_warps_on_one_tile():
    """`gluon_prefill.wgmma_gemm` (public) checks its warps itself: 16 warps need a program's two weight tiles, so a
    down GEMM of one tile (N not a multiple of 256) on 16 warps is a ValueError that says to take 8 warps, before
    anything is launched."""
    pytest.importorskip("triton")
    from kimiserve.ops.moe import gluon_prefill

    w = torch.zeros(2, 384, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8 warps, or 16 where a program has two weight tiles"):
        gluon_prefill.wgmma_gemm(None, w, None, None, None, None, None, 1, 64, "silu", 1.0, None, num_warps=16)
    with pytest.raises(ValueError, match="got 4 warps"):
        gluon_prefill.wgmma_gemm(None, w, None, None, None, None, None, 1, 64, "silu", 1.0, None, num_warps=4)


@pytest.mark.parametrize("warps", [2, 4, 8])
def test_swapped_row_algebra(warps):
    """The swapped decode form's rows (`gluon_decode._a_fragments` and its epilogue, in torch): the loads put weight
    row n = (BN / 2) rep + 8 w + g in lane 4 g + t of warp w; the A operand's row m = 16 w + 8 rep + g (rows g and
    g + 8 of warp w's 16-row slab, that thread's) holds it, and the epilogue's column of row m is n again."""
    BN = 16 * warps
    n = torch.arange(BN)
    m_rows = n.reshape(2, BN // 16, 8).permute(1, 0, 2).reshape(BN)  # A row m holds weight row m_rows[m]
    for m, row in enumerate(m_rows.tolist()):
        rep, w, g = row // (BN // 2), row % (BN // 2) // 8, row % 8
        assert m == 16 * w + 8 * rep + g
    m = torch.arange(BN)
    assert torch.equal((m // 16) * 8 + m % 8 + (m // 8 % 2) * (BN // 2), m_rows)  # the epilogue's cols


def test_swapped_fragment_shape_checks():
    """Swapped decode tiles (GemmTiles.swap with the fragment GEMMs): 16 weight rows a warp, both GEMMs, blocks of 8
    or 16 pairs; block_m 8 only swapped."""
    def tiles(block_n=64, warps=4, swap=True):
        return GemmTiles(block_n=block_n, block_k=256, num_warps=warps, swap=swap)

    for block_m in (8, 16):
        assert check_fragment_shapes(3584, 3072, block_m, tiles(), tiles()) is None
    assert check_fragment_shapes(3584, 3072, 8, tiles(128, 8), tiles(32, 2)) is None
    assert "block_n = 16 x num_warps" in check_fragment_shapes(3584, 3072, 8, tiles(128, 4), tiles())
    assert "both GEMMs' operands or neither" in check_fragment_shapes(3584, 3072, 16, tiles(), tiles(swap=False))
    assert "8 with swapped tiles" in check_fragment_shapes(3584, 3072, 8, tiles(swap=False), tiles(swap=False))
    assert "8 with swapped tiles" in check_fragment_shapes(3584, 3072, 32, tiles(), tiles())
    split = dataclasses.replace(tiles(), split_k=14)  # K = 3584: 14 steps of 256
    assert check_fragment_shapes(3584, 3072, 8, split, dataclasses.replace(tiles(), split_k=12)) is None
    assert "take at most that many" in check_fragment_shapes(3584, 3072, 8, dataclasses.replace(split, split_k=15),
                                                             tiles())
    assert "12 steps of 256" in check_fragment_shapes(3584, 3072, 8, tiles(), dataclasses.replace(split, split_k=13))


@pytest.mark.parametrize("gated", [True, False])
def test_sm90_build_of_the_swapped_decode_kernel(gated):
    """The decode fragment GEMM with swapped operands (weights as mma.sync's A, 16 rows a warp, 8 pairs as N), built
    for sm_90 offline at the default's tiles (64 rows x 256-wide steps, 4 warps): half the HMMAs and activation
    fragment loads (LDSM) of the unswapped build, fewer instructions a loop (1182 / 616 against 1285 / 690), and
    for gate/up at most 128 registers: four programs an SM against three."""
    _benchmark_helpers()
    from moe_layer import _largest_loop
    from sass_report import resource_usage, sass_of

    div16 = ["K", "s_am", "s_we", "s_wn", "s_se", "s_sn", "s_om"]
    mix, regs = {}, {}
    for swap, block_m in ((False, 16), (True, 8)):
        consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, BN=64, BK=256, OUT_BK=256, NUM_WARPS=4, PDL=False,
                      SWAP=swap, BM=block_m)
        built = _sm90_compile("gluon_decode", "_fragment_gemm_kernel", "*u8", consts, dict(num_warps=4), div16)
        usage = resource_usage(built)
        assert usage["stack"] == 0
        mix[swap] = collections.Counter(op.split(".")[0] for op in _largest_loop(sass_of(built)))
        regs[swap] = usage["reg"]
        if swap:
            per_sm = hopper_programs_an_sm(usage["reg"], 4, built.metadata.shared)
            assert per_sm == (config.UP_PROGRAMS_AN_SM if gated else config.DOWN_PROGRAMS_AN_SM), (usage, per_sm)
    for op in ("HMMA", "LDSM"):
        assert 2 * mix[True][op] == mix[False][op], (op, mix[False][op], mix[True][op])
    assert sum(mix[True].values()) < 0.93 * sum(mix[False].values())
    if gated:
        assert regs[True] <= 128 < regs[False]
    # capped as default_config caps the down GEMM (and as the one-wave gate/up candidate of DEVICE_PLAN, 80: at 84
    # or 88 it would still be 5 an SM, 660 slots for K3.1's 768 programs at 1 token)
    cap, want = (80, 6) if gated else (config.DOWN_CAPPED_REGISTERS, config.DOWN_CAPPED_PROGRAMS_AN_SM)
    consts = dict(GATED=gated, ACT=1, LINEAR_TANH=True, BN=64, BK=256, OUT_BK=256, NUM_WARPS=4, PDL=False, SWAP=True,
                  BM=8)
    built = _sm90_compile("gluon_decode", "_fragment_gemm_kernel", "*u8", consts, dict(num_warps=4, maxnreg=cap),
                          div16)
    assert hopper_programs_an_sm(resource_usage(built)["reg"], 4, built.metadata.shared) == want


@pytest.mark.parametrize("registers,warps,shared_kb,programs", [
    (126, 4, 8, 4), (128, 4, 8, 4), (96, 4, 8, 5), (88, 4, 8, 5), (84, 4, 8, 5), (81, 4, 8, 5), (80, 4, 8, 6),
    (72, 4, 8, 7), (128, 8, 147, 1), (128, 16, 147, 1), (40, 1, 0, 32), (64, 4, 100, 2), (255, 4, 0, 2)])
def test_hopper_programs_an_sm(registers, warps, shared_kb, programs):
    """Occupancy by registers (a warp's share in units of 256), warps, programs and shared memory (1 KB reserved a
    program), as the CUDA occupancy calculator counts it for compute capability 9.0."""
    assert hopper_programs_an_sm(registers, warps, shared_kb * 1024) == programs


def test_hopper_programs_an_sm_refuses_nonsense():
    with pytest.raises(ValueError, match="registers and num_warps must be >= 1"):
        hopper_programs_an_sm(0, 4)
