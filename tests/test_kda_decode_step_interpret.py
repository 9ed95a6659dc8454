"""The fused KDA decode step's Triton kernel under Triton's CPU interpreter (no GPU needed).

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kda_decode_step_interpret.py -q
"""

import os

import pytest
import torch

if os.environ.get("KIMISERVE_TRITON_INTERPRET") != "1":
    pytest.skip("set KIMISERVE_TRITON_INTERPRET=1 to run the Triton interpreter checks", allow_module_level=True)
import triton_interpreter_shims  # noqa: E402

triton_interpreter_shims.enable()

from kda_decode_step_cases import CASES, check_decode_step  # noqa: E402
from kimiserve.ops.kda import triton_decode  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound", CASES)
def test_kernel_matches_reference(rows, H, K, W, lower_bound, dtype):
    check_decode_step(triton_decode.kda_decode_step, "cpu", dtype, rows, H, K, W, lower_bound, seed=rows * 31 + K)
