"""Batch-invariant mode: the ops, the engine's invariance (batch, chunking, prefill/decode, prefix
cache, preemption) and engine == trainer logprobs, all compared with torch.equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_utils import random_prompts, run
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.ops.batch_invariant import reference as bi
from kimiserve.rl.trainer import PolicyTrainer
from kimiserve.sampling_params import SamplingParams


# the ops ---------------------------------------------------------------------------------------
def test_tree_sum_ignores_zero_padding_and_batch():
    x = torch.randn(7, 37)
    s = bi.tree_sum(x)
    assert torch.allclose(s, x.double().sum(-1).float(), atol=1e-5)
    for pad in (3, 27, 91):
        assert torch.equal(bi.tree_sum(torch.cat([x, torch.zeros(7, pad)], 1)), s)
    assert torch.equal(bi.tree_sum(x[2:3]), s[2:3])
    assert torch.equal(bi.tree_sum(x.T.contiguous(), dim=0), s)


@pytest.mark.parametrize("K,O", [(64, 1024), (33, 7), (16, 24)])
def test_linear_rows_do_not_depend_on_the_batch(K, O):
    w = torch.randn(O, K)
    x = torch.randn(41, K)
    y = bi.linear(x, w)
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)
    for lo, hi in ((0, 1), (3, 4), (5, 22), (40, 41), (0, 41)):
        assert torch.equal(bi.linear(x[lo:hi], w), y[lo:hi])
    assert torch.equal(bi.linear(torch.stack([x, x], 1)[:, 1], w), y)  # strided input


def test_grouped_linear_matches_per_row_reference_and_its_gradients():
    """Per-row weights (experts, LoRA adapters: grouped matmuls) against one F.linear per row; the
    custom backward against autograd through the reference."""
    x = torch.randn(13, 19, requires_grad=True)
    w = torch.randn(13, 5, 19, requires_grad=True)
    y = bi.linear(x, w)
    ref = torch.stack([F.linear(x[i], w[i]) for i in range(13)])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert torch.equal(bi.linear(x[4:9], w[4:9]), y[4:9])


def test_linear_grouped_by_weight_equals_per_row_weights_bit_for_bit():
    """grouped_linear (one linear per group present, negative groups zero) gives each row the bits of
    the per-row-weight linear, whatever the other rows' groups; gradients reach the weights."""
    g = torch.Generator().manual_seed(3)
    stack = torch.randn(4, 7, 23, generator=g, requires_grad=True)
    x = torch.randn(29, 23, generator=g)
    groups = torch.randint(-1, 4, (29,), generator=g)
    y = bi.grouped_linear(x, groups, lambda e: stack[e], 7)
    per_row = bi.linear(x, stack[groups.clamp(min=0)])
    assert torch.equal(y, torch.where((groups >= 0).unsqueeze(1), per_row, 0.0))
    assert torch.equal(bi.grouped_linear(x[5:6], groups[5:6], lambda e: stack[e], 7), y[5:6])
    (gw,) = torch.autograd.grad(y.square().sum(), stack)
    (rw,) = torch.autograd.grad(torch.where((groups >= 0).unsqueeze(1), per_row, 0.0).square().sum(), stack)
    torch.testing.assert_close(gw, rw)
    assert bi.grouped_linear(x[:0], groups[:0], lambda e: stack[e], 7).shape == (0, 7)
    with pytest.raises(ValueError, match="groups must be"):
        bi.grouped_linear(x, groups[:3], lambda e: stack[e], 7)


def test_mxfp4_weight_linear_is_the_linear_of_the_dequantised_weight():
    from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4

    packed, scales = quantize_mxfp4(torch.randn(9, 64))
    x = torch.randn(6, 64, requires_grad=True)
    w = dequantize_mxfp4(packed, scales, torch.float32)
    y = bi.linear(x, bi.MXFP4Weight(packed, scales, torch.float32))
    assert torch.equal(y, bi.linear(x, w))
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, w.sum(0).expand(6, 64))


