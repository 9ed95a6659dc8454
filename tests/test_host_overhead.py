"""Smoke test of benchmarks/host_overhead.py on the CPU: it runs, times every phase it names, and writes
complete JSON (no timing is asserted: the figures depend on the machine and its load)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fixed_threads  # the script: one torch thread, no figure asserted: OMP_NUM_THREADS changes nothing

REPO = Path(__file__).resolve().parent.parent


def test_host_overhead_cpu(tmp_path):
    out = tmp_path / "host.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_overhead.py"), "--device", "cpu",
                           "--batches", "1,3", "--steps", "4", "--async-scheduling", "on", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model"] == "tiny" and data["device"] == "cpu" and [r["batch"] for r in data["rows"]] == [1, 3]
    for row in data["rows"]:
        assert row["async_scheduling"] is True and row["overlapped_steps"] > 0
        assert {"schedule", "prepare", "batch build", "forward", "sample", "postprocess", "output", "other"} \
            <= row["phases_ms"].keys(), row["phases_ms"]
        assert all(v >= 0 for v in row["phases_ms"].values())
        assert 0 < row["phase_run_host_ms"] < row["phase_run_step_ms_mean"]
        assert row["step_ms_min"] <= row["step_ms_median"]


def test_host_overhead_speculative_rounds_on_emulated_graphs(tmp_path):
    """--speculative with --stub-forward --emulate-graphs: every step a verify round on the graph paths
    (the stub's outputs cycle, so n-gram drafts hit), with the propose and commit phases timed."""
    out = tmp_path / "spec.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_overhead.py"), "--device", "cpu",
                           "--stub-forward", "--emulate-graphs", "--batches", "2", "--steps", "30",
                           "--speculative", '{"method": "ngram", "num_speculative_tokens": 3}', "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["emulated_graphs"] and data["speculative"]["method"] == "ngram"
    row = data["rows"][0]
    assert row["graph_replays"] > 0 and row["tokens_per_step_per_sequence"] > 1.5, row
    assert {"propose", "commit", "batch build", "sample"} <= row["phases_ms"].keys(), row["phases_ms"]


def test_host_overhead_runs_another_model(tmp_path):
    """--model: the phases of another model's steps (e.g. kimi-demo's draft rounds on a GPU); the JSON names it."""
    out = tmp_path / "demo.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_overhead.py"), "--device", "cpu",
                           "--model", "kimi-demo", "--stub-forward", "--batches", "1", "--steps", "3", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model"] == "kimi-demo" and data["rows"][0]["batch"] == 1


def test_output_kinds_cpu(tmp_path):
    """benchmarks/output_kinds.py: every output kind's generation runs to its end, each repeat as many steps."""
    out = tmp_path / "kinds.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "output_kinds.py"), "--batch", "3",
                           "--tokens", "20", "--repeats", "2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["rows"]) == {"cumulative", "delta", "final_only"}
    steps = {r["steps"] for runs in data["rows"].values() for r in runs}
    assert len(steps) == 1 and steps.pop() >= 20
    assert all(r["mean_ms"] > 0 for runs in data["rows"].values() for r in runs)
