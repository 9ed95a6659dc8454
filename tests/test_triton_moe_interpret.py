"""The Triton fused MoE under Triton's CPU interpreter (no GPU needed), at tiny sizes.

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process (the variable turns on
TRITON_INTERPRET before the kernels are defined, which a process that already imported them misses):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_moe_interpret.py -q

The same checks as tests/test_triton_moe.py (its helpers), on CPU tensors: hidden 64-128,
intermediate 32-160, 3-9 experts. The "lut" dequantisation runs its permutes emulated here (no
inline PTX in the interpreter); test_triton_moe.py checks the real PTX bit for bit on the GPU.
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from conftest import rel_rms  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.model import moe as moe_module  # noqa: E402
from kimiserve.model.model import build_model  # noqa: E402
from kimiserve.ops.moe import triton as tt  # noqa: E402
from kimiserve.ops.quant.reference import dequantize_mxfp4  # noqa: E402
from test_triton_moe import (CLAMPED_CASES, ROUTINGS, SMALL_CASES, SPLIT_BATCHES, SPLIT_CASES, VARIANTS,  # noqa: E402
                             assert_bitwise, check_align_matches_torch, check_case, dequant_bytes, route_ids,
                             shift_dequant_bytes, split_config, variant_config)


ALIGN_CASES = [(N, E, k, r, m) for N, E, k in [(1, 3, 3), (5, 5, 2), (37, 9, 3), (19, 7, 1), (8, 896, 16)]
               for r in ROUTINGS for m in (16, 32)]  # up to 128 pairs (ALIGN_FEW_PAIRS): the pairwise kernel


@pytest.mark.parametrize("N,E,k,routing,block_m", ALIGN_CASES + [
    (300, 9, 3, "random", 16), (700, 9, 3, "zipf", 16), (1400, 9, 3, "random", 32), (3000, 9, 3, "zipf", 16),
    (1500, 7, 3, "same", 64), (2100, 300, 4, "random", 128)])
def test_align_blocks(N, E, k, routing, block_m):
    """The pairwise kernel (up to ALIGN_FEW_PAIRS = 128 pairs; 8 tokens x 16 of 896 experts), the one-program
    kernel (up to ALIGN_SMALL_PAIRS = 1024 pairs: 300 x 3), the chunked kernels above (700 x 3: 3 chunks, the last
    partial; 3000 x 3: 9; every pair on 3 experts; 300 experts, 128-row blocks) and the torch ops give the same
    blocks."""
    check_align_matches_torch(tt, route_ids(N, E, k, routing, torch.Generator().manual_seed(N)), E, block_m)


@pytest.mark.parametrize("N,E,k,routing,block_m", [(300, 9, 3, "zipf", 16), (100, 5, 2, "same", 32),
                                                   (250, 40, 4, "random", 64)])
def test_align_chunks_of_64_pairs(monkeypatch, N, E, k, routing, block_m):
    """The chunked kernels with 64-pair chunks (ALIGN_SMALL_PAIRS patched, as moe_layer.py --align-pairs does):
    4-16 chunks, most experts split across chunks, the same blocks as the torch ops."""
    from kimiserve.ops.moe import align

    monkeypatch.setattr(align, "ALIGN_SMALL_PAIRS", 64)
    check_align_matches_torch(tt, route_ids(N, E, k, routing, torch.Generator().manual_seed(N)), E, block_m)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2^127 is inf, as in the reference
@pytest.mark.parametrize("dequant,dtype", [("exact", torch.float32), ("exact", torch.bfloat16),
                                           ("lut", torch.bfloat16)])
def test_dequantize_weights_bit_exact(dequant, dtype):
    """Every code byte with every scale byte 1..254 (and 0 on zero codes), bit for bit as dequantize_mxfp4
    (the emulated "lut" multiplies in fp32: exact down to scale byte 1 here)."""
    codes, scales = dequant_bytes(1, "cpu")
    assert_bitwise(tt.dequantize_weights(codes, scales, dtype, dequant), dequantize_mxfp4(codes, scales, dtype))


def test_shift_dequant_bit_exact():
    """The emulated shift decode (the PTX's rotates and masks in plain ops) of the shift layout, bit for bit
    as dequantize_mxfp4 of the checkpoint codes: every code pair, every scale byte 0..128."""
    codes, shifted, scales = shift_dequant_bytes("cpu")
    want = dequantize_mxfp4(codes, scales, torch.bfloat16)
    assert_bitwise(tt.dequantize_weights(shifted, scales, torch.bfloat16, "shift"), want)


def test_shift_layout_argument_checks():
    """The layout and the dequantisation must match (the layout itself: tests/test_mxfp4_layout.py)."""
    packed = torch.randint(0, 256, (3, 32, 16), dtype=torch.uint8)
    scale = torch.full((3, 32, 1), 120, dtype=torch.uint8)
    args = (torch.randn(2, 32).bfloat16(), packed, packed, packed, torch.tensor([[0, 1], [2, 0]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match="shift layout"):  # the shift layout with the checkpoint's dequant
        tt.fused_moe(*args, w1_scale=scale, w2_scale=scale, w3_scale=scale, mxfp4_layout="shift",
                     config=tt.default_config(2, 2, 3, torch.bfloat16, True))
    with pytest.raises(ValueError, match="mxfp4_layout"):
        tt.fused_moe(*args, w1_scale=scale, w2_scale=scale, w3_scale=scale, mxfp4_layout="marlin")


@pytest.mark.parametrize("case", SMALL_CASES[:4], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype,mxfp4,act,routing", [
    (torch.float32, True, "situ", "random"), (torch.float32, False, "silu", "subset"),
    (torch.bfloat16, True, "situ", "same"), (torch.bfloat16, False, "silu", "zipf"),
    (torch.bfloat16, True, "silu", "subset"),
])
def test_fused_moe_matches_reference(case, dtype, mxfp4, act, routing):
    """Awkward sizes (see SMALL_CASES) through the default config for the dtype, NaN-poisoned."""
    check_case(tt, *case, dtype, mxfp4, act, routing, "cpu")


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequant_variants(variant):
    """bf16 MXFP4 through each dequantisation and orientation; h = 96 and I = 160 leave partial 64-wide K
    steps and column tiles; 32-row blocks. Triton 3.6's interpreter cannot run `tl.dot_scaled` (an
    AttributeError inside its semantic layer): those variants are checked on the GPU only
    (tests/test_triton_moe.py, which the H200 passes)."""
    if variant.startswith("dot_scaled"):
        pytest.skip("Triton 3.6's interpreter does not run tl.dot_scaled; tests/test_triton_moe.py checks it on a GPU")
    cfg = variant_config(tt, block_m=32, **VARIANTS[variant])
    check_case(tt, 45, 96, 160, 7, 3, torch.bfloat16, True, "situ", "subset", "cpu", cfg)


def test_default_decode_config_of_many_experts():
    """The decode default of 64+ experts (shift, 16 x 128 x 128 tiles) on the CPU: h = 160 leaves a 32-wide K tail
    in the gate/up GEMM and a partial column tile in the down GEMM, I = 256 the reverse; most of the 64 experts get
    no token, one token sits on its 4 experts."""
    cfg = tt.default_config(3, 4, 64, torch.bfloat16, True, "shift")
    assert (cfg.dequant, cfg.up.block_n, cfg.up.block_k) == ("shift", 128, 128)
    for N, routing in ((3, "random"), (1, "random")):
        check_case(tt, N, 160, 256, 64, 4, torch.bfloat16, True, "situ", routing, "cpu", cfg, seed=N)


@pytest.mark.parametrize("dequant,swap,block_m,block_n,block_k", [CLAMPED_CASES[i] for i in (0, 1, 4)])
def test_shift_clamped_rows(dequant, swap, block_m, block_n, block_k):
    """tests/test_triton_moe.py's case on the CPU (three of its tilings, two batches): the shift path's
    unmasked loads (clamped weight rows, padding rows on pair 0) at whole K steps with partial column
    tiles and padding rows."""
    cfg = variant_config(tt, dequant, swap, block_m, block_n, block_k)
    for N, routing in ((45, "subset"), (1, "random")):
        check_case(tt, N, 96, 160, 7, 3, torch.bfloat16, True, "situ", routing, "cpu", cfg, seed=N)


@pytest.mark.parametrize("dequant,swap,block_k,split_up,split_down", SPLIT_CASES)
def test_split_k(dequant, swap, block_k, split_up, split_down):
    """tests/test_triton_moe.py's split-K case on the CPU: uneven slices, slices past K, partial column tiles,
    experts with no token, one token on its k experts; NaN-poisoned output and act rows."""
    cfg = split_config(tt, dequant, swap, block_k, split_up, split_down)
    for N, routing in SPLIT_BATCHES:
        check_case(tt, N, 96, 160, 7, 3, torch.bfloat16, True, "situ", routing, "cpu", cfg, seed=N)


def test_split_k_fp32_and_bad_split():
    """fp32 (IEEE dots, exact dequant) at 1e-5 with both GEMMs split; split_k outside 1..16 is refused."""
    cfg = split_config(tt, "exact", False, 32, 3, 2)
    check_case(tt, 5, 64, 96, 5, 2, torch.float32, True, "situ", "random", "cpu", cfg)
    bad = tt.MoEConfig(up=tt.GemmTiles(split_k=0))
    x, w = torch.zeros(1, 32), torch.zeros(3, 32, 32)
    with pytest.raises(ValueError, match="split_k"):
        tt.fused_moe(x, w, w, w, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), config=bad)


def test_register_cap_runs_and_bad_caps_are_refused():
    """GemmTiles.max_registers (Triton's maxnreg) on both GEMMs gives the reference's values; caps outside 24..255
    are refused with the field's name."""
    tiles = tt.GemmTiles(block_n=32, block_k=32, max_registers=128)
    cfg = tt.MoEConfig(block_m=16, up=tiles, down=tt.GemmTiles(block_n=32, block_k=32, max_registers=96),
                       dequant="shift")
    assert tiles.compile_options() == dict(num_warps=4, num_stages=3, maxnreg=128)
    assert "maxnreg" not in tt.GemmTiles().compile_options()
    check_case(tt, 5, 64, 96, 7, 2, torch.bfloat16, True, "situ", "random", "cpu", cfg)
    x, w = torch.zeros(1, 32), torch.zeros(3, 32, 32)
    for cap in (8, 256):
        with pytest.raises(ValueError, match="max_registers"):
            tt.fused_moe(x, w, w, w, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1),
                         config=tt.MoEConfig(down=tt.GemmTiles(max_registers=cap)))