def test_head_linear_is_the_per_head_tree_sum_and_row_invariant():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 3, 37, generator=g, requires_grad=True)
    w = torch.randn(3, 9, 37, generator=g, requires_grad=True)
    y = bi.head_linear(x, w)
    assert y.dtype == torch.float32
    assert torch.equal(y, bi.tree_sum(x.unsqueeze(-2) * w, -1))
    assert torch.equal(bi.head_linear(x[6:7], w), y[6:7])
    torch.testing.assert_close(y, torch.einsum("nhk,hok->nho", x, w), rtol=1e-5, atol=1e-5)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    rx, rw = torch.autograd.grad(torch.einsum("nhk,hok->nho", x, w).sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_softmax_norms_and_sigmoid_are_row_invariant_and_close_to_torch():
    x = torch.randn(9, 1000) * 4
    torch.testing.assert_close(bi.log_softmax(x), torch.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(bi.sigmoid(x), torch.sigmoid(x))
    w = torch.randn(1000)
    torch.testing.assert_close(bi.rms_norm(x, w, 1e-5), w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    for f in (bi.log_softmax, bi.softmax, bi.sigmoid, lambda t: bi.rms_norm(t, w, 1e-5),
              lambda t: bi.layer_norm(t, w, w, 1e-6), bi.l2_normalize):
        assert torch.equal(f(x[3:4]), f(x)[3:4])
        assert torch.equal(f(torch.stack([x, x], 1)[:, 0]), f(x))


# the engine ------------------------------------------------------------------------------------
def engine(**kwargs) -> LLMEngine:
    kwargs = {"max_model_len": 512, "num_pages": 200, **kwargs}
    return LLMEngine(EngineArgs(model="tiny", dtype="float32", kv_cache_dtype="bf16", batch_invariant=True, **kwargs))


PROBE = random_prompts([70], seed=21)[0]  # > one page (64) and > index_topk (8): the sparse path
PROBE_PARAMS = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=0, prompt_logprobs=0, ignore_eos=True)


def result(out):
    """(sampled tokens, their logprobs, the prompt's logprobs) of a finished request."""
    o = out.outputs[0]
    prompt = out.prompt_logprobs[1:] if out.prompt_logprobs else []
    return o.token_ids, torch.tensor([lp.logprob for lp in o.logprobs]), torch.tensor([lp.logprob for lp in prompt])


def assert_same(a, b):
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1])
    assert torch.equal(a[2], b[2])


@pytest.fixture(scope="module")
def alone():
    e = engine()
    return result(run(e, [PROBE], PROBE_PARAMS, ids=["probe"])["probe"])


@pytest.mark.parametrize("budget,others", [(1, 2), (7, 5), (64, 17), (2048, 9)])
def test_sequence_alone_equals_sequence_in_any_batch_and_chunking(alone, budget, others):
    """The probe's tokens, logprobs and prompt logprobs alone == among `others` other sequences (random
    lengths, seeds, some greedy), with prompts chunked at `budget` tokens a step (1: token by token)."""
    e = engine(max_num_batched_tokens=budget)
    g = torch.Generator().manual_seed(budget)
    lengths = torch.randint(1, 40 if budget == 1 else 120, (others,), generator=g).tolist()
    prompts = [PROBE, *random_prompts(lengths, seed=budget + 100)]
    params = [PROBE_PARAMS] + [SamplingParams(temperature=float(i % 2), seed=i, max_tokens=3 + i % 7, ignore_eos=True)
                               for i in range(others)]
    outs = run(e, prompts, params)
    assert_same(result(outs["r0"]), alone)


def test_prefill_logprobs_equal_decode_logprobs(alone):
    """The probe's sampled tokens fed back as a prompt: their prompt logprobs (prefill, in chunks of 7
    and whole) equal the logprobs the decode steps reported."""
    tokens, decode_lps, prompt_lps = alone
    for budget in (7, 2048):
        e = engine(max_num_batched_tokens=budget, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        out = run(e, [PROBE + tokens], params, ids=["x"])["x"]
        lps = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        assert torch.equal(lps[: len(PROBE) - 1], prompt_lps)
        assert torch.equal(lps[len(PROBE) - 1 :], decode_lps)


def test_prefix_cache_hit_equals_miss_and_preemption_changes_nothing(alone):
    e = engine()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=0, ignore_eos=True)
    first = run(e, [PROBE], params, ids=["a"])["a"]
    assert_same(result(first), alone[:2] + (torch.zeros(0),))
    turn2 = PROBE + first.outputs[0].token_ids + random_prompts([9], seed=5)[0]
    hit = run(e, [turn2], params, ids=["b"])["b"]
    assert hit.num_cached_tokens > 64
    cold = run(engine(enable_prefix_caching=False), [turn2], params, ids=["b"])["b"]
    assert cold.num_cached_tokens == 0
    assert_same(result(hit), result(cold))
    # a repeated prompt: a hit on the prompt-end snapshot
    again = run(e, [PROBE], params, ids=["c"])["c"]
    assert again.num_cached_tokens == len(PROBE) - 1
    assert_same(result(again), alone[:2] + (torch.zeros(0),))
    # preemption: 22 pages cannot hold four 100 + 40 token sequences at once; the same batch in a roomy
    # pool (batch invariance, that a sequence alone gets the same bits, is the tests above) never preempts
    prompts = [PROBE + p for p in random_prompts([30, 31, 32, 33], seed=8)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, logprobs=0, ignore_eos=True) for s in range(4)]
    tight = engine(max_model_len=256, num_pages=22, enable_prefix_caching=False)
    squeezed = run(tight, prompts, params)
    assert tight.stats()["preemptions"] > 0
    roomy = engine(enable_prefix_caching=False)
    unsqueezed = run(roomy, prompts, params)
    assert roomy.stats()["preemptions"] == 0
    for i in range(len(prompts)):
        assert_same(result(squeezed[f"r{i}"]), result(unsqueezed[f"r{i}"]))


