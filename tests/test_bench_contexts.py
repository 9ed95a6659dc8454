"""kimiserve.bench.contexts: decode contexts seeded from one real prefill (the long-context rows of
benchmarks/e2e_step.py and k31_rank_step.py); and the engine arguments those benchmarks build their
models with (model_overrides, run_one_rank)."""

from __future__ import annotations

import pytest
import torch

from engine_utils import GREEDY, assert_all_match_full_forward, make_engine, random_prompts
from kimiserve.bench.contexts import PoolTooSmall, check_seeded, seed_contexts
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams


def _decode(engine, prompts, max_tokens):
    ids = [f"t{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    engine.step()  # admits them from their snapshots: one token each
    check_seeded(engine, ids)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return [tokens[rid] for rid in ids]


def test_seeded_context_equal_to_the_source_gives_the_full_forward():
    """A target equal to the source holds what a prefill of it leaves: the engine's logits at every
    decode step match the full forward of the same tokens (fp32, bf16 cache: FP32_ROW_TOLERANCE), and
    the source's pages are all returned."""
    engine = make_engine(enable_prefix_caching=True)
    bs = engine.block_size
    prompts = random_prompts([bs + 37, 2 * bs + 5], seed=3)
    tokens = []
    for prompt in prompts:  # one source each (its own contexts are the prompt itself)
        seed_contexts(engine, prompt, [prompt])
        tokens += _decode(engine, [prompt], 12)
    assert_all_match_full_forward(engine, prompts, tokens)
    engine.reset_prefix_cache()
    engine.allocator.check_idle()
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_seeded_long_contexts_own_their_pages_and_free_them():
    """Targets longer than the source (tiled pages, redrawn index keys) and shorter ones (copied
    prefix): each request restores all but one prompt token, holds pages no other request holds,
    decodes, and every page is back once they are aborted and the prefix cache dropped."""
    engine = make_engine(enable_prefix_caching=True, max_model_len=1200, num_pages=400)
    bs = engine.block_size
    source = random_prompts([2 * bs + 9], seed=4)[0]
    lengths = [5 * bs + 3, 3 * bs, bs + 1, 40]
    prompts = [[i + 1] + random_prompts([n - 1], seed=10 + i)[0] for i, n in enumerate(lengths)]
    seed_contexts(engine, source, prompts)
    ids = [f"t{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=20, **GREEDY))
    engine.step()
    check_seeded(engine, ids)
    for _ in range(4):
        engine.step()
    running = [engine.groups[rid].samples[0] for rid in ids]
    assert all(len(r.output_ids) == 5 and all(0 <= t < engine.config.vocab_size for t in r.output_ids)
               for r in running)
    held = [p for r in running for p in r.pages]
    assert len(held) == len(set(held)), "two seeded requests share a page"
    for r, n in zip(running, lengths):
        assert len(r.block_table) == -(-(n + 4) // bs)
    for rid in ids:
        engine.abort_request(rid)
    engine.reset_prefix_cache()
    engine.allocator.check_idle()
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_seed_contexts_refuses_what_it_cannot_seed():
    engine = make_engine(enable_prefix_caching=True, num_pages=40)
    bs = engine.block_size
    source = random_prompts([bs + 9], seed=4)[0]
    with pytest.raises(ValueError, match="differ"):
        seed_contexts(engine, source, [source, list(source)])
    with pytest.raises(PoolTooSmall, match="free"):  # e2e_step.py skips such a row and goes on
        seed_contexts(engine, source, [[i] + source for i in range(30)])
    engine.reset_prefix_cache()
    engine.allocator.check_idle()
    with pytest.raises(ValueError, match="more than"):
        seed_contexts(engine, source[: bs // 2], [source])
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        seed_contexts(make_engine(enable_prefix_caching=False), source, [source])


def test_model_overrides_make_a_layer_subset():
    args = EngineArgs(model="tiny", device="cpu", num_pages=64, max_model_len=256,
                      model_overrides='{"num_hidden_layers": 3, "full_attn_layers": [2]}')
    engine = LLMEngine(args)
    assert engine.config.num_hidden_layers == 3 and engine.config.full_attn_layers == (2,)
    assert len(engine.model.model.layers) == 3
    for bad, match in (('{"num_layers": 3}', "unknown"), ("[3]", "JSON object"), ("{3", "JSON")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(model="tiny", model_overrides=bad).validate()


def test_run_one_rank_builds_rank_zero_of_the_layout_and_decodes():
    """tp 4 with expert parallelism, run alone: the model holds rank 0's shard (1/4 of the KDA and MLA
    heads, 1/4 of the experts, 1/4 of the vocabulary rows, whole replicated parts) and the engine
    prefills and decodes on it."""
    from kimiserve.config import tiny_parallel_config
    from kimiserve.model.model import build_model

    overrides = {k: v for k, v in tiny_parallel_config().to_dict().items() if k != "architecture"}
    args = EngineArgs(model="tiny", device="cpu", num_pages=64, max_model_len=256, model_overrides=overrides,
                      tensor_parallel_size=4, enable_expert_parallel=True, run_one_rank=True)
    engine = LLMEngine(args)
    full = build_model(engine.config, torch.float32, seed=0)
    rank = dict(engine.model.named_parameters())
    for name, p in full.named_parameters():
        local = rank[name]
        if ".experts." in name or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert local.shape[0] * 4 == p.shape[0], name
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            assert local.numel() * 4 == p.numel(), name
        elif ".indexer." in name or name.endswith("norm.weight") or ".gate." in name:
            assert local.shape == p.shape, name
    assert engine.layout.recurrent.shape[0] == engine.config.kda_num_heads // 4
    prompt = random_prompts([30], seed=2, vocab=engine.config.vocab_size)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, **GREEDY))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="run_one_rank"):
        EngineArgs(model="tiny", run_one_rank=True).validate()


def test_request_token_slice_is_all_ids_slice():
    """The runner feeds `token_slice` (no prompt + output concatenation per step at long contexts)."""
    from kimiserve.engine.request import Request

    r = Request("a", [1, 2, 3, 4], SamplingParams(), 0)
    for outputs in ([], [5, 6]):
        r.output_ids = list(outputs)
        for start in range(8):
            for stop in range(8):
                assert r.token_slice(start, stop) == r.all_ids[start:stop], (outputs, start, stop)


def _dry_run(tmp_path, script, *extra):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / script), "--dry-run", "--out", str(out), *extra],
                          cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"device", "date", "commit", "copy_gbps", "matmul_tflops", "rows"} <= data.keys()
    return data


