"""The GRPO example's 100 LoRA steps (the base frozen, the adapter synced into the engine each step): KL
exactly 0.0 at every step, reward rising (`grpo_example.check_grpo_example`)."""

import pytest

from grpo_example import check_grpo_example

pytestmark = pytest.mark.fixed_threads


def test_grpo_lora_has_zero_mismatch_and_learns(tmp_path):
    check_grpo_example(tmp_path, "lora")
