"""Runs scripts/rl_example.py (GRPO on the tiny model) for one mode as a child process with one torch thread
and checks what issue 20 asks of it: KL(rollout || trainer) exactly 0.0 and the trainer's recomputed
logprobs equal to the engine's at every one of the 100 steps, and the reward rising. The two modes are two
test modules (test_rl_example.py, test_rl_example_lora.py), so pytest-xdist runs them on both workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
STEPS = 100
NUM_PROMPTS = 2
"""Prompts per step (the script's default is 4): 100 steps take ~1.5 min (full) and ~3.3 min (LoRA) on a
2-core AMD EPYC; the reward still rises far past the bound below (measured on 10f8cec: mean reward of the
first 10 steps -> the last 10, full 0.06 -> 1.00, LoRA 0.07 -> 0.84; expected reward 0.06 -> 0.83 LoRA)."""
RISE = 0.2
"""The least rise of the mean reward (and of the expected reward) from the first 10 steps to the last 10."""


def check_grpo_example(tmp_path, mode: str) -> None:
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "rl_example.py"), "--steps", str(STEPS),
                        "--num-prompts", str(NUM_PROMPTS), "--modes", mode, "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {mode}
    history = results[mode]
    assert [h["step"] for h in history] == list(range(STEPS))
    assert [h["kl"] for h in history] == [0.0] * STEPS
    assert all(h["max_abs_logprob_diff"] == 0.0 for h in history)
    assert all(0.0 <= h["expected_reward"] <= 1.0 for h in history)
    for key in ("reward", "expected_reward"):
        values = [h[key] for h in history]
        first, last = sum(values[:10]) / 10, sum(values[-10:]) / 10
        assert last > first + RISE, (mode, key, first, last)
