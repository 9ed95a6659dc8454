"""`triton_prefill.prefill_indexer_scores` under Triton's CPU interpreter at small sizes: the checks of
tests/test_triton_indexer_prefill.py (NaN-poisoned pages and output, rows not a multiple of the query
tile, shuffled contexts). Skipped unless KIMISERVE_TRITON_INTERPRET=1 (run in its own process):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_indexer_prefill_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from test_triton_indexer_prefill import check_prefill_scores, chunk_lens  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("kv", ["fp8", "bf16", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_rows(kv, dtype):
    """A chunk's last 7 rows (not a multiple of the 4-row tile) over 150 keys in 64-token pages, 32-key
    tiles, 2 per program: contexts ending in several tiles and pages; 4 heads x 32, 3 extra columns."""
    check_prefill_scores(kv, 150, chunk_lens(150, 7), 4, 32, "cpu", block_size=64, dtype=dtype, extra=3,
                         block_s=32, tiles=2)
    check_prefill_scores(kv, 150, chunk_lens(150, 7), 4, 32, "cpu", block_size=64, dtype=dtype, block_q=1)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_shuffled_rows_fp32_query(kv):
    """Rows in no order, one seeing a single key; fp32 q (split into two dot operands), 3 heads x 16."""
    lens = [90, 1, 33, 64, 65, 17]
    check_prefill_scores(kv, 90, lens, 3, 16, "cpu", block_size=32, q_dtype=torch.float32, block_s=16, block_q=2,
                         tiles=3)


def test_bad_table_is_a_clear_error():
    from kimiserve.ops.indexer.triton_prefill import prefill_indexer_scores

    with pytest.raises(ValueError, match="one sequence"):
        prefill_indexer_scores(torch.zeros(2, 4, 16), torch.zeros(2, 4), torch.zeros(3, 16, 16), None,
                               torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, dtype=torch.int64), torch.float32,
                               4)
