"""CPU smoke tests of the 4-bit cache benchmarks' plumbing: benchmarks/capacity.py (the real pool per
kv cache dtype in a small budget) and benchmarks/decode_attention.py --cpu-smoke (the reference ops,
fp8 and fp4 rows). No timing is asserted; the scripts run in this process (a fresh Python costs
seconds) through their main(). With KIMISERVE_TRITON_INTERPRET=1 (in its own process) one more test runs
the benchmark's measurement with the Triton ops under the interpreter:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/test_benchmarks_fp4.py
"""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

INTERPRET = os.environ.get("KIMISERVE_TRITON_INTERPRET") == "1"
if INTERPRET:  # before any kernel module is imported (see tests/test_triton_mla_interpret.py)
    import triton_interpreter_shims

    triton_interpreter_shims.enable()

from conftest import rel_rms  # noqa: E402
from kimiserve.config import load_preset  # noqa: E402
from kimiserve.ops.indexer.reference import indexer_scores  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(module, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_capacity_small_budget(tmp_path, monkeypatch, capsys):
    out = tmp_path / "capacity.json"
    budget_gb = 0.25
    assert run_main(load_script("capacity"), monkeypatch, "--budget-gb", str(budget_gb), "--sequences", "1",
                    "--device", "cpu", "--out", str(out)) == 0
    assert "fp4 / fp8 tokens" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["budget_bytes"] == int(budget_gb * 2**30) and data["model"] == "kimi-k3.1-pro"
    tokens = data["tokens"]
    assert sorted(tokens) == ["bf16", "fp4", "fp8"] and all(positive(t) for t in tokens.values())
    assert tokens["fp4"] >= 1.7 * tokens["fp8"]
    assert 1.8 <= tokens["fp8"] / tokens["bf16"] <= 2.2
    assert data["ratios"]["fp4_over_fp8"] == pytest.approx(tokens["fp4"] / tokens["fp8"])
    assert data["state_pages_per_sequence"] == data["num_kda_layers"] == 69
    for kv, r in data["per_kv_cache_dtype"].items():
        # as many whole pages as fit, really allocated, and tokens counted from them
        assert r["allocated_bytes"] == r["pages"] * r["page_bytes"] <= data["budget_bytes"]
        assert data["budget_bytes"] - r["allocated_bytes"] < r["page_bytes"]
        assert r["tokens"] == tokens[kv] == r["pages"] * r["block_size"]
        assert r["tokens_with_state"] == max(0, r["pages"] - 69) * r["block_size"]
        assert r["cache_bytes_per_token"] <= r["bytes_per_token"]
    # 24 MLA layers: fp8 (576 + 132 B) and fp4 (324 + 68 B) per layer and token
    assert data["per_kv_cache_dtype"]["fp8"]["cache_bytes_per_token"] == 24 * 708
    assert data["per_kv_cache_dtype"]["fp4"]["cache_bytes_per_token"] == 24 * 392


ROW_KEYS = {"kv_cache_dtype", "context", "batch", "scan_ms", "topk_ms", "sparse_mla_ms", "sparse_ms", "dense_ms",
            "naive_ms", "sparse_bytes", "dense_bytes", "torch_topk_ms", "scan_graph_ms", "topk_graph_ms",
            "sparse_mla_graph_ms", "sparse_graph_ms", "dense_graph_ms", "sparse_vs_naive_rel_rms", "copy_gbps",
            "sparse_gbps", "dense_gbps", "index_bytes_per_token", "latent_bytes_per_token"}


def test_decode_attention_cpu_smoke(tmp_path, monkeypatch, capsys):
    out = tmp_path / "decode_attention.json"
    da = load_script("decode_attention")
    assert run_main(da, monkeypatch, "--cpu-smoke", "--kv-cache-dtypes", "fp8,fp4", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "fp4 next to fp8" in printed and "sparse step" in printed
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["cpu_smoke"] is True and data["kv_cache_dtypes"] == ["fp8", "fp4"]
    assert positive(data["copy_gbps"]) and not data["skipped"]
    rows = data["rows"]
    cases = {(r["context"], r["batch"]) for r in rows}
    by_case = {(r["context"], r["batch"], r["kv_cache_dtype"]): r for r in rows}
    assert len(cases) == 4 and len(rows) == 8 and set(by_case) == {(*c, kv) for c in cases for kv in ("fp8", "fp4")}
    tiny = load_preset("tiny")
    topk = tiny.index_topk
    # tiny preset per token and layer: fp8 keys 16 + 4 B, latent 40 B; fp4 keys 16 (one padded group)
    # + 1 B, latent 3 x 9 B
    per_token = {"fp8": (20, 40), "fp4": (17, 27)}
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        index_b, latent_b = per_token[r["kv_cache_dtype"]]
        assert (r["index_bytes_per_token"], r["latent_bytes_per_token"]) == (index_b, latent_b)
        assert r["sparse_bytes"] == r["batch"] * (r["context"] * index_b + min(topk, r["context"]) * latent_b)
        assert r["dense_bytes"] == r["batch"] * r["context"] * latent_b
        for key in ("scan_ms", "topk_ms", "sparse_mla_ms", "sparse_ms", "dense_ms", "naive_ms", "sparse_gbps"):
            assert positive(r[key]), (r["kv_cache_dtype"], key)
        assert r["sparse_graph_ms"] is None  # no CUDA graphs on the CPU
        assert r["sparse_finite"] and r["sparse_vs_naive_rel_rms"] < 1e-4
    assert {(c["context"], c["batch"]) for c in data["fp4_vs_fp8"]} == cases
    for c in data["fp4_vs_fp8"]:
        fp8, fp4 = (by_case[c["context"], c["batch"], kv] for kv in ("fp8", "fp4"))
        assert c["sparse_fp4_over_fp8"] == pytest.approx(fp4["sparse_ms"] / fp8["sparse_ms"])
        assert fp4["sparse_over_fp8"] == c["sparse_fp4_over_fp8"]


def test_decode_attention_real_sizes_and_cases():
    """At the benchmark's K3.1 sizes (small preset): the bytes each format reads per token, and fp4 cases
    whose random pages decode to finite, moderate values, scanned in the stored (rotated) basis."""
    da = load_script("decode_attention")
    config = load_preset("small")
    from kimiserve.cache.layout import CacheLayout

    layout = lambda kv: CacheLayout.from_config(config, kv, torch.bfloat16)
    assert da.read_bytes(layout("fp8")) == (da.INDEX_BYTES, da.LATENT_BYTES) == (132, 576)
    assert da.read_bytes(layout("fp4")) == (68, 324)

    c = da.build_case(load_preset("tiny"), 2, 150, kv="fp4", device="cpu")
    pool, tables, lens = c["pool"], c["tables"], c["lens"]
    assert pool.layout.index_key_rotation and c["rotation"] is not None
    pos = torch.arange(150)
    pages, offsets = tables[:, pos // pool.block_size], pos % pool.block_size
    latents = pool.read_latents(0, pages, offsets, torch.float32)
    keys = pool.read_index_keys(0, pages, offsets, torch.float32)  # rotated back to the model's basis
    assert torch.isfinite(latents).all() and latents.abs().max() <= 22.5 and latents.abs().max() > 1
    assert torch.isfinite(keys).all() and keys.norm(dim=-1).max() <= 6 * 16**0.5 + 1e-4  # |code| <= 6, scale <= 1
    # the benchmark's scan (the query rotated by the scan, over the stored keys) scores as the model's
    # query over the keys
    from kimiserve.ops.indexer.reference import paged_indexer_scores
    iq = c["iq"].float()
    scores = paged_indexer_scores(iq, c["iw"], pool.index_key[0], pool.index_scale[0], tables, lens, torch.float32,
                                  rotation=c["rotation"])
    expect = indexer_scores(iq.unsqueeze(1), keys, c["iw"].unsqueeze(1))[:, 0]
    assert rel_rms(scores, expect) < 1e-5


@pytest.mark.skipif(not INTERPRET, reason="set KIMISERVE_TRITON_INTERPRET=1 to run the Triton ops (interpreter)")
@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_decode_attention_triton_ops_interpret(kv):
    """The GPU path's calls into the Triton ops (scan, top-k, sparse and dense MLA on this format's pages),
    timed by the host clock: the whole sparse step agrees with the naive reference version."""
    da = load_script("decode_attention")
    once = lambda fn: da.wall_time(fn, repeats=1, warmup=0)
    timers = SimpleNamespace(eager=once, graph=lambda fn: None, slow=once)
    tiny = load_preset("tiny")
    row = da.measure(da.triton_ops(), timers, tiny, kv, 2, 150, tiny.index_topk, True, "cpu")
    assert row["kv_cache_dtype"] == kv and row["sparse_finite"]
    assert row["sparse_vs_naive_rel_rms"] < 5e-3  # the latents rounded to bf16 in a different order
