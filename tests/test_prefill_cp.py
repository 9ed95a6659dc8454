"""Token-sharded prefill (`kimiserve.distributed.prefill_cp`): KDA state passing, the conv halo, MLA and
the indexer over gathered latents, and where the pages go, on gloo ranks (conftest's `ranks`), against the
single-device forms.

Bounds. The sharded forms compute the same sums as the single-device ones in another order: the
chunked KDA kernel starts its 64-token chunks at b_r instead of 0, and the fold adds A S_start + E
where one pass carries the state; MLA runs the same per-row attention over [rows, context] blocks of
other shapes. Both sides are fp32 with inputs of unit scale, so each differs from the exact (fp64)
result by some ulps of fp32 (2^-24 ~ 6e-8) grown by sums of <= 64 terms and a triangular solve of 64
rows: measured here ~1e-7 relative RMS. The tests bound the sharded result by the single-device
fp32 result's own distance from fp64 (a few times it, with a 2e-6 floor: ~30 ulps), never by one
BLAS's blocking. Selections are compared exactly where the scores are exact (integer inputs: every
product and sum is exact in fp32, whatever the order: so ties are many, and the tie rule is tested),
and at random weights on the rows whose k-th and (k+1)-th best scores are apart by more than any
rounding (every row, in practice).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_rms
from kimiserve.distributed.prefill_cp import (
    CommStats,
    PrefillShard,
    dcp_local_slot,
    dcp_owner,
    fold_states,
    kda_chunk_summary,
    kda_transition,
    store_plan,
)
from kimiserve.ops.conv.reference import causal_conv1d
from kimiserve.ops.indexer.reference import indexer_scores
from kimiserve.ops.kda.reference import chunk_kda, recurrent_kda
from kimiserve.ops.mla.reference import mla_absorbed
from kimiserve.ops.norm.reference import l2_normalize
from kimiserve.ops.topk.reference import causal_topk, selection_mask

H, K, V, W = 4, 16, 16, 4  # the tiny preset's KDA: 4 heads x 16, conv kernel 4
PD = H * K


def pack(obj) -> bytes:
    """A rank's result as bytes: tensors through the result queue would be shared by file descriptor,
    which dies with the rank's process."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(results: list) -> list:
    return [torch.load(io.BytesIO(b)) for b in results]


def fp32_bound(single_err: float) -> float:
    """What the sharded fp32 result may differ from the single-device fp32 one by (see the module doc)."""
    return max(4 * single_err, 2e-6)


