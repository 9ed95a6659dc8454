"""The Triton fused MoE at real shapes, on CUDA: Kimi-K3.1's layer (896 experts, top-16, 3584 -> 3072, MXFP4,
15.7 GB) under each decode and prefill form and the default config (eager and in a CUDA graph), the `small`
preset's and Kimi-Linear's experts, run-to-run determinism; and the tiny engine with the kernel against the full
forward through the torch expert forms.

The helpers and accuracy bounds are tests/test_triton_moe.py's (the small awkward cases live there).
"""

from __future__ import annotations

import pytest
import torch

from conftest import rel_rms
from test_triton_moe import (VARIANTS, check_case, fragment_config, random_packed_experts, reference, route_ids,
                             run_kernel, variant_config, wgmma_config)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tt():
    from kimiserve.ops.moe import triton as tt
    return tt


# ------------------------------------------------------------------------------------------------
# real shapes

K31 = dict(E=896, k=16, h=3584, inter=3072)


@pytest.fixture(scope="module")
def k31_experts():
    return random_packed_experts(K31["E"], K31["h"], K31["inter"], "cuda")


def _k31_inputs(N: int, routing: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K31["h"], generator=gen).bfloat16().cuda()
    ids = route_ids(N, K31["E"], K31["k"], routing, gen).cuda()
    weights = torch.rand(N, K31["k"], generator=gen)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).cuda()


@pytest.mark.parametrize("routing", ["random", "zipf"])
@pytest.mark.parametrize("N", [1, 16, 300])
def test_k31_shape(tt, k31_experts, N, routing):
    """896 experts x top-16, 3584 -> 3072 -> 3584, MXFP4, SiTU, the default config for N tokens."""
    x, ids, weights = _k31_inputs(N, routing, N)
    got, (act_rows, y_rows) = run_kernel(tt, x, k31_experts, ids, weights, "situ")
    want = reference(x, k31_experts, ids, weights, "situ")
    err = rel_rms(got, want)
    print(f"K3.1 shape, {N} tokens, {routing}: rel RMS {err:.2e}")
    assert torch.isfinite(act_rows).all() and torch.isfinite(y_rows).all()
    assert torch.isfinite(got).all() and err < 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_k31_shape_variants(tt, k31_experts, variant):  # the shift variants re-lay the 15.7 GB layer (~2 s)
    """Every dequantisation and orientation at the K3.1 shape, 16-row blocks (benchmarks/moe_layer.py
    --check checks every timed tiling at this shape too)."""
    x, ids, weights = _k31_inputs(64, "random", 3)
    want = reference(x, k31_experts, ids, weights, "situ")
    for block_m, block_n, block_k in [(16, 64, 256)]:
        cfg = variant_config(tt, block_m=block_m, block_n=block_n, block_k=block_k, **VARIANTS[variant])
        got, _ = run_kernel(tt, x, k31_experts, ids, weights, "situ", cfg)
        err = rel_rms(got, want)
        print(f"K3.1 shape, 64 tokens, {variant}, block_m {block_m}: rel RMS {err:.2e}")
        assert torch.isfinite(got).all() and err < 1e-2


@pytest.fixture(scope="module")
def k31_shift(k31_experts):
    """The K3.1-shape layer with its codes in the shift layout (a second 15.7 GB)."""
    from kimiserve.ops.moe.mxfp4_layout import to_shift_layout

    return {n: t if n.endswith("_scale") else to_shift_layout(t) for n, t in k31_experts.items()}


@pytest.mark.parametrize("N,block_n,block_k,block_m", [(1, 128, 128, 16), (16, 64, 256, 16), (64, 128, 128, 16),
                                                       (64, 64, 256, 16), (1, 64, 256, 8), (16, 64, 256, 8),
                                                       (64, 64, 256, 8)])
def test_k31_shape_fragments(tt, k31_experts, k31_shift, N, block_n, block_k, block_m):
    """The fragment GEMMs at the K3.1 shape, random routing (block_m 8: swapped operands); two runs bitwise
    equal."""
    w = k31_shift
    x, ids, weights = _k31_inputs(N, "random", 11 + N)
    want = reference(x, k31_experts, ids, weights, "situ")
    cfg = fragment_config(tt, block_n, 4, block_k, block_k, block_m, swap=block_m == 8)
    runs = [tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                         w3_scale=w["w3_scale"], config=cfg, mxfp4_layout="shift") for _ in range(2)]
    err = rel_rms(runs[0], want)
    print(f"K3.1 shape, {N} tokens, fragments: rel RMS {err:.2e}")
    assert torch.isfinite(runs[0]).all() and err < 1e-2 and torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("N,block_m,tails,registers,warps", [
    (1024, 64, "t64", None, 8), (4096, 64, "t64", None, 8), (4096, 128, "t64", None, 8), (8192, 128, "t32", None, 8),
    (8192, 128, "t32r", None, 8), (8192, 64, "t64", 128, 8), (8192, 128, "t64", None, 16),
    (8192, 128, "t64w", None, 16)])
