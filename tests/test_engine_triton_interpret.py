"""The engine on `tiny` with the Triton MLA kernels (cache write, index scan, top-k, sparse and dense
MLA; run by Triton's CPU interpreter) in place of the reference ops: the same tokens and logits as
the reference-ops engine, for every cache format. This checks how the model drives the kernels (4-bit
page views, rotated index queries, the fp4 global scale, prefill rows in place through the prefill kernels) before a GPU does.
KDA keeps its reference ops (fla-core needs CUDA).

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (see tests/test_triton_mla_interpret.py):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_engine_triton_interpret.py -q
"""

import dataclasses

import pytest

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from engine_utils import assert_ops_match_reference_ops, random_prompts  # noqa: E402
from kimiserve.ops.backend import REFERENCE_OPS  # noqa: E402
from kimiserve.ops.cache_write import triton as cache_write_tt  # noqa: E402
from kimiserve.ops.indexer import triton as indexer_tt  # noqa: E402
from kimiserve.ops.indexer import triton_prefill as indexer_prefill_tt  # noqa: E402
from kimiserve.ops.mla import triton as mla_tt  # noqa: E402
from kimiserve.ops.topk import triton as topk_tt  # noqa: E402

TRITON_MLA_OPS = dataclasses.replace(
    REFERENCE_OPS, name="triton-interpreted", write_mla_tokens=cache_write_tt.write_mla_tokens,
    indexer_scores=indexer_tt.paged_indexer_scores, topk=topk_tt.topk_indices,
    sparse_mla_decode=mla_tt.paged_sparse_mla_decode, dense_mla_decode=mla_tt.paged_dense_mla_decode,
    prefill_indexer_scores=indexer_prefill_tt.prefill_indexer_scores, sparse_mla_prefill=mla_tt.paged_sparse_mla_prefill,
    prefill_in_place=True,  # the prefill forms' defaults: the GPU-verified decode kernels one row / fp32 result each
)




@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4", "fp8+fp4"])
def test_engine_with_triton_mla_ops_matches_reference_ops(kv):
    # 40 tokens: dense MLA (within tiny's top-8 window only at first); 90: sparse, across two pages
    assert_ops_match_reference_ops(TRITON_MLA_OPS, kv, random_prompts([40, 90], seed=11))


def test_engine_with_the_prefill_kernels_matches_reference_ops():
    """`backend.prefill_kernels` (the CUDA default since the H200 run of session 4) over the MLA kernels: the query-tiled scan on fp8
    keys, sparse MLA rounding in the kernel (and KDA's short conv and gated norm)."""
    from kimiserve.ops.backend import prefill_kernels

    assert_ops_match_reference_ops(prefill_kernels(TRITON_MLA_OPS), "fp8", random_prompts([40, 90], seed=11))