# -------------------------------------------------------------------------------------------------
# inputs
# -------------------------------------------------------------------------------------------------
def kda_case(T: int, seed: int, prefix: bool, dtype=torch.float32) -> dict:
    """Random pre-conv KDA inputs at the tiny model's sizes; weak decays (g in (-0.25, 0), the random
    model's range is similar), so the state carried across chunk boundaries matters."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    case = dict(
        x=r(1, T, 3 * PD),  # pre-conv q | k | v projections
        w=(torch.rand(3, PD, W, generator=gen, dtype=torch.float64) * 2 - 1) * W ** -0.5,
        g=-0.25 * torch.sigmoid(r(1, T, H, K) - 1),
        beta=torch.sigmoid(r(1, T, H)),
        conv_state=r(1, 3, PD, W - 1) if prefix else None,
        state=r(1, H, K, V) * 0.5 if prefix else None,
    )
    return {k: (v.to(dtype) if v is not None else None) for k, v in case.items()}


def conv_qkv(x, w, start_state):
    """The short conv + SiLU + L2 norm of KDA (as `KimiDeltaAttention.short_conv`)."""
    B, T, _ = x.shape
    if T == 0:  # an empty chunk
        e = x.new_empty(B, 0, H, K)
        return e, e, e, None
    xs = x.split(PD, dim=-1)
    cs = (None,) * 3 if start_state is None else start_state.unbind(1)
    outs, states = zip(*(causal_conv1d(xs[i], w[i], cs[i]) for i in range(3)))
    q, k, v = (o.view(B, T, H, K) for o in outs)
    return l2_normalize(q), l2_normalize(k), v, torch.stack(states, dim=1)


def kda_single(case, dtype):
    c = {k: (v.to(dtype) if v is not None else None) for k, v in case.items()}
    q, k, v, conv = conv_qkv(c["x"], c["w"], c["conv_state"])
    o, S = chunk_kda(q, k, v, c["g"], c["beta"], initial_state=c["state"])
    return o, S, conv


# -------------------------------------------------------------------------------------------------
# one process: the recurrence form, the summary, the fold, the layout helpers
# -------------------------------------------------------------------------------------------------
def test_recurrence_is_the_affine_form_and_the_summary_holds_it():
    """recurrent_kda's step is S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    (K x V state, the decay on the K rows, applied before the delta rule reads S; o_t = S_t^T q_t / sqrt(K)
    after the update), and the fused summary pass returns its transition and zero-start end state."""
    torch.manual_seed(1)
    B, T, dt = 2, 70, torch.float64  # 70: two kernel chunks, the second partial
    q = F.normalize(torch.randn(B, T, H, K, dtype=dt), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dt), dim=-1)
    v, S0 = torch.randn(B, T, H, V, dtype=dt), torch.randn(B, H, K, V, dtype=dt)
    g, beta = -0.1 * torch.rand(B, T, H, K, dtype=dt), torch.rand(B, T, H, dtype=dt)
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, initial_state=S0)
    eye = torch.eye(K, dtype=dt)
    S, A, E, o = S0.clone(), eye.expand(B, H, K, K), torch.zeros_like(S0), []
    for t in range(T):
        kk = k[:, t, :, :, None] * k[:, t, :, None, :]
        M = (eye - beta[:, t, :, None, None] * kk) @ torch.diag_embed(torch.exp(g[:, t]))
        kv = beta[:, t, :, None, None] * k[:, t, :, :, None] * v[:, t, :, None, :]
        S, A, E = M @ S + kv, M @ A, M @ E + kv
        o.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * K ** -0.5)
    assert rel_rms(S, S_ref) < 1e-14 and rel_rms(torch.stack(o, 1), o_ref) < 1e-14
    assert rel_rms(A @ S0 + E, S_ref) < 1e-14 and rel_rms(A, eye) > 0.1  # the decays are weak: A matters
    summary = kda_chunk_summary(q, k, v, g, beta)
    assert rel_rms(summary.transition, A) < 1e-13 and rel_rms(summary.end_from_zero, E) < 1e-13
    assert rel_rms(kda_transition(k, g, beta), A) < 1e-13
    # the single-pass correction: o_t = o0_t + S0^T r_t
    corrected = summary.o_from_zero + torch.einsum("bthk,bhkv->bthv", summary.readout, S0)
    assert rel_rms(corrected, o_ref) < 1e-13
    empty = kda_chunk_summary(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0])
    assert torch.equal(empty.transition, eye.expand(B, H, K, K)) and not empty.end_from_zero.any()


def test_fold_of_chunk_summaries_equals_one_pass_in_one_process():
    """The algebra without collectives: per-chunk (A, E) folded in order, then each chunk recomputed
    from its start state, equals one chunked pass (fp32 within the fp32 rounding of the single pass)."""
    case = kda_case(150, seed=3, prefix=True)
    o64, S64, _ = kda_single(case, torch.float64)
    o32, S32, _ = kda_single(case, torch.float32)
    q, k, v, _ = conv_qkv(case["x"], case["w"], case["conv_state"])  # the conv over the whole prompt
    bounds = [0, 7, 70, 71, 150]  # a 1-token chunk; chunks that straddle the kernel's 64-token chunks
    parts = [kda_chunk_summary(*(t[:, a:b] for t in (q, k, v, case["g"], case["beta"]))) for a, b in zip(bounds, bounds[1:])]
    starts = fold_states([p.transition for p in parts], [p.end_from_zero for p in parts], case["state"])
    outs = [chunk_kda(*(t[:, a:b] for t in (q, k, v, case["g"], case["beta"])), initial_state=starts[i])[0]
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    e_o, e_S = rel_rms(o32, o64), rel_rms(S32, S64)
    assert rel_rms(torch.cat(outs, 1), o32) <= fp32_bound(e_o)
    assert rel_rms(starts[-1], S32) <= fp32_bound(e_S)
    assert rel_rms(starts[2], chunk_kda(q[:, :70], k[:, :70], v[:, :70], case["g"][:, :70], case["beta"][:, :70],
                                        initial_state=case["state"])[1]) <= 2e-6


def test_size_one_is_the_plain_path():
    """World size 1 (group None): the KDA path is the one kernel call, the collectives identities."""
    case = kda_case(45, seed=4, prefix=True)
    q, k, v, conv = conv_qkv(case["x"], case["w"], case["conv_state"])
    from kimiserve.distributed.prefill_cp import conv_halo, kda_conv_halo, kda_prefill_cp, mla_prefill_cp

    stats = CommStats()
    shard = PrefillShard((0, 45), stats=stats)
    res = kda_prefill_cp(q, k, v, case["g"], case["beta"], shard, case["state"])
    o, S = chunk_kda(q, k, v, case["g"], case["beta"], initial_state=case["state"])
    assert torch.equal(res.o, o) and torch.equal(res.final_state, S) and torch.equal(res.start_state, case["state"])
    start, final = kda_conv_halo(*case["x"].split(PD, dim=-1), shard, W, case["conv_state"])
    assert torch.equal(start, case["conv_state"]) and torch.equal(final, conv)
    assert conv_halo(case["x"][:, :0], PrefillShard((0, 0)), W)[1].shape == (1, 3 * PD, W - 1)
    m = mla_case(20, (0, 20), seed=6, integer=False)
    got = mla_prefill_cp(m["q_nope"], m["q_pe"], m["latent"], m["w_kc"], m["w_vc"], m["scale"], shard=PrefillShard((0, 20)),
                         index_keys=m["keys"], index_q=m["iq"], index_w=m["iw"], topk=m["topk"], max_score_bytes=4000)
    o32, idx = mla_single(m)
    assert torch.equal(got.indices, idx) and rel_rms(got.o, o32) <= 2e-6 and torch.isfinite(got.o).all()
    assert not stats.calls


def test_shard_split_and_store_plan():
    s = PrefillShard.split(5, 55, 3, rank=2, group=object())
    assert s.bounds == (5, 22, 39, 55) and s.lengths == [17, 17, 16] and (s.start, s.end) == (39, 55)
    with pytest.raises(ValueError, match="non-decreasing"):
        PrefillShard((0, 5, 3), 0, object())
    with pytest.raises(ValueError, match="needs its process group"):
        PrefillShard((0, 5, 9), 1)
    p, slots = store_plan(3, 40)
    assert torch.equal(p, torch.arange(3, 40)) and torch.equal(slots, p)
    D, I, T = 3, 4, 61
    seen = []
    for d in range(D):
        p, slots = store_plan(0, T, D, d, I)
        assert all((int(x) // I) % D == d for x in p)
        assert torch.equal(slots, torch.arange(len(p)))  # a rank's tokens fill its slots 0, 1, 2, ... in order
        assert torch.equal(slots, dcp_local_slot(p, D, I))
        seen += p.tolist()
        part, part_slots = store_plan(10, 33, D, d, I)  # a chunk of the prompt keeps the same slots
        assert torch.equal(part_slots, slots[(p >= 10) & (p < 33)])
    assert sorted(seen) == list(range(T))
    assert torch.equal(dcp_owner(torch.tensor([0, 3, 4, 11, 12]), D, I), torch.tensor([0, 0, 1, 2, 0]))


# -------------------------------------------------------------------------------------------------
# on gloo ranks: the ops
# -------------------------------------------------------------------------------------------------
def ops_rank(rank, world_size, kda_cases, mla_cases, redist):
    import torch.distributed as dist

    from kimiserve.distributed import prefill_cp as cp

    group = dist.group.WORLD
    out = {"kda": [], "mla": [], "redist": []}
    for case, bounds in kda_cases:
        row = {}
        for mode in ("recompute", "correct"):
            stats = cp.CommStats()
            shard = cp.PrefillShard(tuple(bounds), rank, group, stats)
            a, b = shard.start - bounds[0], shard.end - bounds[0]
            x = case["x"][:, a:b]
            start_conv, final_conv = cp.kda_conv_halo(*x.split(PD, dim=-1), shard, W, case["conv_state"])
            q, k, v, _ = conv_qkv(x, case["w"], start_conv)
            res = cp.kda_prefill_cp(q, k, v, case["g"][:, a:b], case["beta"][:, a:b], shard, case["state"], mode=mode)
            row[mode] = dict(o=res.o, end=res.chunk_end_state, final=res.final_state, conv=final_conv,
                             start_conv=start_conv, calls=stats.calls, sent=stats.sent, received=stats.received)
        out["kda"].append(row)
    for case in mla_cases:
        stats = cp.CommStats()
        shard = cp.PrefillShard(tuple(case["bounds"]), rank, group, stats)
        a, b = shard.start - case["bounds"][0], shard.end - case["bounds"][0]
        c0 = case["bounds"][0]
        res = cp.mla_prefill_cp(
            case["q_nope"][:, a:b], case["q_pe"][:, a:b], case["latent"][:, c0 + a:c0 + b], case["w_kc"], case["w_vc"],
            case["scale"], shard, index_keys=case["keys"][:, c0 + a:c0 + b], index_q=case["iq"][:, a:b],
            index_w=case["iw"][:, a:b], topk=case["topk"], context_latent=case["latent"][:, :c0] if c0 else None,
            context_keys=case["keys"][:, :c0] if c0 else None, max_score_bytes=case["max_score_bytes"])
        out["mla"].append(dict(o=res.o, indices=res.indices, latent=res.latent, keys=res.index_keys,
                               sent=stats.sent, calls=stats.calls))
    for rows, chunks, holders, D, I in redist:
        stats = cp.CommStats()
        lo, hi = chunks[rank]
        got = cp.redistribute_tokens(rows[lo:hi], chunks, holders, D, I, group, stats)
        out["redist"].append(dict(positions=got.positions, slots=got.slots, rows=got.rows, sent=stats.sent,
                                  received=stats.received))
    return pack(out)


def mla_case(T: int, bounds, seed: int, integer: bool, topk: int = 8, max_score_bytes: int = 1 << 20) -> dict:
    """MLA inputs at the tiny model's sizes (4 heads, nope 16, rope 8, latent 32, v 16; indexer 4 x 16).
    integer: index queries, keys and weights small integers, so every score is exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    n = bounds[-1]  # context + prompt
    if integer:
        ri = lambda *s: torch.randint(-1, 2, s, generator=gen).float()
        iq, keys, iw = ri(1, T, 4, 16), ri(1, n, 16), torch.randint(0, 2, (1, T, 4), generator=gen).float()
    else:
        iq, keys, iw = r(1, T, 4, 16), r(1, n, 16), r(1, T, 4).abs()
    return dict(bounds=list(bounds), q_nope=r(1, T, 4, 16), q_pe=r(1, T, 4, 8), latent=r(1, n, 40), w_kc=r(4, 16, 32) * 0.2,
                w_vc=r(4, 16, 32) * 0.2, scale=24 ** -0.5, keys=keys, iq=iq, iw=iw, topk=topk,
                max_score_bytes=max_score_bytes)


