"""The GRPO example's 100 full-model steps: KL(rollout || trainer) exactly 0.0 at every step, reward rising
(`grpo_example.check_grpo_example`; the LoRA run is test_rl_example_lora.py, a module of its own so that the
two run on both pytest-xdist workers at once)."""

import pytest

from grpo_example import check_grpo_example

pytestmark = pytest.mark.fixed_threads


def test_grpo_full_model_has_zero_mismatch_and_learns(tmp_path):
    check_grpo_example(tmp_path, "full")