def test_k31_shape_wgmma_fragments(tt, k31_experts, k31_shift, N, block_m, tails, registers, warps):
    """The prefill fragment GEMMs at the K3.1 shape, random routing (at 4096 tokens ~73 rows an expert: 128-row
    blocks of 65-127 rows and tails of at most 64 in the second gate/up launch; at 8192 ~146, most tails at most 32
    rows, with the tails t32 / t32r in a third launch; 64-row blocks at 128 registers, two programs an SM; the
    main launches on 16 warps); two runs bitwise equal."""
    w = k31_shift
    x, ids, weights = _k31_inputs(N, "random", 5 + N)
    want = reference(x, k31_experts, ids, weights, "situ")
    stages = 3 if block_m == 128 or registers else 4
    cfg = wgmma_config(tt, block_m, stages, stages, tails, registers, warps)
    runs = [tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                         w3_scale=w["w3_scale"], config=cfg, mxfp4_layout="shift") for _ in range(2)]
    err = rel_rms(runs[0], want)
    print(f"K3.1 shape, {N} tokens, wgmma fragments, block_m {block_m}: rel RMS {err:.2e}")
    assert torch.isfinite(runs[0]).all() and err < 1e-2 and torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("N", [1, 16, 300, 1024])
def test_k31_shape_shift_default(tt, k31_experts, k31_shift, N):
    """The shift layout's default config at the K3.1 shape (fused_moe picks it: at 1 and 16 tokens the swapped
    decode GEMMs, at 1 token with the down GEMM's one-wave register cap; at 300 the unswapped 16-row blocks; all
    three chained with PDL on sm_90+; at 1024 the wgmma GEMMs on 16 warps with 32-token tails), zipf routing, against the reference;
    a CUDA graph's replay bitwise equal to the eager call."""
    from kimiserve.utils.cuda_timing import capture_graph

    w = k31_shift
    x, ids, weights = _k31_inputs(N, "zipf", 21 + N)
    want = reference(x, k31_experts, ids, weights, "situ")

    def call(out=None):
        return tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"],
                            w2_scale=w["w2_scale"], w3_scale=w["w3_scale"], mxfp4_layout="shift", out=out)

    eager = call()
    err = rel_rms(eager, want)
    print(f"K3.1 shape, {N} tokens, shift default: rel RMS {err:.2e}")
    assert torch.isfinite(eager).all() and err < 1e-2
    out = torch.full_like(x, float("nan"))
    graph = capture_graph(lambda: call(out))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("N", [1, 33, 700])
def test_small_preset_shape(tt, N):
    """The `small` preset's experts: 16 x top-4, 3584 -> 3072, MXFP4 (quantised from floats), SiTU."""
    check_case(tt, N, 3584, 3072, 16, 4, torch.bfloat16, True, "situ", "random", "cuda", seed=N)


@pytest.mark.parametrize("N", [1, 64, 1000])
def test_kimi_linear_shape_bf16(tt, N):
    """Kimi-Linear-48B's experts: 256 x top-8, 2304 -> 1024, bf16 weights, SiLU."""
    check_case(tt, N, 2304, 1024, 256, 8, torch.bfloat16, False, "silu", "zipf", "cuda", seed=N)


def test_deterministic_and_graph_capture(tt, k31_experts):
    """Two runs are bitwise equal; a CUDA graph captured for 16 tokens replays other routings exactly."""
    from kimiserve.utils.cuda_timing import capture_graph

    x, ids, weights = _k31_inputs(16, "random", 5)
    w = k31_experts
    first = tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                         w3_scale=w["w3_scale"])
    again = tt.fused_moe(x, w["w1"], w["w2"], w["w3"], ids, weights, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                         w3_scale=w["w3_scale"])
    assert torch.equal(first, again)
    out = torch.empty_like(x)
    sx, sids, sw = x.clone(), ids.clone(), weights.clone()
    graph = capture_graph(lambda: tt.fused_moe(sx, w["w1"], w["w2"], w["w3"], sids, sw, w1_scale=w["w1_scale"],
                                               w2_scale=w["w2_scale"], w3_scale=w["w3_scale"], out=out))
    for seed in (6, 7):
        x2, ids2, w2 = _k31_inputs(16, "zipf", seed)
        sx.copy_(x2), sids.copy_(ids2), sw.copy_(w2)
        out.fill_(float("nan"))
        graph.replay()
        eager = tt.fused_moe(x2, w["w1"], w["w2"], w["w3"], ids2, w2, w1_scale=w["w1_scale"], w2_scale=w["w2_scale"],
                             w3_scale=w["w3_scale"])
        assert torch.equal(out, eager)