def mla_single(case, dtype=torch.float32):
    """The full-sequence form: every prompt query over the whole context."""
    c0, n = case["bounds"][0], case["bounds"][-1]
    cv = lambda t: t.to(dtype)
    pos = torch.arange(c0, n)
    idx = causal_topk(indexer_scores(cv(case["iq"]), cv(case["keys"]), cv(case["iw"])), pos, case["topk"])
    lat = cv(case["latent"])
    o = mla_absorbed(cv(case["q_nope"]), cv(case["q_pe"]), lat[..., :32], lat[..., 32:], cv(case["w_kc"]), cv(case["w_vc"]),
                     case["scale"], selection_mask(idx, n))
    return o, idx


KDA_CASES = {
    2: [(37, (0, 19, 37), False), (41, (0, 2, 41), True)],  # 37 / 2; a 2-token chunk (< W-1 = 3) after a prefix
    3: [(50, (0, 17, 34, 50), True), (40, (5, 7, 8, 45), True), (30, (0, 12, 12, 30), False)],  # 50 / 3; chunks of
    # 2 and 1 tokens (rank 2's halo reaches back into the restored conv state); an empty chunk
}


def run_ops(ranks, P: int):
    kda = [(kda_case(T, seed=10 + i, prefix=pre), b) for i, (T, b, pre) in enumerate(KDA_CASES[P])]
    mla = [mla_case(23 if P == 2 else 32, (0, 12, 23) if P == 2 else (0, 11, 22, 32), seed=20, integer=True),
           mla_case(27, (6, 20, 33) if P == 2 else (6, 15, 24, 33), seed=21, integer=False, max_score_bytes=2000),
           mla_case(7, (0, 4, 7) if P == 2 else (0, 1, 4, 7), seed=22, integer=False, topk=16)]  # context <= k: all
    T = 29
    rows = torch.randn(T, 2, 5)  # e.g. two layers' rows of 5 values
    chunks = [(0, 15), (15, 29)] if P == 2 else [(0, 10), (10, 11), (11, 29)]
    holders = [[0, 0], [1, None]] if P == 2 else [[0, 1, 0], [None, 0, 0]]
    redist = [(rows, chunks, holders[0], 1 if P == 2 else 2, 4), (rows, chunks, holders[1], 2, 3)]
    return dict(kda=kda, mla=mla, redist=redist, results=unpack(ranks.run(P, ops_rank, kda, mla, redist)))


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def ops(request, ranks):
    return request.param, run_ops(ranks, request.param)


