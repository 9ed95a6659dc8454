"""Smoke runs of the batch-invariant benchmark and the engine-vs-trainer parity check on tiny inputs
(child processes with one torch thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fixed_threads
ROOT = os.path.join(os.path.dirname(__file__), "..")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_batch_invariant_benchmark_runs_and_checks_invariance(tmp_path):
    out = tmp_path / "bi.json"
    r = run("benchmarks/batch_invariant.py", "--batch", "3", "--prompt-len", "16", "--decode-steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert record["batch_invariant"]["d0_alone_equals_in_batch"] is True
    assert record["slowdown_decode"] > 0 and record["default"]["prefill_tokens_per_s"] > 0


def test_parity_check_passes_for_base_and_lora(tmp_path):
    out = tmp_path / "p.json"
    r = run("benchmarks/rl_parity_check.py", "--num-seqs", "2", "--prompt-len", "12", "--completion-len", "5",
            "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text())
    assert record["base"]["equal"] and record["lora"]["equal"] and record["lora"]["tokens"] == 10
