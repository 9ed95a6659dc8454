"""Smoke test of benchmarks/cpu_engine.py: the quick configuration runs and writes complete JSON.

No timing is asserted (the figures depend on the machine and its load); only that every expected
key is there and every figure is a positive number.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "cpu_engine.py"

TOP_KEYS = {"benchmark", "model", "device", "cpu_model", "cpu_count", "threads", "torch_version", "python_version",
            "date", "git_commit", "command", "quick", "config", "dtype", "kv_cache_dtype", "load_average_before",
            "load_average_after", "wall_seconds", "ceilings", "decode", "prefill"}
CEILINGS = ("copy_gb_per_s", "copy_gb_per_s_max", "copy_bytes", "matmul_gflop_per_s", "matmul_gflop_per_s_max",
            "matmul_n")
FIGURES = ("engine_tok_per_s", "baseline_tok_per_s", "speedup")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.fixed_threads  # the script runs with one torch thread
def test_cpu_engine_quick(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine tok/s" in proc.stdout  # the table is printed last

    data = json.loads(out.read_text())
    assert TOP_KEYS <= data.keys(), TOP_KEYS - data.keys()
    assert data["device"] == "cpu" and data["model"] == "tiny" and data["quick"] is True
    assert data["threads"] == 1 and positive(data["cpu_count"]) and positive(data["wall_seconds"])
    assert data["cpu_model"] and data["torch_version"] and data["git_commit"] and data["date"]
    assert "--quick" in data["command"]

    for key in CEILINGS:
        assert positive(data["ceilings"][key]), key

    batches = data["config"]["decode_batches"]
    assert batches and sorted(data["decode"]) == sorted(str(b) for b in batches)
    for b in batches:
        r = data["decode"][str(b)]
        for key in (*FIGURES, "engine_median_step_ms", "batch", "prompt_len", "gen_len"):
            assert positive(r[key]), (b, key)
        assert r["batch"] == b
        assert len(r["engine_runs"]) == len(r["baseline_runs"]) == data["config"]["repeats"]
        for run in r["engine_runs"] + r["baseline_runs"]:
            assert positive(run["seconds"]) and run["tokens"] == b * r["gen_len"]

    assert sorted(data["prefill"]) == ["batch", "single"]
    for name, r in data["prefill"].items():
        for key in (*FIGURES, "batch", "prompt_len", "engine_steps", "max_num_batched_tokens"):
            assert positive(r[key]), (name, key)
        for run in r["engine_runs"] + r["baseline_runs"]:
            assert positive(run["seconds"]) and run["tokens"] == r["batch"] * r["prompt_len"]


KDA_ROW_KEYS = {"phase", "batch", "seq_len", "tokens", "paged_ms", "plain_ms", "reference_ms", "bytes", "paged_gbps",
                "plain_gbps", "copy_gbps", "paged_tok_s", "plain_tok_s", "paged_over_plain"}


def test_kda_cpu_smoke(tmp_path):
    """benchmarks/kda.py --cpu-smoke: the reference ops on tiny sizes, every row complete; the paged and
    plain paths agree (both are the references here). Without --out a smoke run writes under the temp dir,
    never over the GPU results in benchmarks/results."""
    out = tmp_path / "smoke_kda.json"
    results = REPO / "benchmarks" / "results" / "kda.json"
    before = results.read_bytes() if results.exists() else None
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kda.py"), "--cpu-smoke"], cwd=REPO,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (results.read_bytes() if results.exists() else None) == before
    assert "paged/plain" in proc.stdout
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["cpu_smoke"] is True and data["commit"] and data["date"]
    assert positive(data["copy_gbps"])
    assert [r["phase"] for r in data["rows"]] == ["decode", "decode", "prefill", "prefill"]
    for r in data["rows"]:
        assert KDA_ROW_KEYS <= r.keys(), KDA_ROW_KEYS - r.keys()
        for key in KDA_ROW_KEYS - {"phase"}:
            assert positive(r[key]), (r["phase"], r["batch"], key)
        assert r["tokens"] == r["batch"] * r["seq_len"] and r["copy_gbps"] == data["copy_gbps"]
        assert r["paged_vs_plain_rel_rms"] < 1e-5 and r["paged_vs_reference_rel_rms"] < 1e-5


@pytest.mark.fixed_threads  # flags and exit codes only
def test_kda_needs_cuda():
    """Without CUDA (and without --cpu-smoke) the script says so and exits with code 2."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kda.py"), "--quick", "--out", os.devnull],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "CUDA" in proc.stderr


@pytest.mark.fixed_threads  # flags and exit codes only
def test_sweep_decode_cli_without_cuda():
    """benchmarks/sweep_decode.py parses its flags anywhere; without CUDA it says so and exits with code 2."""
    import pytest
    import torch

    script = str(REPO / "benchmarks" / "sweep_decode.py")
    proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--max-seconds" in proc.stdout, proc.stderr[-3000:]
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    proc = subprocess.run([sys.executable, script, "--out", os.devnull], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "CUDA" in proc.stderr


def test_sweep_decode_grids():
    """Each kernel's grid starts with the wrapper's default launch, and every variant is a valid launch."""
    import pytest
    import torch

    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import sweep_decode
    from kimiserve.ops.mla.triton import DecodeConfig, default_config

    grid = sweep_decode.grids(4608)
    # the scan's tiles and stages default to a choice by batch size (None)
    assert grid["scan"][0] == dict(block_s=128, tiles=None, num_warps=4, num_stages=None)
    assert grid["topk"][0] == dict(block=4096, num_warps=8, window=128, cap=256)
    assert DecodeConfig(**grid["mla"][0]) == default_config(torch.bfloat16)
    assert (len(grid["scan"]), len(grid["topk"])) == (91, 48)  # 8a4b98c dropped the nine fused-finish variants
    for name, variants in grid.items():
        assert all(v not in variants[:i] for i, v in enumerate(variants)), name  # no duplicates
    assert all(4608 % v["block_s"] == 0 for v in grid["scan"])
    for v in grid["mla"]:
        DecodeConfig(**v)
