"""The pure-torch reference ops against direct (loop / brute-force) formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_rms
from kimiserve.ops.activation.reference import situ_and_mul
from kimiserve.ops.attn_res.reference import attn_res_read
from kimiserve.ops.conv.reference import causal_conv1d
from kimiserve.ops.indexer.reference import indexer_scores
from kimiserve.ops.kda.reference import chunk_kda, chunk_kda_batched, kda_gate, recurrent_kda
from kimiserve.ops.mla.reference import mla_absorbed, mla_expanded
from kimiserve.ops.moe.reference import route
from kimiserve.ops.norm.reference import l2_normalize
from kimiserve.ops.topk.reference import causal_topk, selection_mask

F64 = torch.float64


def kda_inputs(B, T, H, K, V, lower_bound, dtype=F64):
    q = l2_normalize(torch.randn(B, T, H, K, dtype=dtype))
    k = l2_normalize(torch.randn(B, T, H, K, dtype=dtype))
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = kda_gate(torch.randn(B, T, H, K, dtype=dtype), torch.randn(H, dtype=dtype), torch.randn(H * K, dtype=dtype), lower_bound)
    beta = torch.rand(B, T, H, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 13, 64, 100, 129])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_kda_equals_recurrent_fp64(T, lower_bound, with_state):
    B, H, K, V = 2, 3, 8, 6
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, lower_bound)
    s0 = torch.randn(B, H, K, V, dtype=F64) if with_state else None
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T", [1, 13, 100])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_kda_batched_equals_recurrent_and_its_gradients_equal_chunk_kda(T, with_state):
    B, H, K, V = 2, 3, 8, 6
    q, k, v, g, beta = (t.requires_grad_() for t in kda_inputs(B, T, H, K, V, -5.0))
    s0 = torch.randn(B, H, K, V, dtype=F64) if with_state else None
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda_batched(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
    w_o, w_s = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), (q, k, v, g, beta))
    o2, s2 = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    grads_ref = torch.autograd.grad((o2 * w_o).sum() + (s2 * w_s).sum(), (q, k, v, g, beta))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    strong = chunk_kda_batched(q.float(), k.float(), v.float(), torch.full_like(g, -4.99).float(), beta.float())
    assert all(torch.isfinite(t).all() for t in strong)


def test_kda_chunks_compose_and_strong_decay_stays_finite():
    B, T, H, K, V = 1, 90, 2, 4, 4
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, -5.0)
    o_full, s_full = chunk_kda(q, k, v, g, beta, chunk_size=32)
    o1, s1 = chunk_kda(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37])
    o2, s2 = chunk_kda(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], initial_state=s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s_full, rtol=1e-10, atol=1e-10)
    # decay near the lower bound for 64 steps underflows exp(G); the chunk form must not overflow
    o, s = chunk_kda(q.float(), k.float(), v.float(), torch.full_like(g, -4.99).float(), beta.float())
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


def test_kda_gate_forms():
    f, A_log, dt_bias = torch.randn(5, 3, 4, dtype=F64), torch.randn(3, dtype=F64), torch.randn(12, dtype=F64)
    a = torch.exp(A_log).view(3, 1)
    x = f + dt_bias.view(3, 4)
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias, -5.0), -5.0 * torch.sigmoid(a * x))
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias, None), -a * F.softplus(x))
    assert (kda_gate(f * 100, A_log, dt_bias, -5.0) > -5.0 - 1e-12).all()


def test_causal_conv_matches_loop_and_carries_state():
    B, T, C, W = 2, 11, 5, 4
    x, w = torch.randn(B, T, C, dtype=F64), torch.randn(C, W, dtype=F64)
    y, state = causal_conv1d(x, w)
    padded = torch.cat([torch.zeros(B, W - 1, C, dtype=F64), x], 1)
    loop = torch.stack([F.silu((padded[:, t : t + W] * w.T).sum(1)) for t in range(T)], 1)
    torch.testing.assert_close(y, loop)
    y1, s1 = causal_conv1d(x[:, :6], w)
    y2, s2 = causal_conv1d(x[:, 6:], w, s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    torch.testing.assert_close(s2, state)


def brute_force_topk(scores_row, pos, k):
    ranked = sorted(range(pos + 1), key=lambda s: (-float(scores_row[s]), s))[:k]
    return ranked + [-1] * (k - len(ranked))


@pytest.mark.parametrize("k", [1, 5, 8, 40])
def test_causal_topk_equals_brute_force_with_ties(k):
    B, T = 2, 29
    scores = torch.randint(0, 4, (B, T, T)).float()  # many ties: the earlier token must win
    idx = causal_topk(scores, torch.arange(T), k)
    assert idx.shape == (B, T, k)
    for b in range(B):
        for t in range(T):
            assert idx[b, t].tolist() == brute_force_topk(scores[b, t], t, k)


def test_indexer_scores_equal_direct_sum():
    B, T, Hi, D = 1, 7, 3, 5
    q, k, w = torch.randn(B, T, Hi, D, dtype=F64), torch.randn(B, T, D, dtype=F64), torch.randn(B, T, Hi, dtype=F64)
    s = indexer_scores(q, k, w)
    for t in range(T):
        for u in range(T):
            direct = sum(w[0, t, h] * max(0.0, float(q[0, t, h] @ k[0, u])) for h in range(Hi))
            assert math.isclose(float(s[0, t, u]), float(direct), rel_tol=1e-12, abs_tol=1e-12)


def mla_inputs(B=2, T=9, S=9, H=3, dn=4, dr=2, L=6, dv=5):
    return dict(
        q_nope=torch.randn(B, T, H, dn, dtype=F64), q_pe=torch.randn(B, T, H, dr, dtype=F64),
        c=torch.randn(B, S, L, dtype=F64), k_pe=torch.randn(B, S, dr, dtype=F64),
        w_kc=torch.randn(H, dn, L, dtype=F64), w_vc=torch.randn(H, dv, L, dtype=F64),
    )


def test_absorbed_mla_equals_expanded():
    x = mla_inputs()
    mask = torch.rand(2, 9, 9) < 0.5
    mask[..., 0] = True
    a = mla_absorbed(**x, scale=0.3, mask=mask)
    e = mla_expanded(**x, scale=0.3, mask=mask)
    torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_sparse_mla_reads_only_selected_tokens():
    x = mla_inputs()
    T = 9
    scores = torch.randn(2, T, T, dtype=F64)
    idx = causal_topk(scores, torch.arange(T), 3)
    out = mla_absorbed(**x, scale=0.3, mask=selection_mask(idx, T))
    # per query: dense attention over the gathered selected tokens only
    for b in range(2):
        for t in range(T):
            sel = idx[b, t][idx[b, t] >= 0]
            sub = {k: v[b : b + 1] for k, v in x.items() if k not in ("w_kc", "w_vc")}
            sub["c"], sub["k_pe"] = sub["c"][:, sel], sub["k_pe"][:, sel]
            sub["q_nope"], sub["q_pe"] = sub["q_nope"][:, t : t + 1], sub["q_pe"][:, t : t + 1]
            ref = mla_expanded(**sub, w_kc=x["w_kc"], w_vc=x["w_vc"], scale=0.3, mask=torch.ones(1, 1, len(sel), dtype=torch.bool))
            torch.testing.assert_close(out[b, t], ref[0, 0], rtol=1e-10, atol=1e-10)


def test_topk_at_least_context_selects_the_causal_prefix():
    T = 12
    idx = causal_topk(torch.randn(1, T, T), torch.arange(T), T)
    assert torch.equal(selection_mask(idx, T)[0], torch.ones(T, T, dtype=torch.bool).tril())


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_routing_equals_per_token_loop(groups):
    N, E, k = 17, 16, 4
    n_group, topk_group = groups
    logits, bias = torch.randn(N, E), torch.randn(E) * 0.1
    ids, w = route(logits, bias, k, num_expert_group=n_group, topk_group=topk_group, scaling_factor=2.5)
    for n in range(N):
        s = torch.sigmoid(logits[n])
        biased = (s + bias).tolist()
        eligible = list(range(E))
        if n_group > 1:
            size = E // n_group
            group_score = [sum(sorted(biased[g * size : (g + 1) * size])[-2:]) for g in range(n_group)]
            keep = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
            eligible = [e for e in eligible if e // size in keep]
        chosen = sorted(eligible, key=lambda e: -biased[e])[:k]
        assert sorted(ids[n].tolist()) == sorted(chosen)
        weights = {e: float(s[e]) / sum(float(s[c]) for c in chosen) * 2.5 for e in chosen}
        for e, wt in zip(ids[n].tolist(), w[n].tolist()):
            assert math.isclose(wt, weights[e], rel_tol=1e-5)


def test_attn_res_read_equals_direct_formula():
    N, d, eps = 5, 8, 1e-5
    blocks = [torch.randn(N, d, dtype=F64) for _ in range(3)]
    running = torch.randn(N, d, dtype=F64)
    norm_w, proj_w = torch.randn(d, dtype=F64), torch.randn(1, d, dtype=F64)
    out = attn_res_read(running, blocks, norm_w, proj_w, eps)
    for n in range(N):
        cands = [b[n] for b in blocks] + [running[n]]
        scores = [float((v / torch.sqrt((v * v).mean() + eps) * norm_w * proj_w[0]).sum()) for v in cands]
        z = sum(math.exp(s) for s in scores)
        direct = sum(math.exp(s) / z * v for s, v in zip(scores, cands))
        torch.testing.assert_close(out[n], direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attn_res_read(running, [], norm_w, proj_w, eps), running)


def test_situ():
    g, u = torch.randn(50, dtype=F64) * 10, torch.randn(50, dtype=F64) * 40
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(situ_and_mul(g, u, 4.0, 25.0), ref)
    assert rel_rms(situ_and_mul(g.float(), u.float(), 4.0, 25.0), ref) < 1e-6