def test_kda_sharded_prefill_equals_single_device(ops):
    P, run = ops
    for i, (case, bounds) in enumerate(run["kda"]):
        o64, S64, conv64 = kda_single(case, torch.float64)
        o32, S32, conv32 = kda_single(case, torch.float32)
        e_o, e_S = rel_rms(o32, o64), rel_rms(S32, S64)
        assert e_o < 1e-6 and e_S < 1e-6
        # ignoring the carried state would be far off: the test has teeth
        q, k, v, _ = conv_qkv(case["x"], case["w"], case["conv_state"])
        b1 = bounds[1] - bounds[0]
        zero_start = chunk_kda(*(t[:, b1:] for t in (q, k, v, case["g"], case["beta"])))[0]
        assert rel_rms(zero_start, o32[:, b1:]) > 0.05
        for mode in ("recompute", "correct"):
            ranks = [r["kda"][i][mode] for r in run["results"]]
            o = torch.cat([r["o"] for r in ranks], dim=1)
            assert o.shape == o32.shape and torch.isfinite(o).all(), (P, i, mode)
            assert rel_rms(o, o32) <= fp32_bound(e_o), (P, i, mode, rel_rms(o, o32), e_o)
            assert rel_rms(o, o64) <= fp32_bound(e_o) + e_o
            for r, rk in enumerate(ranks):  # every rank: the same final state, bitwise; the state at b_{r+1}
                assert torch.equal(rk["final"], ranks[0]["final"])
                hi = bounds[r + 1] - bounds[0]
                S_at = chunk_kda(*(t[:, :hi] for t in (q, k, v, case["g"], case["beta"])), initial_state=case["state"])[1]
                assert rel_rms(rk["end"], S_at) <= fp32_bound(e_S), (P, i, mode, r)
                assert torch.equal(rk["conv"], conv32)  # the conv state left for decode: exact (a copy of inputs)
            assert rel_rms(ranks[-1]["final"], S32) <= fp32_bound(e_S)
            assert rel_rms(ranks[-1]["end"], S32) <= fp32_bound(e_S)


