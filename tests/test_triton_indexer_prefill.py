"""`triton_prefill.prefill_indexer_scores` (query rows of one sequence in tiles of BLOCK_Q) against
the reference (`reference.prefill_indexer_scores`: the decode scan with the table repeated per row).

Keys of ONE sequence in scattered pages of a 0xFF-filled pool (NaN for e4m3 and bf16: a stray read
shows), the output a NaN-filled view of a wider buffer (a missing or stray write shows); row counts
not a multiple of the query tile, rows whose contexts end in different tiles and pages (a prefill
chunk's consecutive positions, and shuffled ones), a row seeing one key. The interpreter runs the
same checks at small sizes (tests/test_triton_indexer_prefill_interpret.py).
"""

import pytest
import torch

from conftest import rel_rms
from kimiserve.ops.indexer.reference import prefill_indexer_scores as reference_scores
from test_triton_indexer import TOL, make_case

pytestmark = pytest.mark.gpu


def check_prefill_scores(kv: str, context: int, lens: list[int], H: int, D: int, device: str = "cuda",
                         block_size: int | None = None, dtype: torch.dtype = torch.bfloat16,
                         q_dtype: torch.dtype = torch.bfloat16, extra: int = 0, block_q: int = 4, **launch) -> float:
    """n = len(lens) query rows over one sequence of `context` cached tokens, row i seeing lens[i];
    block_q rows per program (4 unless told: the query-tiled kernel whatever the default)."""
    from kimiserve.ops.indexer.triton_prefill import prefill_indexer_scores

    _, _, kc, ks, tables, _ = make_case(kv, [context], H, D, device, block_size, q_dtype)
    table = tables[0]
    n = len(lens)
    q = torch.randn(n, H, D, device=device).to(q_dtype)
    w = torch.randn(n, H, device=device) * D**-0.5
    ctx = torch.tensor(lens, device=device)
    S = max(lens) + extra
    ref = reference_scores(q, w, kc, ks, table, ctx, dtype, S)
    wide = torch.full((n, S + 5), float("nan"), device=device)
    out = wide[:, :S]
    got = prefill_indexer_scores(q, w, kc, ks, table, ctx, dtype, S, out=out, block_q=block_q, **launch)
    assert got.data_ptr() == out.data_ptr() and got.shape == (n, S)
    assert wide[:, S:].isnan().all(), "a column past max_context was written"
    visible = torch.arange(S, device=device)[None, :] < ctx[:, None]
    assert torch.isfinite(got[visible]).all(), "a visible score is not finite (stray read of a NaN slot?)"
    assert (got[~visible] == float("-inf")).all(), "a score past context_len is not -inf"
    assert (ref[~visible] == float("-inf")).all()
    err = rel_rms(got[visible], ref[visible])
    assert err < TOL, f"rel RMS {err:.3g}"
    return err


def chunk_lens(context: int, n: int) -> list[int]:
    """The context lengths of a prefill chunk's last n rows: context - n + 1 .. context."""
    return list(range(context - n + 1, context + 1))


@pytest.mark.parametrize("block_q", [1, 4, 8])
@pytest.mark.parametrize("kv", ["fp8", "bf16", "fp4"])
@pytest.mark.parametrize("context, n", [(3001, 37), (769, 769), (5000, 2)])
def test_k31_layout_32_heads(kv, context, n, block_q):
    """Real K3.1 pages, 32 heads x 128: chunk rows (n not a multiple of the query tile; a whole prompt)."""
    check_prefill_scores(kv, context, chunk_lens(context, n), 32, 128, extra=3, block_q=block_q)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_shuffled_rows_and_odd_shapes(kv):
    """Rows in no order (their contexts end in different tiles and pages), one row seeing one key;
    3 heads x 64, 64-token pages, fp32 q (split in two parts), other tiles."""
    lens = torch.randperm(700)[:23].add(1).tolist() + [1]
    check_prefill_scores(kv, 700, lens, 3, 64, block_size=64, extra=9)
    check_prefill_scores(kv, 700, lens, 32, 128, block_size=64, q_dtype=torch.float32, block_s=32, block_q=2,
                         tiles=3)


def test_matches_the_decode_kernel():
    """Same products and sums as the decode scan with the table repeated per row (fp8, K3.1 layout)."""
    from kimiserve.ops.indexer.triton import paged_indexer_scores
    from kimiserve.ops.indexer.triton_prefill import prefill_indexer_scores

    _, _, kc, ks, tables, _ = make_case("fp8", [4097], 32, 128, "cuda")
    n = 130
    q = torch.randn(n, 32, 128, device="cuda").bfloat16()
    w = torch.randn(n, 32, device="cuda") * 128**-0.5
    ctx = torch.tensor(chunk_lens(4097, n), device="cuda")
    a = prefill_indexer_scores(q, w, kc, ks, tables[0], ctx, torch.bfloat16, 4097, block_q=4)
    b = paged_indexer_scores(q, w, kc, ks, tables[0].expand(n, -1), ctx, torch.bfloat16, 4097)
    visible = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), visible)
    assert rel_rms(a[visible], b[visible]) < 1e-6
