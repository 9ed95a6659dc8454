"""The fused KDA decode step's Triton kernel under Triton's CPU interpreter (no GPU needed).

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kda_decode_step_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from kda_decode_step_cases import CASES, check_decode_step  # noqa: E402
from kimiserve.ops.kda import triton_decode  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound", CASES)
def test_kernel_matches_reference(rows, H, K, W, lower_bound, dtype):
    check_decode_step(triton_decode.kda_decode_step, "cpu", dtype, rows, H, K, W, lower_bound, seed=rows * 31 + K)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_engine_with_fused_kda_decode_matches_reference_ops(kv):
    """The tiny engine with the kernel as its KDA decode step: the reference-ops engine's greedy tokens,
    and its logits at every step within fp32 rounding."""
    import dataclasses
    import functools

    from engine_utils import assert_ops_match_reference_ops, random_prompts
    from kimiserve.ops.backend import REFERENCE_OPS
    from kimiserve.ops.kda import paged

    fused = dataclasses.replace(REFERENCE_OPS, name="fused-kda-interpreted", kda_decode_step=functools.partial(
        triton_decode.kda_decode_step, fallback=paged.kda_decode))
    assert_ops_match_reference_ops(fused, kv, random_prompts([40, 90, 7], seed=11))