@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_default_decode_config(tokens):
    """The bf16 MXFP4 default for few tokens ("lut", unswapped 16 x 64 x 256 tiles) on the tiny preset's
    expert dims (h = I = 32: a K step longer than K)."""
    cfg = tt.default_config(tokens, 2, 8, torch.bfloat16, True)
    assert cfg.dequant == "lut" and not cfg.up.swap and cfg.block_m == 16
    check_case(tt, tokens, 32, 32, 8, 2, torch.bfloat16, True, "situ", "random", "cpu", cfg, seed=tokens)


def test_default_config_regimes():
    """BLOCK_M follows the mean rows per expert; fp32 always takes exact dequant with small tiles; MXFP4 decode
    tiles 128 x 128 from 64 experts up (K3.1's 896, an EP8 rank's 112), 64 x 256 below (the small preset's 16)."""
    k31 = [tt.default_config(n, 16, 896, torch.bfloat16, True) for n in (1, 64, 256, 1024, 8192)]
    assert [c.block_m for c in k31] == [16, 16, 16, 32, 64]
    assert [(c.up.block_n, c.up.block_k, c.down.block_n) for c in k31[:3]] == [(128, 128, 128)] * 3
    small = tt.default_config(8, 4, 16, torch.bfloat16, True, "shift")
    assert (small.block_m, small.up.block_n, small.up.block_k) == (16, 64, 256)
    assert all(c.dequant == "lut" for c in k31) and not any(c.up.swap for c in k31)
    assert tt.default_config(1, 16, 896, torch.bfloat16, True, "shift").dequant == "shift"
    assert tt.default_config(1, 2, 8, torch.bfloat16, False).up.swap  # bf16 weights: swapped
    assert tt.default_config(8192, 16, 896, torch.float32, True).dequant == "exact"
    assert tt.default_config(4, 8, 256, torch.bfloat16, False).up.block_k == 128


