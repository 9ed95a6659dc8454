"""The GRPO example (scripts/rl_example.py) in short: KL(rollout || trainer) is exactly 0.0 at every step
(every logprob the trainer recomputes equals the engine's, bit for bit) for the full model and for a
LoRA adapter, and the full model's reward rises (the LoRA reward rise needs the script's longer run).
The script itself runs 100 steps of each. It runs as a child process with one torch thread (the thread
count's effect on invariance is test_batch_invariant's to check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fixed_threads

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_grpo_has_zero_mismatch_and_learns(tmp_path):
    out = tmp_path / "rl.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "rl_example.py"), "--steps", "12",
                        "--num-prompts", "2", "--lr", "3e-2", "--modes", "full", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # LoRA: KL == 0 at every step is asserted, its reward rise is not: at a CI budget it is not a robust
    # property. Over 12 steps of 2 prompts it is noise-level (last-3 minus first-3 mean reward +0.002 ..
    # +0.112 across lr 1e-1 .. 8e-1 and gradient rounding changes; the policy's expected reward, which has
    # no sampling noise, moved -0.0003 .. +0.027 over 4 seeds at lr 1e-1). With 4 prompts (~30 s) its
    # last-3 minus first-3 mean rose in 4 of 5 seeds (+0.02 .. +0.10) and fell in one (-0.004): the adapter starts
    # at B = 0 and the reward takes off only after ~20-35 steps. The script's 100-step LoRA run shows the
    # rise (BENCHMARKS.md, results/rl_parity.json). So the LoRA run is 6 steps (its KL check needs no
    # more: from the second step the adapter's B is no longer 0, and each step's logprobs are compared)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "rl_example.py"), "--steps", "6",
                        "--num-prompts", "2", "--lr", "1e-1", "--modes", "lora", "--out", str(tmp_path / "lora.json")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = {**json.loads(out.read_text()), **json.loads((tmp_path / "lora.json").read_text())}
    assert set(results) == {"full", "lora"}
    for mode, history in results.items():
        steps = {"full": 12, "lora": 6}[mode]
        assert [h["kl"] for h in history] == [0.0] * steps, mode
        assert all(h["max_abs_logprob_diff"] == 0.0 for h in history), mode
        rewards = [h["reward"] for h in history]
        if mode == "full":
            assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, (mode, rewards)
        assert [h["step"] for h in history] == list(range(steps))
        assert all(0.0 < h["expected_reward"] < 1.0 for h in history), mode
