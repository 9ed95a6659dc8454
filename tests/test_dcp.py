"""Decode context parallel attention (kimiserve/distributed/dcp.py) on gloo ranks against one device.

- placement: owner / local / global position and local counts against a brute-force loop;
- the exact top-k merge: on D = 2, 3, 4 ranks, scores rounded to few values (heavy ties), -inf past
  each row's length, rows shorter than k, lengths not dividing by I or D: the selection equals
  `topk_reference` over the whole row bit for bit (order included), and each rank's local positions
  are exactly its own selected tokens;
- `dcp_sparse_decode` through real per-rank `PagePool`s (each rank writes only its tokens with
  `pool.write_mla`; every byte of the pools poisoned with 0xFF = NaN first, page 0 never written and
  used as the block-table padding, the output buffer NaN-filled): bf16, fp8 and fp4 caches; sparse
  (context > k) and dense (context <= k) steps; integer-valued index keys and queries (every score
  exact, so the scores of the local scans equal the single-device scan's bit for bit, and ties
  everywhere) and Gaussian ones. The selection equals the single-device `topk_reference`
  (integer keys: over the single-device pool's own scan; Gaussian keys: over the ranks' local
  scores assembled into the global row, which is what "given bit-identical scores" means when the
  two scans are different matrix products); the output equals the single-device
  scan + top-k + sparse MLA (or dense MLA) within REL_RMS;
- the head exchange with DCP inside TP: tp 2 = dcp 2, tp 3 = dcp 3, tp 4 = dcp 4 and tp 4 = two
  DCP groups of 2 (each rank gets back its own TP shard's heads).

REL_RMS: both sides compute the same logits from the same dequantised latents and queries; they
differ in fp32 rounding only: the logits' dot products (different matrix shapes: |dx| <= (L + R) u
sum |q c| scale, ~1e-6 here), the softmax written as exp(x - lse) against exp(x - max) / sum
(per weight <= (|x - lse| + k) u worst case) and the merge (D exps, a sum of D terms and a division).
Worst case with k <= 160 selected, |x - lse| <= 30 and u = 2^-24 that is ~2e-5 per weight; the
errors are independent over tokens and heads, so the RMS over the output is far below: these tests
measure at most 3.3e-7 (printed with -s), so 1e-5 leaves a margin of 30x for other CPUs and thread
counts while a wrong merge (a dropped or double-counted rank, a mis-scaled partial) moves it by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import tiny_parallel_config
from kimiserve.distributed.dcp import (
    DcpGroup,
    check_interleave,
    dcp_global_position,
    dcp_local_count,
    dcp_local_pages,
    dcp_local_position,
    dcp_local_tokens,
    dcp_merge_all,
    dcp_owner,
    dcp_sparse_decode,
    dcp_topk_merge,
    lse_merge,
)
from kimiserve.ops.indexer.reference import paged_indexer_scores
from kimiserve.ops.mla.reference import paged_dense_mla_decode, paged_sparse_mla_decode, paged_sparse_mla_decode_lse
from kimiserve.ops.topk.reference import topk_reference

REL_RMS = 1e-5
TIMEOUT = 240.0


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ placement
@pytest.mark.parametrize("I,D", [(1, 1), (64, 1), (2, 3), (64, 2), (128, 3), (3, 4), (64, 8)])
def test_placement_against_a_loop(I, D):
    n = 5 * I * D + 7
    owner, local, counts = [], [], [[0] * D]
    seen = [0] * D
    for p in range(n):
        r = (p // I) % D
        owner.append(r)
        local.append(seen[r])  # each rank's tokens in order: its own contiguous sequence
        seen[r] += 1
        counts.append(list(seen))
    pos = torch.arange(n)
    assert dcp_owner(pos, I, D).tolist() == owner
    assert dcp_local_position(pos, I, D).tolist() == local
    assert [dcp_owner(p, I, D) for p in range(n)] == owner and [dcp_local_position(p, I, D) for p in range(n)] == local
    for r in range(D):
        mine = [p for p in range(n) if owner[p] == r]
        lp = torch.arange(len(mine))
        assert dcp_global_position(lp, r, I, D).tolist() == mine
        assert [dcp_global_position(x, r, I, D) for x in range(len(mine))] == mine
        assert dcp_global_position(torch.tensor([-1, 0]), r, I, D).tolist() == [-1, mine[0]]
        lengths = torch.arange(n + 1)
        assert dcp_local_count(lengths, r, I, D).tolist() == [c[r] for c in counts]
        assert [dcp_local_count(L, r, I, D) for L in range(n + 1)] == [c[r] for c in counts]
        assert dcp_local_pages(n, r, I, D, 4) == -(-counts[-1][r] // 4)
        m, lpos = dcp_local_tokens(pos, r, I, D)
        assert m.tolist() == [o == r for o in owner]
        assert lpos.tolist() == [local[p] if owner[p] == r else -1 for p in range(n)]
    # rank 0 always holds the most (the candidate width every rank agrees on)
    for L in range(n + 1):
        assert counts[L][0] == max(counts[L])


def test_check_interleave():
    check_interleave(128, 64, 4)
    with pytest.raises(ValueError, match="multiple of the page size"):
        check_interleave(96, 64, 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_interleave(0)


# ------------------------------------------------------------------------------------------ lse pieces
def _paged_latents(seed: int, kv: str, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    layout = CacheLayout.from_config(tiny_parallel_config(), kv, torch.float32)
    tokens = [torch.randn(n, layout.latent_dim, generator=g).clamp(-4, 4) for n in lens]
    pool, tables = build_pool(layout, tokens, [None] * len(lens), 0.01)
    return pool, tables, g


def test_lse_variant_matches_sparse_decode():
    """Same output as `paged_sparse_mla_decode` (fp32 rounding), lse = logsumexp of the scaled logits,
    and a row selecting nothing gives 0 and -inf even when its padding slot holds NaN."""
    for kv in ("bf16", "fp8", "fp4"):
        pool, tables, g = _paged_latents(1, kv, [70, 5, 200])
        B, H, L, R = 3, 6, 16, 8
        q, qpe = torch.randn(B, H, L, generator=g), torch.randn(B, H, R, generator=g)
        idx = torch.tensor([[3, 69, 0, -1, 17], [4, 2, -1, -1, -1], [199, 150, 64, 63, 1]])
        ls = pool.latent_scales[0] if kv != "bf16" else None
        ref = paged_sparse_mla_decode(q, qpe, pool.latent[0], ls, tables, idx, 0.3, torch.float32)
        out, lse = paged_sparse_mla_decode_lse(q, qpe, pool.latent[0], ls, tables, idx, 0.3, torch.float32)
        assert rel_rms(out, ref) < 1e-6
        c = pool.read_latents(0, torch.gather(tables, 1, idx.clamp_min(0) // pool.block_size),
                              idx.clamp_min(0) % pool.block_size, torch.float32)
        logits = (torch.einsum("bhl,bkl->bhk", q, c[..., :L]) + torch.einsum("bhr,bkr->bhk", qpe, c[..., L:])) * 0.3
        want = torch.logsumexp(logits.masked_fill((idx < 0).unsqueeze(1), float("-inf")), -1)
        assert torch.allclose(lse, want, rtol=1e-6, atol=1e-5)
        none = torch.full((3, 4), -1)
        tables0 = torch.zeros_like(tables)  # page 0: never written, every byte NaN
        out, lse = paged_sparse_mla_decode_lse(q, qpe, pool.latent[0], ls, tables0, none, 0.3, torch.float32)
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


def test_lse_merge_weights():
    """Disjoint token sets merge to the whole set's attention; a partial with lse -inf weighs 0 even when NaN."""
    g = torch.Generator().manual_seed(3)
    logits, v = torch.randn(2, 3, 10, generator=g) * 3, torch.randn(10, 5, generator=g)
    full = torch.softmax(logits, -1) @ v
    parts = [slice(0, 4), slice(4, 10)]
    outs = torch.stack([torch.softmax(logits[..., s], -1) @ v[s] for s in parts])
    lses = torch.stack([torch.logsumexp(logits[..., s], -1) for s in parts])
    assert rel_rms(lse_merge(outs, lses), full) < 1e-6
    outs3 = torch.cat([outs, torch.full((1, 2, 3, 5), float("nan"))])
    lses3 = torch.cat([lses, torch.full((1, 2, 3), float("-inf"))])
    assert rel_rms(lse_merge(outs3, lses3), full) < 1e-6
    nothing = lse_merge(torch.full((2, 1, 1, 5), float("nan")), torch.full((2, 1, 1), float("-inf")))
    assert torch.equal(nothing, torch.zeros_like(nothing))


