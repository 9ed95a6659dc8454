"""The GRPO example (scripts/rl_example.py) in short: KL(rollout || trainer) is exactly 0.0 at every step
(every logprob the trainer recomputes equals the engine's, bit for bit) and the reward rises, for the
full model and for a LoRA adapter. The script itself runs 100 steps of each."""

from __future__ import annotations

import importlib.util
import os

import pytest

from kimiserve.rl.grpo import GRPOConfig

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "rl_example.py")


def load_script():
    spec = importlib.util.spec_from_file_location("rl_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode,lr", [("full", 3e-2), ("lora", 1e-1)])
def test_grpo_has_zero_mismatch_and_learns(mode, lr):
    history = load_script().run_mode(mode, GRPOConfig(steps=12, num_prompts=2, lr=lr), log=lambda *a: None)
    assert [h["kl"] for h in history] == [0.0] * 12
    assert all(h["max_abs_logprob_diff"] == 0.0 for h in history)
    rewards = [h["reward"] for h in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