def test_conv_halo_is_exact(ops):
    """Each rank's start conv state is the W-1 pre-conv inputs before its chunk, exactly (from earlier
    chunks, or from the restored conv state when the chunks before it are shorter than W-1)."""
    P, run = ops
    for i, (case, bounds) in enumerate(run["kda"]):
        cs = case["conv_state"] if case["conv_state"] is not None else torch.zeros(1, 3, PD, W - 1)
        seq = torch.cat([cs, case["x"].view(1, -1, 3, PD).permute(0, 2, 3, 1)], dim=-1)  # [1, 3, PD, W-1+T]
        for r, res in enumerate(run["results"]):
            a = bounds[r] - bounds[0]
            assert torch.equal(res["kda"][i]["recompute"]["start_conv"], seq[..., a:a + W - 1]), (P, i, r)


def test_kda_traffic_is_one_state_gather_and_one_halo_per_layer(ops):
    P, run = ops
    for i, (case, bounds) in enumerate(run["kda"]):
        for res in run["results"]:
            st = res["kda"][i]["recompute"]
            assert st["calls"] == {"conv_halo": 1, "kda_state": 1}
            assert st["sent"]["kda_state"] == (P - 1) * H * K * (K + V) * 4 == st["received"]["kda_state"]
            assert st["sent"]["conv_halo"] == (P - 1) * 3 * PD * (W - 1) * 4