# ------------------------------------------------------------------------------------------ the top-k merge
def _distribute(scores: torch.Tensor, lens: torch.Tensor, rank: int, I: int, D: int):
    """This rank's local score rows (by local position; garbage past its local lengths) and lengths."""
    S = scores.shape[1]
    n = dcp_local_count(S, rank, I, D)
    gpos = dcp_global_position(torch.arange(n), rank, I, D)
    local = scores[:, gpos] if n else scores[:, :0]
    local_lens = dcp_local_count(lens, rank, I, D)
    junk = torch.arange(n).unsqueeze(0) >= local_lens.unsqueeze(1)
    return local.masked_fill(junk, 1e30), local_lens  # past the length: must never be picked


def topk_merge_rank(rank, world_size, trials):
    import torch.distributed as dist

    dcp = DcpGroup(dist.group.WORLD, rank, world_size)
    failures, checked = [], 0
    for t, (seed, I, k, levels, lens) in enumerate(trials):
        g = torch.Generator().manual_seed(seed)
        lens = torch.tensor(lens)
        S = int(lens.max())
        scores = torch.randint(0, levels, (len(lens), S), generator=g).float() / 2 - 1  # few values: ties
        scores[0, ::7] = 0.0
        scores[-1, 1::3] = -0.0  # signed zeros tie with zeros
        scores = scores.masked_fill(torch.arange(S).unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
        want = topk_reference(scores, k, lens)
        local, local_lens = _distribute(scores, lens, rank, I, world_size)
        for candidates in (None, min(k, max(1, dcp_local_count(S, 0, I, world_size)))):
            sel = dcp_topk_merge(local, local_lens, k, dcp, I, candidates=candidates)
            checked += 1
            if not torch.equal(sel.positions, want):
                failures.append((t, candidates, "positions", sel.positions.tolist(), want.tolist()))
                continue
            mine = (want >= 0) & (dcp_owner(want, I, world_size) == rank)
            expect_local = torch.where(mine, dcp_local_position(want, I, world_size), -1)
            if not torch.equal(sel.local, expect_local):
                failures.append((t, candidates, "local"))
            picked = torch.gather(scores, 1, want.clamp_min(0)).masked_fill(want < 0, float("-inf"))
            if not torch.equal(sel.scores, picked):
                failures.append((t, candidates, "scores"))
    return failures, checked


def _topk_trials(D: int) -> list:
    trials = []
    for i, (I, k) in enumerate([(1, 5), (2, 7), (64, 40), (64, 200), (128, 16), (3, 64)]):
        cycle = I * D
        lens = [1, max(1, k - 1), k, k + 1, 3 * cycle + I // 2 + 1, 2 * cycle - 1, 5 * cycle + 3]
        for levels in (2, 5, 1000):
            trials.append((100 * D + 10 * i + levels, I, k, levels, lens))
    return trials


@pytest.mark.parametrize("D", [2, 3, 4])
def test_topk_merge_is_topk_reference(ranks, D):
    results = ranks.run(D, topk_merge_rank, _topk_trials(D), timeout=TIMEOUT)
    for rank, (failures, checked) in enumerate(results):
        assert checked and not failures, (rank, failures[:3])


# ------------------------------------------------------------------------------------------ the decode step
def build_pool(layout: CacheLayout, latents: list, keys: list, latent_scale: float):
    """A pool holding each sequence's tokens in its own pages (page 0 never written: the tables' padding),
    every byte poisoned with 0xFF (NaN in bf16/fp32/e4m3 codes and scales) before the writes."""
    bs = layout.block_size
    npages = [-(-len(x) // bs) for x in latents]
    pool = PagePool(layout, 1 + sum(npages), latent_scales=[latent_scale] * layout.num_mla_layers)
    pool.data.fill_(255)
    width = max(1, max(npages))
    tables = torch.zeros(len(latents), width, dtype=torch.int64)
    nxt = 1
    for b, (lat, key) in enumerate(zip(latents, keys)):
        tables[b, : npages[b]] = torch.arange(nxt, nxt + npages[b])
        nxt += npages[b]
        if len(lat):
            pos = torch.arange(len(lat))
            pool.write_mla(0, tables[b, pos // bs], pos % bs, lat, key)
    return pool, tables


def make_case(seed: int, lens: list[int], heads: int, keys_kind: str, dtype: torch.dtype):
    cfg = tiny_parallel_config()
    L, R, Hi, Di = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(n, L + R, generator=g).clamp(-4, 4) for n in lens]
    B = len(lens)
    if keys_kind == "ints":  # every score an exact small integer times (fp8) one per-token scale: ties
        keys = [torch.randint(-2, 3, (n, Di), generator=g).float() for n in lens]
        iq = torch.randint(-2, 3, (B, Hi, Di), generator=g).float()
        iw = torch.randint(-1, 3, (B, Hi), generator=g).float()
    else:
        keys = [torch.randn(n, Di, generator=g) for n in lens]
        iq, iw = torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g) * 0.3
    q_abs = torch.randn(B, heads, L, generator=g) * 2
    q_pe = torch.randn(B, heads, R, generator=g).to(dtype)
    return dict(latents=latents, keys=keys, iq=iq, iw=iw, q_abs=q_abs, q_pe=q_pe, scale=cfg.qk_head_dim ** -0.5)


def local_part(case: dict, lens: list[int], rank: int, I: int, D: int):
    lat, key = [], []
    for b, n in enumerate(lens):
        gpos = dcp_global_position(torch.arange(dcp_local_count(n, rank, I, D)), rank, I, D)
        lat.append(case["latents"][b][gpos])
        key.append(case["keys"][b][gpos])
    return lat, key


def decode_rank(rank, world_size, tp, dcp_size, cases):
    from kimiserve.distributed.parallel_state import ParallelConfig, ParallelContext

    ctx = ParallelContext.create(ParallelConfig(tp, False, dcp_size), rank, "cpu")
    D, drank = ctx.dcp_size, ctx.dcp_rank
    report = []
    for name, seed, kv, keys_kind, lens, k, heads, dtype, I_pages in cases:
        layout = CacheLayout.from_config(tiny_parallel_config(), kv, torch.float32,
                                         index_key_rotation=None if keys_kind == "randn" else False)
        I = I_pages * layout.block_size
        case = make_case(seed, lens, heads, keys_kind, dtype)
        lens_t = torch.tensor(lens)
        max_context = max(lens) + 3  # a host bound above the longest, as a CUDA-graph bucket gives
        # the single device
        pool1, tables1 = build_pool(layout, case["latents"], case["keys"], 0.01)
        ls = pool1.latent_scales[0] if kv != "bf16" else None
        scales1 = pool1.index_scale[0] if pool1.index_scale else None
        sparse = max_context > k
        if sparse:
            scores1 = paged_indexer_scores(case["iq"], case["iw"], pool1.index_key[0], scales1, tables1, lens_t, dtype,
                                           max_context, rotation=pool1.index_rotation)
            idx1 = topk_reference(scores1, k, lens_t)
            ref = paged_sparse_mla_decode(case["q_abs"], case["q_pe"], pool1.latent[0], ls, tables1, idx1,
                                          case["scale"], dtype)
        else:
            ref = paged_dense_mla_decode(case["q_abs"], case["q_pe"], pool1.latent[0], ls, tables1, lens_t,
                                         case["scale"], dtype, max_context)
        # every rank's local pools (to assemble the ranks' local scores into global rows: the oracle
        # "topk_reference given the scores the ranks really computed")
        pools = [build_pool(layout, *local_part(case, lens, r, I, D), 0.01) for r in range(D)]
        pool, tables = pools[drank]
        H_l = heads // tp
        mine = slice(ctx.tp_rank * H_l, (ctx.tp_rank + 1) * H_l)
        out = torch.full((len(lens), H_l, layout.latent_dim - case["q_pe"].shape[-1]), float("nan"))
        got, sel = dcp_sparse_decode(case["q_abs"][:, mine], case["q_pe"][:, mine], case["iq"], case["iw"], pool, 0,
                                     tables, lens_t, max_context, k, case["scale"], dtype, ctx, I, out=out,
                                     return_selection=True)
        row = dict(name=name, rank=rank, finite=bool(torch.isfinite(got).all()), same_buffer=got is out,
                   rel_rms=rel_rms(got, ref[:, mine]), sparse=sparse, selection=sel is not None)
        if sparse:
            assembled = torch.full((len(lens), max(lens)), float("-inf"))
            for r, (p, t) in enumerate(pools):
                ll = dcp_local_count(lens_t, r, I, D)
                n = dcp_local_count(max(lens), r, I, D)
                if n == 0:
                    continue
                s = paged_indexer_scores(case["iq"], case["iw"], p.index_key[0],
                                         p.index_scale[0] if p.index_scale else None, t, ll.clamp_min(1), dtype, n,
                                         rotation=p.index_rotation)
                s = s.masked_fill((ll == 0).unsqueeze(1), float("-inf"))
                assembled[:, dcp_global_position(torch.arange(n), r, I, D)] = s
            row["equals_assembled_topk"] = torch.equal(sel.positions, topk_reference(assembled, k, lens_t))
            row["equals_single_device_topk"] = torch.equal(sel.positions, idx1)
            visible = torch.arange(max(lens)).unsqueeze(0) < lens_t.unsqueeze(1)
            row["scores_bit_identical"] = torch.equal(assembled[visible], scores1[:, : max(lens)][visible])
            owned = (idx1 >= 0) & (dcp_owner(idx1, I, D) == drank)
            row["local_ok"] = torch.equal(sel.local, torch.where(owned, dcp_local_position(idx1, I, D), -1))
            row["ties"] = sum(n - len(set(scores1[b, :n].tolist())) for b, n in enumerate(lens))
        report.append(row)
    return report


def _decode_cases(D: int, tp: int) -> list:
    """(name, seed, kv, keys, lens, k, heads, dtype, interleave in pages)."""
    heads = 12  # divides by 2, 3 and 4
    cases = []
    for j, kv in enumerate(("bf16", "fp8", "fp4")):
        bs = CacheLayout.from_config(tiny_parallel_config(), kv, torch.float32).block_size
        cycle = bs * D
        lens = [1, 37, bs + 5, 2 * cycle + bs // 3 + 1, 3 * cycle - 7]  # none divides by I or D
        for keys in ("ints", "randn"):
            cases.append((f"{kv}-{keys}-sparse", 10 * D + j, kv, keys, lens, 48, heads, torch.float32, 1))
        # dense: every context <= k (the batch bound too), tokens on every rank
        cases.append((f"{kv}-dense", 20 * D + j, kv, "randn", [1, bs + 1, cycle - 3, cycle + 2], cycle + 5, heads,
                      torch.float32, 1))
    # a bf16 model dtype and an interleave of two pages, k above a rank's interleave
    bs = CacheLayout.from_config(tiny_parallel_config(), "fp8", torch.float32).block_size
    cases.append(("fp8-ints-bf16model-I2", 77, "fp8", "ints", [2, 3 * bs, 4 * bs * D + 11, 5 * bs * D - 1], 300, heads,
                  torch.bfloat16, 2))
    return cases


def _check_decode(results, tp: int, dcp: int):
    worst = 0.0
    for report in results:
        for row in report:
            assert row["finite"] and row["same_buffer"], row
            assert row["rel_rms"] < REL_RMS, row
            worst = max(worst, row["rel_rms"])
            assert row["selection"] == row["sparse"], row
            if row["sparse"]:
                assert row["equals_assembled_topk"] and row["local_ok"], row
                if "ints" in row["name"]:  # exact scores: the local scans equal the single device's
                    assert row["scores_bit_identical"] and row["equals_single_device_topk"], row
                    assert row["ties"] > 0, row
    print(f"tp {tp} dcp {dcp}: largest rel RMS against one device {worst:.2e} (bound {REL_RMS:.0e})")


@pytest.mark.parametrize("D", [2, 3, 4])
def test_dcp_decode_equals_one_device(ranks, D):
    """tp = dcp = D: each rank holds 12 / D heads, the whole TP group is the DCP group."""
    results = ranks.run(D, decode_rank, D, D, _decode_cases(D, D), timeout=TIMEOUT)
    _check_decode(results, D, D)


def test_dcp_inside_tp_groups(ranks):
    """tp 4 with dcp 2: two DCP groups of two ranks each ({0, 1}, {2, 3}), each holding every token over
    its two ranks; a rank gets back its own 3 heads of 12."""
    cases = [c for c in _decode_cases(2, 4) if c[2] in ("fp8", "fp4") or "I2" in c[0]]
    results = ranks.run(4, decode_rank, 4, 2, cases, timeout=TIMEOUT)
    _check_decode(results, 4, 2)


def test_single_rank_is_the_single_device_path():
    """D = 1 runs in-process without torch.distributed: the same output and selection as one device."""
    for kv in ("bf16", "fp8"):
        layout = CacheLayout.from_config(tiny_parallel_config(), kv, torch.float32)
        lens = [1, 100, 301]
        case = make_case(5, lens, 6, "randn", torch.float32)
        pool, tables = build_pool(layout, case["latents"], case["keys"], 0.01)
        lens_t = torch.tensor(lens)
        ls = pool.latent_scales[0] if kv != "bf16" else None
        scales = pool.index_scale[0] if pool.index_scale else None
        scores = paged_indexer_scores(case["iq"], case["iw"], pool.index_key[0], scales, tables, lens_t,
                                      torch.float32, 301)
        idx = topk_reference(scores, 32, lens_t)
        ref = paged_sparse_mla_decode(case["q_abs"], case["q_pe"], pool.latent[0], ls, tables, idx, case["scale"],
                                      torch.float32)
        got, sel = dcp_sparse_decode(case["q_abs"], case["q_pe"], case["iq"], case["iw"], pool, 0, tables, lens_t, 301,
                                     32, case["scale"], torch.float32, DcpGroup.single(), layout.block_size,
                                     return_selection=True)
        assert torch.equal(sel.positions, idx) and torch.equal(sel.local, idx)
        assert rel_rms(got, ref) < REL_RMS
        merged = dcp_merge_all(got, torch.zeros(got.shape[:2]), DcpGroup.single())
        assert torch.equal(merged, got)