def test_engine_logprobs_equal_trainer_logprobs():
    """The trainer forward (autograd on) gives the logprobs the engine reported for the tokens it
    sampled, bit for bit, for a batch of rollouts of different lengths; and it has gradients."""
    e = engine(max_num_batched_tokens=16)
    prompts = random_prompts([5, 70, 12, 33], seed=31)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6 + 3 * s, logprobs=0, ignore_eos=True) for s in range(4)]
    outs = run(e, prompts, params)
    completions = [outs[f"r{i}"].outputs[0].token_ids for i in range(4)]
    trainer = PolicyTrainer.from_engine(e)
    params_t = trainer.trainable_parameters()
    lps = trainer.logprobs(prompts, completions)
    for i, lp in enumerate(lps):
        assert torch.equal(lp.detach(), result(outs[f"r{i}"])[1])
    sum(lp.sum() for lp in lps).backward()
    grads = [p.grad for p in params_t if p.grad is not None]
    assert len(grads) > 0.9 * len(params_t) and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_batch_invariant_is_refused_with_several_ranks():
    with pytest.raises(ValueError, match="one process"):
        EngineArgs(batch_invariant=True, tensor_parallel_size=2).validate()


@pytest.mark.parametrize("dtype,kv", [("float32", "fp8"), ("float32", "fp4"), ("bfloat16", "bf16")])
def test_other_cache_formats_and_bf16_weights(dtype, kv):
    """fp8 latents (per-layer scale), fp4 (NVFP4 latents, rotated MXFP4 index keys) and bf16 weights:
    a sequence alone == in a chunked batch, and the trainer's logprobs == the engine's."""
    make = lambda **k: LLMEngine(EngineArgs(model="tiny", dtype=dtype, kv_cache_dtype=kv, max_model_len=512,  # noqa: E731
                                            num_pages=200, batch_invariant=True, **k))
    prompts = random_prompts([70, 9, 30], seed=2)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, logprobs=0, ignore_eos=True) for s in range(3)]
    e = make(max_num_batched_tokens=16)
    outs = run(e, prompts, params)
    alone = run(make(), [prompts[0]], params[0])["r0"]
    assert_same(result(alone), result(outs["r0"]))
    with torch.no_grad():
        lps = PolicyTrainer.from_engine(e).logprobs(prompts, [outs[f"r{i}"].outputs[0].token_ids for i in range(3)])
    for i, lp in enumerate(lps):
        assert torch.equal(lp, result(outs[f"r{i}"])[1])


def test_dense_experts_are_the_dequantised_codes_shared_and_remade_when_the_codes_change():
    """The invariant forward's dequantised MXFP4 experts (the GPU's grouped matmul runs them): the
    reference dequantisation, one copy per module (a weight-sharing trainer reads the same), made
    again after an in-place update of the codes."""
    from kimiserve.model.loader import load_model
    from kimiserve.ops.quant.reference import dequantize_mxfp4
    from kimiserve.rl.forward import dense_experts

    model = load_model("tiny", torch.float32, 0, torch.device("cpu"))
    experts = next(m for m in model.modules() if getattr(m, "mxfp4", False))
    w1 = dense_experts(experts, "w1")
    assert torch.equal(w1, dequantize_mxfp4(experts.w1_packed, experts.w1_scale, experts.dtype))
    assert dense_experts(experts, "w1") is w1 and not w1.requires_grad
    with torch.no_grad():
        experts.w1_packed[0, 0, 0] ^= 0x11
    again = dense_experts(experts, "w1")
    assert again is not w1 and torch.equal(again, dequantize_mxfp4(experts.w1_packed, experts.w1_scale, experts.dtype))


@pytest.mark.parametrize("W", [4, 3, 1])
def test_causal_conv_of_taps_is_the_tree_sum_of_the_window(W):
    """The short conv from a list of taps (no window tensor) has the bits of the tree sum over the window."""
    g = torch.Generator().manual_seed(W)
    window = torch.randn(9, 3, 40, W, generator=g)
    window[0, 0, :5] = 0.0
    window[1, 0, :5] = -0.0
    weight = torch.randn(3, 40, W, generator=g)
    want = bi.silu(bi.tree_sum(window * weight, -1))
    assert torch.equal(bi.causal_conv_step(window, weight), want)
    assert torch.equal(bi.causal_conv([window[..., j] for j in range(W)], weight), want)
