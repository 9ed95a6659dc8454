"""KDA's short conv for prefill chunks (`ops.conv.triton.short_conv`) against the reference
(`ops.kda.paged.short_conv`) under Triton's CPU interpreter: odd token counts (fewer than the conv's
width included), head dims that are not powers of two (24), a conv state or none, bf16 and fp32, inputs that
are row slices of a wider packed batch. Skipped unless KIMISERVE_TRITON_INTERPRET=1:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_short_conv_triton_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from short_conv_cases import check_short_conv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 37, 70])
def test_matches_reference(T, dtype):
    check_short_conv(T, heads=3, head_dim=24, dtype=dtype, device="cpu")


def test_no_state_and_batch_of_two():
    check_short_conv(5, heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu", state=False)
    check_short_conv(9, heads=2, head_dim=16, dtype=torch.float32, device="cpu", batch=2)