@pytest.mark.fixed_threads  # the script runs with one torch thread
def test_e2e_step_dry_run_writes_the_issue_rows(tmp_path):
    """benchmarks/e2e_step.py on the CPU (tiny): decode rows at every batch x context plus the
    batch-1-only context, seeded contexts longer than the source, a prefill row; the keys issue 15 names."""
    data = _dry_run(tmp_path, "e2e_step.py")
    decode = [r for r in data["rows"] if r["kind"] == "decode"]
    assert [(r["batch"], r["context"]) for r in decode] == [(1, 40), (3, 40), (1, 300), (3, 300), (1, 700)]
    for r in decode:
        assert r["step_ms"] > 0 and r["experts_hit_per_step"] > 0 and r["bytes"] > 0 and "roofline_ms" in r
    assert any(r["context"] > r["source_tokens"] for r in decode)  # tiled
    for context in (40, 300):  # the batch's sequences differ (their copied caches do not): more experts hit
        hits = {r["batch"]: r["experts_hit_per_step"] for r in decode if r["context"] == context}
        assert hits[3] > hits[1], (context, hits)
    (prefill,) = [r for r in data["rows"] if r["kind"] == "prefill"]
    assert prefill["prompt_tokens"] == 100 and prefill["ttft_s"] > 0 and "matmul_fraction" in prefill