def test_empty_batch_and_bad_inputs():
    w = {n: torch.zeros(3, 32, 32, dtype=torch.bfloat16) for n in ("w1", "w2", "w3")}
    x = torch.zeros(0, 32, dtype=torch.bfloat16)
    ids, weights = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    assert tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights).shape == (0, 32)
    with pytest.raises(ValueError, match="activation"):
        tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, activation="gelu")
    with pytest.raises(ValueError, match="w2 must be"):
        tt.fused_moe(x, w["w1"], w["w1"][:, :16], w["w3"], ids, weights)
    packed = torch.zeros(3, 32, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="w1_scale"):
        tt.fused_moe(x, packed, packed, packed, ids, weights)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_fused_forward(mxfp4, dtype):
    """RoutedExperts.fused_forward (the kernel, as the model calls it on CUDA) against its torch forms."""
    config = load_preset("tiny").replace(routed_experts_mxfp4=mxfp4)
    experts = build_model(config, dtype, seed=4).model.layers[1].block_sparse_moe.experts
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 9):
        x = torch.randn(tokens, config.moe_hidden_size, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g)
        want = experts(x, ids, weights)
        got = experts.fused_forward(tt.fused_moe, x, ids, weights)
        assert rel_rms(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_tiny_model_with_fused_moe(monkeypatch):
    """The whole tiny model (fp32, 6 MoE layers) with the kernel selected for the CPU, against without."""
    model = build_model(load_preset("tiny"), torch.float32, seed=0)
    ids = torch.randint(0, 1024, (2, 11))
    want = model(ids)
    monkeypatch.setattr(moe_module, "fused_moe_for", lambda device_type: tt.fused_moe)
    got = model(ids)
    assert rel_rms(got, want) < 1e-4


def test_engine_shift_layout_matches_checkpoint_layout(monkeypatch):
    """The bf16 tiny engine with the fused kernel (interpreted) as the CPU's MoE: the experts re-laid for
    the "shift" decode (`ops.backend.shift_moe_layout`), served, then synced to new weights, give the
    tokens and logits of the checkpoint layout's ("lut") engine with those weights, bit for bit (both
    decodes are exact)."""
    from engine_utils import GREEDY, make_engine, random_prompts, run
    from kimiserve.engine import runner as runner_module
    from kimiserve.model.expert_layout import moe_layouts
    from kimiserve.ops.backend import REFERENCE_OPS, shift_moe_layout
    from kimiserve.rl.weight_sync import sync_weights
    from kimiserve.sampling_params import SamplingParams

    monkeypatch.setattr(moe_module, "fused_moe_for", lambda device_type: tt.fused_moe)
    monkeypatch.setattr(runner_module, "fused_moe_for", lambda device_type: tt.fused_moe)
    prompts = random_prompts([9, 20], seed=4)
    new = build_model(load_preset("tiny"), torch.bfloat16, seed=1)
    results = []
    for ops in (REFERENCE_OPS, shift_moe_layout(REFERENCE_OPS)):
        engine = make_engine("bfloat16")
        engine.runner.ops = ops
        assert moe_layouts(engine.model) == {ops.moe_layout: 6}
        if ops.moe_layout == "shift":  # serve a step on the preset's weights first
            run(engine, prompts[:1], SamplingParams(max_tokens=1, **GREEDY))
            engine.recorded.clear()
        sync_weights(engine, new)
        assert moe_layouts(engine.model) == {ops.moe_layout: 6}
        outs = run(engine, prompts, SamplingParams(max_tokens=2, **GREEDY))
        results.append(([outs[f"r{i}"].outputs[0].token_ids for i in range(2)], dict(engine.recorded)))
    (ref_tokens, ref_logits), (tokens, logits) = results
    assert tokens == ref_tokens and logits.keys() == ref_logits.keys()
    assert all(torch.equal(logits[k], ref_logits[k]) for k in ref_logits)


@pytest.mark.parametrize("N,K,block_k", [(1, 384, 128), (3, 2304, 256), (2, 4608, 256)])
def test_mma_order_kernel(N, K, block_k):
    """x's MMA-k copy as a Triton kernel (`ops.moe.mma_order`) is `fragment_order` bit for bit: one program a row,
    two (2304: a partial second chunk), three (4608)."""
    from kimiserve.ops.moe.fragment_order import fragment_order
    from kimiserve.ops.moe.mma_order import mma_order

    x = torch.randn(N, K + 64, generator=torch.Generator().manual_seed(K))[:, 32:32 + K]
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(mma_order(x.to(dtype), block_k), fragment_order(x.to(dtype), block_k))