def test_mla_over_gathered_latents_equals_full_sequence(ops):
    P, run = ops
    for i, case in enumerate(run["mla"]):
        o32, idx = mla_single(case)
        o64, idx64 = mla_single(case, torch.float64)
        got_o = torch.cat([r["mla"][i]["o"] for r in run["results"]], dim=1)
        got_idx = torch.cat([r["mla"][i]["indices"] for r in run["results"]], dim=1)
        assert torch.isfinite(got_o).all()
        if i == 0:  # integer scores: exact in any order, many ties: the sets AND their order are identical
            assert torch.equal(got_idx, idx)
            scores = indexer_scores(case["iq"], case["keys"], case["iw"])
            pos = torch.arange(scores.shape[1])
            top = scores.masked_fill(pos.view(1, 1, -1) > pos.view(1, -1, 1), float("-inf")).sort(-1, True).values
            k = case["topk"]
            assert (top[..., k - 1] == top[..., k]).sum() >= 5  # ties at the k-th place: the tie rule decides
        else:
            assert torch.equal(got_idx, idx64)  # random scores, fp32 in both: ...
            assert torch.equal(got_idx, idx)
        if i == 2:
            assert (idx >= 0).sum(-1).tolist() == [list(range(1, 8))]  # context <= k: every visible token
        e = rel_rms(o32, o64)
        assert rel_rms(got_o, o32) <= fp32_bound(e) and e < 1e-6, (i, rel_rms(got_o, o32), e)
        n = case["bounds"][-1]
        for r in run["results"]:  # every rank got every token's latent and index key (context too), exactly
            assert torch.equal(r["mla"][i]["latent"], case["latent"][:, :n])
            assert torch.equal(r["mla"][i]["keys"], case["keys"][:, :n])


def test_mla_gather_bytes(ops):
    P, run = ops
    for i, case in enumerate(run["mla"]):
        b = case["bounds"]
        longest = max(y - x for x, y in zip(b, b[1:]))
        for r in run["results"]:
            assert r["mla"][i]["calls"] == {"mla_tokens": 1}  # latent and index key in one all-gather
            assert r["mla"][i]["sent"]["mla_tokens"] == (P - 1) * longest * (40 + 16) * 4


def test_redistribution_in_one_all_to_all(ops):
    P, run = ops
    for j, (rows, chunks, holders, D, I) in enumerate(run["redist"]):
        T = rows.shape[0]
        for g, res in enumerate(run["results"]):
            got = res["redist"][j]
            if holders[g] is None:
                assert got["positions"].numel() == 0
                continue
            want, slots = store_plan(0, T, D, holders[g], I)
            assert torch.equal(got["positions"], want) and torch.equal(got["slots"], slots)
            assert torch.equal(got["rows"], rows[want])
            lo, hi = chunks[g]
            others = [p for p in want.tolist() if not lo <= p < hi]
            assert got["received"]["redistribute"] == len(others) * 10 * 4


