"""Paged decode oracles (indexer top-k and sparse MLA) against dense per-sequence computations.

Sequences have odd lengths (1, 65, 130 with 64-token pages, so last pages are partly filled),
live in scattered pages in random order, and every byte the ops must not read (pages no sequence
owns, slots past a sequence's length, block-table padding) is NaN: reading it shows up as NaN.
"""

import pytest
import torch

from conftest import rel_rms
from kimiserve.ops.indexer.reference import indexer_scores, paged_indexer_topk
from kimiserve.ops.mla.reference import mla_absorbed, mla_expanded, paged_sparse_mla_decode
from kimiserve.ops.quant.reference import FP8_DTYPE, dequantize_fp8, quantize_fp8
from kimiserve.ops.topk.reference import causal_topk

BS, NUM_PAGES = 64, 17
CTX = [1, 65, 130]


def _tables(lens: list[int]) -> torch.Tensor:
    """Block tables [B, M] of scattered pages in random order, padded with an unowned page."""
    need = [-(-n // BS) for n in lens]
    perm = torch.randperm(NUM_PAGES).tolist()
    tables = torch.full((len(lens), max(need) + 1), perm.pop(), dtype=torch.int64)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    return tables


def _scatter(dense: list[torch.Tensor], fill_shape: tuple[int, ...], dtype: torch.dtype, tables=None):
    """Place per-sequence rows [S_b, ...] into a NaN-poisoned paged cache [P, BS, ...]: returns (cache, tables)."""
    tables = _tables([len(d) for d in dense]) if tables is None else tables
    cache = torch.full((NUM_PAGES, BS, *fill_shape), float("nan")).to(dtype)
    for b, rows in enumerate(dense):
        for s in range(len(rows)):
            cache[tables[b, s // BS], s % BS] = rows[s]
    return cache, tables


def _grid(shape, num: int, den: int, lo: int | None = None) -> torch.Tensor:
    """Small dyadic values (integers / den): every product and sum below is exact in fp32."""
    return torch.randint(-num if lo is None else lo, num + 1, shape).float() / den


# indexer top-k ----------------------------------------------------------------------------------
def _index_case(fp8: bool, D: int, Hi: int = 3, dup: bool = False):
    B = len(CTX)
    q, w = _grid((B, Hi, D), 4, 4), _grid((B, Hi), 3, 4)
    keys = [_grid((s, D), 8, 1 if fp8 else 8) for s in CTX]  # fp8: integers |k| <= 8 are exact e4m3
    scales = [torch.exp2(torch.randint(-3, 3, (s,)).float()) for s in CTX] if fp8 else None
    if dup:  # ties: a best key repeated at 5, 70, 129 and a runner-up at 10, 100 (seq 2)
        w[2], q[2] = w[2].abs() + 0.25, q[2].abs() + 0.25
        keys[2] = keys[2] / 16
        if fp8:
            scales[2].fill_(1.0)
        keys[2][[5, 70, 129]] = 4.0
        keys[2][[10, 100]] = 2.0
    if fp8:
        kc, tables = _scatter([k.to(FP8_DTYPE) for k in keys], (D,), FP8_DTYPE)
        sc, _ = _scatter(scales, (), torch.float32, tables)
        dense = [k * s.unsqueeze(1) for k, s in zip(keys, scales)]
    else:
        kc, tables = _scatter([k.bfloat16() for k in keys], (D,), torch.bfloat16)
        sc, dense = None, keys
    return q, w, kc, sc, tables, dense


def _dense_topk(q, w, dense, k, dtype):
    out = []
    for b, keys in enumerate(dense):
        scores = indexer_scores(q[b][None, None], keys.to(dtype)[None], w[b][None, None])
        out.append(causal_topk(scores, torch.tensor([[len(keys) - 1]]), k)[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 16, 70, 131])
@pytest.mark.parametrize("fp8, D", [(False, 16), (True, 24)])
def test_paged_indexer_topk_matches_dense(fp8, D, k, dtype):
    q, w, kc, sc, tables, dense = _index_case(fp8, D)
    lens = torch.tensor(CTX)
    got = paged_indexer_topk(q, w, kc, sc, tables, lens, k, dtype)
    assert got.shape == (3, k) and got.dtype == torch.int64
    assert torch.equal(got, _dense_topk(q, w, dense, k, dtype))
    for b, n in enumerate(CTX):  # k best distinct visible positions, then -1 padding
        sel = got[b][got[b] >= 0]
        assert len(sel) == min(k, n) and len(set(sel.tolist())) == len(sel) and (sel < n).all()
        assert (got[b][len(sel):] == -1).all()
    # int32 tables and lengths (what a kernel would take) give the same answer
    assert torch.equal(got, paged_indexer_topk(q, w, kc, sc, tables.int(), lens.int(), k, dtype))


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_indexer_topk_ties_earlier_token_wins(fp8):
    q, w, kc, sc, tables, dense = _index_case(fp8, 16, dup=True)
    got = paged_indexer_topk(q, w, kc, sc, tables, torch.tensor(CTX), 6, torch.float32)
    assert got[2, :5].tolist() == [5, 70, 129, 10, 100]
    assert torch.equal(got, _dense_topk(q, w, dense, 6, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_indexer_topk_applies_key_scales_in_fp32(dtype):
    """Key 70's scale is 1 + 2^-10 (1 in bf16): the scale multiplies the fp32 score, not a key rounded
    to the model dtype, so key 70 beats its tied copies 5 and 129 in bf16 too."""
    q, w, kc, sc, tables, dense = _index_case(True, 16, dup=True)
    sc[tables[2, 1], 70 - BS] = 1 + 2.0**-10
    got = paged_indexer_topk(q, w, kc, sc, tables, torch.tensor(CTX), 3, dtype)
    assert got[2].tolist() == [70, 5, 129]


def test_paged_indexer_topk_reads_only_owned_slots():
    """Sanity of the poisoning: pointing one table entry at an unowned page changes the answer."""
    q, w, kc, sc, tables, dense = _index_case(False, 16)
    bad = tables.clone()
    bad[1, 1] = tables[1, -1]  # the poisoned padding page
    got = paged_indexer_topk(q, w, kc, sc, bad, torch.tensor(CTX), 16, torch.float32)
    assert not torch.equal(got, _dense_topk(q, w, dense, 16, torch.float32))


# sparse MLA decode ------------------------------------------------------------------------------
H, L, R = 3, 24, 8


def _mla_case(fp8: bool, dtype: torch.dtype):
    scale_l = 0.05 if fp8 else None
    rows = [torch.randn(s, L + R) for s in CTX]
    if fp8:
        codes = [quantize_fp8(r, scale_l) for r in rows]
        cache, tables = _scatter(codes, (L + R,), FP8_DTYPE)
        dense = [dequantize_fp8(c, scale_l, dtype) for c in codes]  # "dequantised to dtype"
    else:
        cache, tables = _scatter([r.bfloat16() for r in rows], (L + R,), torch.bfloat16)
        dense = [r.bfloat16().to(dtype) for r in rows]
    return cache, scale_l, tables, dense


def _indices(k: int, with_holes: bool) -> torch.Tensor:
    idx = torch.full((len(CTX), k), -1, dtype=torch.int64)
    for b, n in enumerate(CTX):
        sel = torch.randperm(n)[: min(k, n) - (1 if with_holes and n > 2 else 0)]
        slots = torch.randperm(k)[: len(sel)] if with_holes else torch.arange(len(sel))
        idx[b, slots] = sel
    return idx


def _oracle(q_lat, q_pe, dense, idx, scale):
    """Per sequence, float64: softmax over the selected tokens' latents, explicitly."""
    out = torch.empty(q_lat.shape, dtype=torch.float64)
    for b, c in enumerate(dense):
        sel = c.double()[idx[b][idx[b] >= 0]]  # [n, L + R]
        logits = (q_lat[b].double() @ sel[:, :L].T + q_pe[b].double() @ sel[:, L:].T) * scale
        p = (logits - logits.amax(-1, keepdim=True)).exp()
        out[b] = (p / p.sum(-1, keepdim=True)) @ sel[:, :L]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("k, holes", [(1, False), (16, False), (16, True), (70, True)])
def test_paged_sparse_mla_decode_matches_oracle(fp8, dtype, k, holes):
    cache, scale_l, tables, dense = _mla_case(fp8, dtype)
    q_lat, q_pe, scale = torch.randn(3, H, L), torch.randn(3, H, R), (L + R) ** -0.5
    idx = _indices(k, holes)
    got = paged_sparse_mla_decode(q_lat, q_pe, cache, scale_l, tables, idx, scale, dtype)
    assert got.shape == (3, H, L) and torch.isfinite(got).all()
    assert rel_rms(got, _oracle(q_lat, q_pe, dense, idx, scale)) < 1e-5
    # -1 entries are ignored: the same as leaving them out. Up to rounding: the batch and the one row
    # without holes have other shapes, so other kernels and summation orders; fp32 softmax-weighted
    # sums of K <= 70 terms round by ~sqrt(K) * 6e-8 ~ 5e-7 each (measured up to 1.9e-7, so 1e-6 was
    # within 5x of one CPU's rounding); as the oracle, 1e-5. Reading a -1 slot (the last token of
    # the page, or a NaN) gives errors of order 0.1, or NaN.
    for b in range(3):
        keep = idx[b : b + 1, idx[b] >= 0]
        one = paged_sparse_mla_decode(q_lat[b : b + 1], q_pe[b : b + 1], cache, scale_l, tables[b : b + 1], keep, scale, dtype)
        assert rel_rms(one, got[b : b + 1]) < 1e-5


def test_paged_sparse_mla_decode_single_token_is_its_latent():
    cache, _, tables, dense = _mla_case(False, torch.float32)
    idx = torch.tensor([[0, -1], [64, -1], [-1, 129]])  # first slot of a second page, last partial slot
    got = paged_sparse_mla_decode(torch.randn(3, H, L), torch.randn(3, H, R), cache, None, tables, idx, 0.2, torch.float32)
    for b, pos in enumerate([0, 64, 129]):
        assert torch.allclose(got[b], dense[b][pos, :L].expand(H, L), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_sparse_mla_decode_all_selected_is_full_attention(fp8):
    """Selecting the whole context = dense absorbed MLA at the last position, as forward_paged uses it:
    q_abs = q_nope . w_kc, then the latent output times w_vc."""
    dn, dv = 16, 12
    cache, scale_l, tables, dense = _mla_case(fp8, torch.float32)
    q_nope, q_pe = torch.randn(3, H, dn), torch.randn(3, H, R)
    w_kc, w_vc = torch.randn(H, dn, L) / 4, torch.randn(H, dv, L) / 4
    scale = (dn + R) ** -0.5
    idx = torch.arange(max(CTX)).expand(3, -1).clone()
    idx[idx >= torch.tensor(CTX).unsqueeze(1)] = -1
    q_abs = torch.einsum("bhd,hdl->bhl", q_nope, w_kc)
    out = paged_sparse_mla_decode(q_abs, q_pe, cache, scale_l, tables, idx, scale, torch.float32)
    got = torch.einsum("bhl,hdl->bhd", out, w_vc)
    for b, c in enumerate(dense):
        mask = torch.ones(1, 1, len(c), dtype=torch.bool)
        args = (q_nope[b][None, None], q_pe[b][None, None], c[None, :, :L], c[None, :, L:], w_kc, w_vc, scale, mask)
        assert rel_rms(got[b], mla_absorbed(*args)[0, 0]) < 1e-5
        assert rel_rms(got[b], mla_expanded(*args)[0, 0]) < 1e-5
