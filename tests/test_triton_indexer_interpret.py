"""The Triton indexer scan (`paged_indexer_scores`) on MXFP4 index keys under Triton's CPU interpreter.

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run them in their own process (the variable turns on
TRITON_INTERPRET before the kernels are defined, which a process that already imported them misses):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_indexer_interpret.py -q

Keys are `store_index_key(k, "fp4")` of Gaussian keys with outlier channels, in 0xFF-poisoned pages
(a 0xFF scale byte is NaN); `check_scores` compares against the reference within rel RMS 1e-4 (only
the fp32 summation order differs), checks -inf past each context and that no column past
max_context is written.
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from conftest import rel_rms  # noqa: E402
from kimiserve.cache.formats import store_index_key  # noqa: E402
from kimiserve.ops.indexer import triton as tt  # noqa: E402
from kimiserve.ops.indexer.reference import paged_indexer_scores as reference_scores  # noqa: E402
from test_triton_indexer import check_rotated_query, check_scores, make_case  # noqa: E402

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [[1], [63, 65, 200]])
def test_tiny_preset_pages(lens, dtype):
    """The tiny preset's own fp4 pages: D=16 (one group, its upper half zero padding), 4 heads,
    64-token pages, contexts off the page size, batch 1 and 3; 5 extra output columns."""
    check_scores("fp4", lens, 4, 16, "cpu", dtype=dtype, extra=5, preset="tiny", block_s=16, tiles=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_k31_dims(dtype):
    """K3.1's key width (D=128: 4 groups, the 4 scale bytes read as one int32 word), 8 heads."""
    check_scores("fp4", [65, 1, 200], 8, 128, "cpu", block_size=64, dtype=dtype, extra=3, block_s=32, tiles=2)


def test_k31_32_heads_batch_1():
    check_scores("fp4", [63], 32, 128, "cpu", block_size=64, block_s=16)


@pytest.mark.parametrize("preset, block_size, D, block_s", [("tiny", None, 16, 128), (None, 64, 128, 256)])
def test_tiles_spanning_pages(preset, block_size, D, block_s):
    """Tiles longer than a page (the MXFP4 kernel looks up each token's page)."""
    check_scores("fp4", [1, 200, 65], 4, D, "cpu", block_size=block_size, extra=9, preset=preset or "tiny",
                 block_s=block_s, tiles=2)


def test_unaligned_scales_and_other_widths():
    """Scale bytes that cannot be read as words (the byte path), 2 groups (D=64), fp32 and fp16 q."""
    check_scores("fp4", [200, 1], 4, 128, "cpu", block_size=64, scale_offset=1, block_s=64)
    check_scores("fp4", [65], 3, 64, "cpu", block_size=64, q_dtype=torch.float32, block_s=32)
    check_scores("fp4", [65], 3, 64, "cpu", block_size=64, dtype=torch.float16, q_dtype=torch.float16, block_s=32)


def test_scale_extremes_exact():
    """Groups at the ends of the ue8m0 range (2^-127, a subnormal, and 2^100) and all-zero groups:
    dequantised keys stay exact in the kernel as in the reference (fp32 dot; q rescaled so that
    the products stay in fp32's normal range; the other tokens overflow meanwhile, harmlessly)."""
    q, w, kc, ks, tables, ctx = make_case("fp4", [70], 2, 128, "cpu", block_size=64)
    pos = torch.arange(70)
    pages, slots = tables[0, pos // 64].long(), pos % 64
    codes, scales = store_index_key(torch.randn(70, 128), "fp4")
    scales[:10] = 0
    scales[10:20] = 227
    codes[20:30, 16:32] = 0
    scales[20:30, 1] = 0
    kc[pages, slots], ks[pages, slots] = codes, scales
    for tokens, factor in ((slice(0, 10), 2.0**100), (slice(10, 20), 2.0**-100)):
        q2 = q.float() * factor
        want = reference_scores(q2, w, kc, ks, tables, ctx, torch.float32)[0, tokens]
        got = tt.paged_indexer_scores(q2, w, kc, ks, tables, ctx, torch.float32)[0, tokens]
        assert want.abs().max() > 1e-12 and rel_rms(got, want) < 1e-6
    want = reference_scores(q, w, kc, ks, tables, ctx, torch.bfloat16)
    got = tt.paged_indexer_scores(q, w, kc, ks, tables, ctx, torch.bfloat16)
    assert rel_rms(got[0, 20:30], want[0, 20:30]) < 1e-5


def test_groups_far_below_their_token():
    """Keys whose groups differ by up to 2^60 in magnitude stay exact: each group's dot is scaled
    in fp32, relative to the token's largest group."""
    q, w, kc, ks, tables, ctx = make_case("fp4", [64], 4, 128, "cpu", block_size=64)
    keys = torch.randn(64, 128) * torch.exp2(-torch.tensor([0.0, 10.0, 30.0, 60.0]).repeat_interleave(32))
    kc[tables[0, 0]], ks[tables[0, 0]] = store_index_key(keys, "fp4")
    q_wide = q.float()
    q_wide[..., 32:64] *= 2.0**10
    q_wide[..., 64:96] *= 2.0**30
    q_wide[..., 96:] *= 2.0**60  # with the fp32 dot every group counts
    for dtype, query in ((torch.bfloat16, q), (torch.float32, q_wide)):
        want = reference_scores(query, w, kc, ks, tables, ctx, dtype)
        assert rel_rms(tt.paged_indexer_scores(query, w, kc, ks, tables, ctx, dtype), want) < 1e-6


@pytest.mark.parametrize("B, H, D, q_dtype", [(1, 32, 128, torch.bfloat16), (3, 17, 64, torch.float32),
                                              (2, 3, 32, torch.float16)])
def test_rotated_query(B, H, D, q_dtype):
    """The scan's query rotation (one launch) against the reference's, and a scan given the rotation."""
    check_rotated_query(B, H, D, q_dtype, "cpu")


def test_poisoned_page_reads_nan():
    """A block-table entry pointing at an unowned (0xFF) page makes those scores NaN: the
    poisoning catches a stray read in this format too."""
    q, w, kc, ks, tables, ctx = make_case("fp4", [130], 4, 16, "cpu", preset="tiny")
    bad = tables.clone()
    bad[0, 1] = tables[0, -1]  # the spare page
    got = tt.paged_indexer_scores(q, w, kc, ks, bad, ctx, torch.bfloat16)
    assert got[0, 64:128].isnan().all() and torch.isfinite(got[0, :64]).all() and torch.isfinite(got[0, 128:]).all()


def test_rejects_mismatched_scales():
    q, w, kc, ks, tables, ctx = make_case("fp4", [5], 4, 128, "cpu", block_size=64)
    with pytest.raises(ValueError, match="MXFP4"):
        tt.paged_indexer_scores(q, w, kc, ks[..., :2], tables, ctx, torch.bfloat16)
    with pytest.raises(ValueError, match="MXFP4"):
        tt.paged_indexer_scores(q[..., :64], w, kc, ks, tables, ctx, torch.bfloat16)