# -------------------------------------------------------------------------------------------------
# on gloo ranks: the tiny model's layers
# -------------------------------------------------------------------------------------------------
def kda_layer_forward(layer, x, mix):
    """`KimiDeltaAttention.forward` with its `mix` step replaced (the projections, the gate, the output
    norm and o_proj as the layer does them); returns (output, conv state, recurrent state)."""
    from kimiserve.ops.kda.reference import kda_gate
    from kimiserve.ops.norm.reference import gated_rms_norm
    from kimiserve.ops.pointwise import vector_sigmoid

    B, T, _ = x.shape
    heads = lambda t: t.view(B, T, layer.num_heads, layer.head_dim)
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    g = kda_gate(heads(layer.f_b_proj(layer.f_a_proj(x))), layer.A_log, layer.dt_bias, layer.lower_bound)
    beta = vector_sigmoid(layer.b_proj(x).float())
    o, conv, state = mix(q, k, v, g, beta)
    o = gated_rms_norm(o, heads(layer.output_gate(x)), layer.o_norm.weight, layer.eps)
    return layer.o_proj(o.reshape(B, T, -1)), conv, state


@torch.no_grad()
def random_init(module: torch.nn.Module, seed: int) -> None:
    """Random weights of the scales `kimiserve.model.model.init_random_weights` draws for a whole model."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        shape = tuple(param.shape)
        u = torch.rand(shape, generator=gen, dtype=torch.float64)
        n = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name.endswith("A_log"):
            value = torch.log(u * 15 + 1)
        elif name.endswith("dt_bias"):
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif "conv1d" in name:
            value = (u * 2 - 1) * shape[-1] ** -0.5
        elif name.endswith("k_norm.bias"):
            value = n * 0.05
        elif len(shape) == 1:  # norm gains
            value = 1 + n * 0.05
        else:  # [out, in] projections
            value = n * shape[-1] ** -0.5
        param.copy_(value)


def build_layers(seed: int):
    from kimiserve.config import load_preset
    from kimiserve.model.kda import KimiDeltaAttention
    from kimiserve.model.mla import MLAAttention

    config = load_preset("tiny")
    kda, mla = KimiDeltaAttention(config, torch.float32), MLAAttention(config, torch.float32)
    random_init(kda, seed)
    random_init(mla, seed + 1)
    return kda.eval(), mla.eval()


def layers_rank(rank, world_size, state_dicts, x_kda, prefix, x_mla, ctx_x):
    from kimiserve.distributed import prefill_cp as cp
    from kimiserve.distributed.parallel_state import ParallelConfig, ParallelContext

    pc = ParallelContext.create(ParallelConfig(prefill_context_parallel_size=world_size), rank, "cpu")
    kda, mla = build_layers(0)
    kda.load_state_dict(state_dicts[0])
    mla.load_state_dict(state_dicts[1])
    out = {}
    with torch.inference_mode():
        for name, conv_state, state in (("zero", None, None), ("prefix", *prefix)):
            shard = cp.PrefillShard.from_context(pc, 0, x_kda.shape[1])
            x = x_kda[:, shard.start:shard.end]
            mix = lambda q, k, v, g, beta: cp.kda_mix_cp(kda, q, k, v, g, beta, shard, conv_state, state)
            out["kda_" + name] = kda_layer_forward(kda, x, mix)
        c0 = ctx_x.shape[1]
        for name, ctx in (("zero", None), ("prefix", ctx_x)):
            b0 = 0 if ctx is None else c0
            shard = cp.PrefillShard.from_context(pc, b0, b0 + x_mla.shape[1])
            x = x_mla[:, shard.start - b0:shard.end - b0]
            kw = {}
            if ctx is not None:
                c, k_pe = mla.latent(ctx)
                kw = dict(context_latent=torch.cat([c, k_pe], -1), context_keys=mla.indexer.keys(ctx))
            y, res = cp.mla_layer_prefill_cp(mla, x, shard, **kw)
            out["mla_" + name] = (y, res.indices)
    return pack(out)


def test_tiny_layers_token_sharded_equal_their_full_sequence_forward(ranks):
    """One KDA layer and one MLA layer of the tiny model (fp32, random weights): the token-sharded
    forward over P = 3 ranks (prompt 44 = 15 + 15 + 14; from zero and from a restored prefix) equals
    the layer's full-sequence forward within fp32 rounding, with identical top-k selections."""
    P = 3
    kda, mla = build_layers(0)
    gen = torch.Generator().manual_seed(5)
    x_kda = torch.randn(1, 44, 64, generator=gen)
    prefix = (torch.randn(1, 3, PD, W - 1, generator=gen), torch.randn(1, H, K, V, generator=gen) * 0.3)
    x_mla, ctx_x = torch.randn(1, 44, 64, generator=gen), torch.randn(1, 9, 64, generator=gen)
    results = unpack(ranks.run(P, layers_rank, (kda.state_dict(), mla.state_dict()), x_kda, prefix, x_mla, ctx_x))
    with torch.inference_mode():
        # KDA: from zero (against forward itself) and from a prefix-cache restore (against mix from it)
        full, conv, state = kda_layer_forward(kda, x_kda, kda.mix)
        assert torch.equal(full, kda(x_kda))  # the helper is the layer's forward
        kda64 = build_layers(0)[0].double()
        kda64.load_state_dict(kda.state_dict())
        for name, cs, st in (("zero", None, None), ("prefix", *prefix)):
            ref = kda_layer_forward(kda, x_kda, lambda *a: kda.mix(*a, conv_state=cs, state=st))
            ref64 = kda_layer_forward(kda64, x_kda.double(), lambda *a: kda64.mix(
                *a, conv_state=None if cs is None else cs.double(), state=None if st is None else st.double()))
            got = torch.cat([r["kda_" + name][0] for r in results], dim=1)
            assert torch.isfinite(got).all()
            e = rel_rms(ref[0], ref64[0])
            assert rel_rms(got, ref[0]) <= fp32_bound(e), (name, rel_rms(got, ref[0]), e)
            for r in results:
                assert torch.equal(r["kda_" + name][1], ref[1])  # the conv state for decode
                assert rel_rms(r["kda_" + name][2], ref[2]) <= fp32_bound(rel_rms(ref[2], ref64[2]))
        # MLA: the full-sequence forward, from zero and after 9 cached tokens
        for name, xs in (("zero", x_mla), ("prefix", torch.cat([ctx_x, x_mla], dim=1))):
            full = mla(xs)[:, -44:]
            got = torch.cat([r["mla_" + name][0] for r in results], dim=1)
            assert torch.isfinite(got).all()
            mla64 = build_layers(0)[1].double()
            mla64.load_state_dict(mla.state_dict())
            e = rel_rms(full, mla64(xs.double())[:, -44:])
            assert e < 1e-6  # fp64 selected the same tokens: e is the fp32 rounding alone
            assert rel_rms(got, full) <= fp32_bound(e), (name, rel_rms(got, full), e)
            # selections: the layer's own indexer over the whole sequence
            iq, iw = mla.indexer.queries(xs, mla.query(xs)[2])
            scores = indexer_scores(iq, mla.indexer.keys(xs), iw)
            pos = torch.arange(xs.shape[1])
            want = causal_topk(scores, pos, mla.indexer.topk)[:, -44:]
            got_idx = torch.cat([r["mla_" + name][1] for r in results], dim=1)
            # rows whose k-th and (k+1)-th visible scores are apart by more than rounding must agree exactly
            visible = scores.masked_fill(pos.view(1, 1, -1) > pos.view(1, -1, 1), float("-inf"))[:, -44:]
            top = visible.sort(dim=-1, descending=True).values
            k = mla.indexer.topk
            gap = (top[..., k - 1] - top[..., k]).abs()
            clear = ~torch.isfinite(top[..., k]) | (gap > 1e-4 * top[..., 0].abs().clamp_min(1))
            assert clear.float().mean() > 0.9, clear
            assert torch.equal(got_idx[clear], want[clear])
