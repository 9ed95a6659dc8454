"""The fast training forms compute what the forms before them computed: KDA's tiled intra-chunk scores
(`chunk_kda_tiled`) and the routed-pairs-only MoE give the same loss and gradients (fp32, tight)."""

import pytest
import torch

from kimiserve.demo.train import BatchStream, batch_loss, moe_layers, tiny_train_config
from kimiserve.model.model import build_model
from kimiserve.model.training import TrainContext, enable_training
from kimiserve.ops.kda.reference import _tile_size, chunk_kda_batched, chunk_kda_tiled, kda_gate, recurrent_kda
from kimiserve.ops.norm.reference import l2_normalize

F64 = torch.float64


def kda_inputs(B, T, H, K, V, lower_bound, dtype=F64, gate_scale=1.0):
    q = l2_normalize(torch.randn(B, T, H, K, dtype=dtype))
    k = l2_normalize(torch.randn(B, T, H, K, dtype=dtype))
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = kda_gate(torch.randn(B, T, H, K, dtype=dtype) * gate_scale, torch.randn(H, dtype=dtype),
                 torch.randn(H * K, dtype=dtype), lower_bound)
    return q, k, v, g, torch.rand(B, T, H, dtype=dtype)


def test_tile_size_follows_the_gate_bound():
    assert _tile_size(32, 5.0) == 8 and _tile_size(64, 5.0) == 8 and _tile_size(32, 1.0) == 32
    assert _tile_size(32, None) == 1 and _tile_size(12, 5.0) == 4 and _tile_size(13, 5.0) == 1


@pytest.mark.parametrize("T,C", [(1, 16), (37, 16), (100, 32), (64, 64)])
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, None])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_kda_tiled_equals_recurrent_and_its_gradients_equal_batched(T, C, lower_bound, with_state):
    B, H, K, V = 2, 3, 8, 6
    q, k, v, g, beta = (t.requires_grad_() for t in kda_inputs(B, T, H, K, V, lower_bound))
    s0 = torch.randn(B, H, K, V, dtype=F64) if with_state else None
    bound = None if lower_bound is None else -lower_bound
    o, s = chunk_kda_tiled(q, k, v, g, beta, initial_state=s0, chunk_size=C, gate_bound=bound)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
    w_o, w_s = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), (q, k, v, g, beta))
    o2, s2 = chunk_kda_batched(q, k, v, g, beta, initial_state=s0, chunk_size=C)
    grads_ref = torch.autograd.grad((o2 * w_o).sum() + (s2 * w_s).sum(), (q, k, v, g, beta))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_chunk_kda_tiled_fp32_at_the_strongest_gate_matches_batched():
    """Every step's decay at the bound (-4.99 each: a chunk of 32 decays by exp(-160)): finite, and equal
    to the per-pair decays' fp32 result and gradients up to fp32 rounding."""
    B, T, H, K, V = 2, 77, 2, 16, 8
    q, k, v, _, beta = (t.float() for t in kda_inputs(B, T, H, K, V, -5.0))
    g = torch.full_like(q, -4.99)
    g[:, ::3] = -0.01  # and some weak steps between
    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, s = chunk_kda_tiled(*ins, chunk_size=32, gate_bound=5.0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o_ref, s_ref = chunk_kda_batched(*ref_ins, chunk_size=32)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(o)
    (o * w).sum().backward()
    (o_ref * w).sum().backward()
    for a, b in zip(ins, ref_ins):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("sparse,fake_quant", [(False, False), (True, True)])
def test_fast_training_forms_give_the_loss_and_gradients_of_the_forms_before(sparse, fake_quant, device):
    ids, mask = (torch.from_numpy(a).to(device) for a in next(iter(BatchStream(0, 1024, 200, 40, pool=16))))
    results = []
    for reference in (True, False):
        model = build_model(tiny_train_config(routed_experts_mxfp4=False), torch.float32, seed=0, device=device)
        params = enable_training(model)
        for m in moe_layers(model):
            m.fake_quant, m.train_every_expert = fake_quant, reference
        ctx = TrainContext(sparse=sparse, kda_chunk_size=32, fast=not reference)
        ce, kl, n, correct = batch_loss(model, ids, mask, ctx)
        (ce + kl).backward()
        loads = [m.routed_load.clone() for m in moe_layers(model)]
        results.append((ce.detach(), kl.detach(), n, int(correct), [None if p.grad is None else p.grad.clone() for p in params], loads))
    (ce0, kl0, n0, c0, g0, l0), (ce1, kl1, n1, c1, g1, l1) = results
    assert n0 == n1 and c0 == c1 and all(torch.equal(a, b) for a, b in zip(l0, l1))
    torch.testing.assert_close(ce1, ce0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl1, kl0, rtol=1e-5, atol=1e-6)
    assert sum(g is not None for g in g0) > 0.9 * len(g0)
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None)
        if a is not None:  # fp32 rounding, bounded by the tensor's scale: the indexer's KL gradient sums ~T^2
            # softmax-minus-target terms that cancel, so on the batch's 192-token rows the two forms' rounding
            # reaches ~8e-4 of its largest entry (in float64 the forms agree to ~4e-7: the parts kept in fp32)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=max(1e-6, 2e-3 * b.abs().max().item()))


def test_bf16_autocast_training_loss_is_close_to_fp32_and_its_gradients_finite():
    """TrainArgs.autocast_bf16 (opt-in): the fast forms under bf16 autocast run end to end."""
    ids, mask = (torch.from_numpy(a) for a in next(iter(BatchStream(0, 1024, 200, 40, pool=16))))
    model = build_model(tiny_train_config(routed_experts_mxfp4=False), torch.float32, seed=0)
    params = enable_training(model)
    with torch.no_grad():
        ce32, _, _, _ = batch_loss(model, ids, mask, TrainContext(kda_chunk_size=32))
    with torch.autocast("cpu", torch.bfloat16):
        ce, kl, _, _ = batch_loss(model, ids, mask, TrainContext(sparse=True, kda_chunk_size=32))
    (ce + kl).backward()
    assert abs(ce.item() - ce32.item()) < 0.02 * ce32.item()
    assert all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