def test_e2e_moe_configs_patch_one_regime_and_restore():
    """e2e_step.py --moe-decode-tiles / --moe-prefill-tiles: a moe_layer.py SPEC replaces the fused MoE's config for
    the decode regime (<= 8 rows per expert, bf16, MXFP4) or the prefill regime when its dequant matches the
    layout's, nothing else; 'default' restores that regime's.
    Needs Triton (the library module it patches), which the CPU set-up does not install."""
    import dataclasses
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from e2e_step import use_moe_config

    from kimiserve.ops.moe import triton as tt

    before = [tt.default_config(n, 16, 896, dt, True, layout) for n, dt, layout in
              ((1, torch.bfloat16, "shift"), (1, torch.bfloat16, "checkpoint"), (1024, torch.bfloat16, "shift"),
               (1, torch.float32, "shift"))]
    try:
        use_moe_config("shift-m16-n32-k64-w2-s2")
        tile = tt.default_config(1, 16, 896, torch.bfloat16, True, "shift")
        assert (tile.up.block_n, tile.up.block_k, tile.up.num_warps, tile.dequant) == (32, 64, 2, "shift")
        assert tt.default_config(1, 16, 896, torch.bfloat16, True, "checkpoint") == before[1]  # "lut": not shift
        assert tt.default_config(1024, 16, 896, torch.bfloat16, True, "shift") == before[2]  # 18 rows per expert
        assert tt.default_config(1, 16, 896, torch.float32, True, "shift") == before[3]
        use_moe_config("shift-m16-n16-k32-w1-s2")  # a second A/B side patches the original, not the patch
        assert tt.default_config(1, 16, 896, torch.bfloat16, True, "shift").up.block_n == 16
        use_moe_config("shift-m64-n64-k128-w4-s3-dn128", "prefill")  # --moe-prefill-tiles: the other regime
        prefill = tt.default_config(1024, 16, 896, torch.bfloat16, True, "shift")
        assert (prefill.block_m, prefill.down.block_n, prefill.fragments) == (64, 128, False)
        assert tt.default_config(1, 16, 896, torch.bfloat16, True, "shift").up.block_n == 16  # decode kept
        use_moe_config("default+pdl+sk2")  # the decode default with options
        assert tt.default_config(1, 16, 896, torch.bfloat16, True, "shift") == dataclasses.replace(
            before[0], dependent_launch=True, up=dataclasses.replace(before[0].up, split_k=2))
        with pytest.raises(ValueError, match="option 'pdl2'"):
            use_moe_config("default+pdl2")
        use_moe_config("default")  # the decode regime's default again, the prefill patch kept
        assert tt.default_config(1, 16, 896, torch.bfloat16, True, "shift") == before[0]
        assert tt.default_config(1024, 16, 896, torch.bfloat16, True, "shift").block_m == 64
    finally:
        use_moe_config("default")
        use_moe_config("default", "prefill")
    assert tt.default_config(1, 16, 896, torch.bfloat16, True, "shift") == before[0]
    assert tt.default_config(1024, 16, 896, torch.bfloat16, True, "shift") == before[2]


def test_e2e_prefill_flops_count_lm_head_once_and_the_selected_latents():
    """e2e_step's prefill FLOPs: lm_head runs for the last token only; each MLA layer's attention reads
    min(position + 1, top-k) latents per query (2 x heads x (576 + 512) FLOPs each) and its index scan
    every visible key (2 x index heads x index dim each)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from e2e_step import prefill_flops

    from kimiserve.config import load_preset

    cfg = load_preset("small")
    head, mla, k = cfg.vocab_size * cfg.hidden_size, len(cfg.full_attn_layers), cfg.index_topk
    one, two = prefill_flops(cfg, 1000), prefill_flops(cfg, 2000)
    assert 2 * one["linear"] - two["linear"] == 2 * head  # the per-token part doubles, lm_head's stays
    assert one["attention"] == mla * 2 * cfg.num_attention_heads * 1088 * (1000 * 1001 // 2)  # all visible (< top-k)
    long = prefill_flops(cfg, k + 10)
    assert long["attention"] == mla * 2 * cfg.num_attention_heads * 1088 * (k * (k + 1) // 2 + 10 * k)
    assert long["index_scan"] == mla * 2 * cfg.index_n_heads * cfg.index_head_dim * ((k + 10) * (k + 11) // 2)
    assert long["total"] == long["linear"] + long["attention"] + long["index_scan"]


@pytest.mark.fixed_threads  # the script runs with one torch thread
def test_k31_rank_step_dry_run_scales_two_subsets(tmp_path):
    """benchmarks/k31_rank_step.py on the CPU (tiny widths, tp 4): both layer subsets run as one
    expert-parallel rank and the scaled rows are the line through them at 93 layers."""
    data = _dry_run(tmp_path, "k31_rank_step.py", "--layers", "2,5")
    rows = {(r["kind"], r["layers"], r["batch"]): r for r in data["rows"]}
    for batch in (1, 32):
        a, b, scaled = rows["decode", 2, batch], rows["decode", 5, batch], rows["decode_scaled", 93, batch]
        slope = (b["step_ms"] - a["step_ms"]) / 3
        assert abs(scaled["step_ms"] - (a["step_ms"] + 91 * slope)) < 1e-9 * max(1.0, abs(scaled["step_ms"]))
        assert (a["kda_layers"], a["mla_layers"], b["kda_layers"], b["mla_layers"]) == (1, 1, 3, 2)