# ------------------------------------------------------------------------------------------------
# the engine


def _set_fused(model, enabled: bool | None):
    from kimiserve.model.moe import RoutedExperts

    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.use_fused = enabled


@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("bfloat16", "fp8")])
def test_engine_with_fused_moe_matches_full_forward(dtype, kv):
    """The tiny engine on CUDA runs the fused kernel (eager prefill chunks and graph-captured decode);
    its logits equal the full forward through the torch expert forms within test_gpu's bounds."""
    from engine_utils import GREEDY, assert_all_match_full_forward, make_engine, random_prompts, run
    from kimiserve.ops.moe.dispatch import fused_moe_for
    from kimiserve.sampling_params import SamplingParams

    assert fused_moe_for("cuda") is not None
    engine = make_engine(dtype, kv, device="cuda", max_num_batched_tokens=64)
    prompts = random_prompts([3, 70, 150])
    outs = run(engine, prompts, SamplingParams(max_tokens=16, **GREEDY))
    _set_fused(engine.model, False)
    try:
        assert_all_match_full_forward(engine, prompts, [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))])
    finally:
        _set_fused(engine.model, None)
    engine.check_idle()


def test_tiny_model_fused_equals_torch_forms():
    """The whole tiny model on CUDA (fp32): the fused kernel against the torch expert forms."""
    from kimiserve.config import load_preset
    from kimiserve.model.model import build_model

    model = build_model(load_preset("tiny"), torch.float32, seed=0, device="cuda")
    ids = torch.randint(0, 1024, (3, 41), device="cuda")
    fused = model(ids)
    _set_fused(model, False)
    assert rel_rms(fused, model(ids)) < 1e-4


def test_engine_shift_layout_matches_checkpoint_layout():
    """The bf16 tiny engine on CUDA (eager prefill, graph-captured decode) with the experts re-laid for the
    "shift" decode (`ops.backend.shift_moe_layout`): the checkpoint layout's ("lut") tokens and logits
    (both decodes exact: the same bf16 operands), on the preset's weights and after a weight sync that
    puts one layer's scale bytes past MAX_SHIFT_SCALE (that layer back to the checkpoint layout, the
    graphs captured again)."""
    import dataclasses

    from engine_utils import GREEDY, make_engine, random_prompts, run
    from kimiserve.config import load_preset
    from kimiserve.model.expert_layout import moe_layouts
    from kimiserve.model.model import build_model
    from kimiserve.ops.backend import shift_moe_layout
    from kimiserve.ops.moe.mxfp4_layout import MAX_SHIFT_SCALE
    from kimiserve.rl.weight_sync import sync_weights
    from kimiserve.sampling_params import SamplingParams

    prompts, params = random_prompts([3, 70, 150]), SamplingParams(max_tokens=12, **GREEDY)
    new = build_model(load_preset("tiny"), torch.bfloat16, seed=1)
    new.model.layers[1].block_sparse_moe.experts.w1_scale[0, 0, 0] = MAX_SHIFT_SCALE + 2
    results = []
    for shift in (False, True):
        engine = make_engine("bfloat16", "fp8", device="cuda", max_num_batched_tokens=64)
        ops = engine.runner.ops
        engine.runner.ops = shift_moe_layout(ops) if shift else dataclasses.replace(ops, moe_layout="checkpoint")
        assert moe_layouts(engine.model) == {"shift" if shift else "checkpoint": 6}
        for _ in range(2):
            outs = run(engine, prompts, params)
            results.append(([outs[f"r{i}"].outputs[0].token_ids for i in range(3)], dict(engine.recorded)))
            engine.recorded.clear()
            sync_weights(engine, new)
        assert moe_layouts(engine.model) == ({"checkpoint": 1, "shift": 5} if shift else {"checkpoint": 6})
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
        engine.check_idle()
    for (ref_tokens, ref_logits), (tokens, logits) in zip(results[:2], results[2:]):
        assert tokens == ref_tokens and logits.keys() == ref_logits.keys()
        assert max(rel_rms(logits[k], ref_logits[k]) for k in ref_logits) < 1e-6
