"""`triton.paged_sparse_mla_prefill` under Triton's CPU interpreter at the tiny preset's sizes: the
checks of tests/test_triton_mla_prefill.py. Skipped unless KIMISERVE_TRITON_INTERPRET=1:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_mla_prefill_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from test_triton_mla_prefill import check_prefill  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv, scale_l", [("bf16", 1.0), ("fp8", 0.125), ("fp8", 0.05), ("fp4", 0.05)])
def test_tiny_rows(kv, scale_l, dtype):
    """tiny: 4 heads (a partial head block), L=32, R=8; 7 rows over 130 cached tokens, top-70."""
    check_prefill("tiny", kv, 130, 7, 70, "cpu", dtype=dtype, latent_scale=scale_l)


def test_explicit_tiles_and_bad_table():
    from kimiserve.ops.mla import triton as tt

    check_prefill("tiny", "fp8", 100, 5, 40, "cpu", config=tt.DecodeConfig(block_h=16, block_n=16, num_splits=4))
    with pytest.raises(ValueError, match="one sequence"):
        tt.paged_sparse_mla_prefill(torch.zeros(2, 4, 32), torch.zeros(2, 4, 8), torch.zeros(3, 16, 40), None,
                                    torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64), 0.1,
                                    torch.float32)
