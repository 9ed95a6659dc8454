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
