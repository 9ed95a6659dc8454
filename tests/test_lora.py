"""LoRA adapters: PEFT files, grouped multi-adapter batches against the per-adapter reference, the
engine serving several adapters and the base in one batch (== each alone, torch.equal), the prefix
cache keyed by adapter, engine == trainer LoRA logprobs, training with the base frozen."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine_utils import random_prompts
from kimiserve.config import load_preset
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.lora import LoRAAdapter, LoRABatch, lora_reference
from kimiserve.model.model import build_model
from kimiserve.rl.forward import InvariantForward
from kimiserve.rl.trainer import PolicyTrainer
from kimiserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return build_model(load_preset("tiny"), torch.float32)


def test_grouped_lora_matches_the_per_adapter_reference(model):
    a = LoRAAdapter.init(model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(model, "b", rank=8, random_b=True, seed=2)
    name = "model.layers.1.self_attn.q_proj"
    weight = model.get_submodule(name).weight
    x = torch.randn(11, weight.shape[1])
    slots = torch.tensor([0, -1, 1, 1, 0, -1, -1, 1, 0, 0, 1])
    batch = LoRABatch([a, b], slots)
    from kimiserve.ops.batch_invariant import reference as bi

    got = batch.apply(name, x, bi.linear(x, weight))
    torch.testing.assert_close(got, lora_reference(x, weight, [a, b], slots, name), rtol=1e-5, atol=1e-5)
    # a row's result depends on its adapter only: each adapter's rows alone give the same bits
    for slot, adapter in ((0, a), (1, b)):
        rows = torch.nonzero(slots == slot)[:, 0]
        alone = LoRABatch([adapter], torch.zeros(len(rows), dtype=torch.int64)).apply(name, x[rows], bi.linear(x[rows], weight))
        assert torch.equal(alone, got[rows])
    assert torch.equal(got[slots == -1], bi.linear(x, weight)[slots == -1])


def test_peft_files_round_trip_and_bad_adapters_are_value_errors(model, tmp_path):
    a = LoRAAdapter.init(model, "a", rank=4, random_b=True, seed=1)
    a.save_pretrained(str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and "w1" in config["target_modules"]
    back = LoRAAdapter.from_pretrained(str(tmp_path / "a"), model, "a2")
    assert set(back.weights) == set(a.weights) and set(back.expert_weights) == set(a.expert_weights)
    for table in ("weights", "expert_weights"):
        for key, (x, y) in getattr(a, table).items():
            assert torch.equal(getattr(back, table)[key][0], x) and torch.equal(getattr(back, table)[key][1], y)
    with pytest.raises(ValueError, match="adapter_config.json"):
        LoRAAdapter.from_pretrained(str(tmp_path), model, "x")
    from safetensors.torch import save_file

    os.makedirs(tmp_path / "bad", exist_ok=True)
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    save_file({"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7),
               "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)},
              str(tmp_path / "bad" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="needs"):
        LoRAAdapter.from_pretrained(str(tmp_path / "bad"), model, "bad")


def lora_engine(**kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model="tiny", dtype="float32", kv_cache_dtype="bf16", max_model_len=512, num_pages=200,
                                batch_invariant=True, enable_lora=True, **kwargs))


def generate(engine, prompts, params, names):
    for i, (p, n) in enumerate(zip(prompts, names)):
        engine.add_request(f"q{engine.num_steps}-{i}", p, params, lora_name=n)
    ids = [f"q{engine.num_steps}-{i}" for i in range(len(prompts))]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[i] for i in ids]


def lps(out):
    return torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])


def test_engine_serves_several_adapters_and_the_base_in_one_batch(tmp_path):
    """A batch of a, base, b, a (a loaded from PEFT files) == each alone; the trainer's LoRA logprobs ==
    the engine's; a repeated prompt under adapter a hits the cache, the same prompt under b does not."""
    e = lora_engine(max_num_batched_tokens=16)
    a = LoRAAdapter.init(e.model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(e.model, "b", rank=8, random_b=True, seed=2)
    a.save_pretrained(str(tmp_path / "a"))
    e.load_lora_adapter("a", str(tmp_path / "a"))
    e.load_lora_adapter("b", b)
    assert e.lora_names() == ["a", "b"]
    prompts = random_prompts([70, 20, 33, 9], seed=3)
    names = ["a", None, "b", "a"]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, logprobs=0, ignore_eos=True)
    mixed = generate(e, prompts, params, names)
    trainer = PolicyTrainer.from_engine(e)
    for prompt, name, out in zip(prompts, names, mixed):
        alone_engine = lora_engine()
        if name is not None:
            alone_engine.load_lora_adapter(name, a if name == "a" else b)
        alone = generate(alone_engine, [prompt], params, [name])[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert torch.equal(lps(alone), lps(out))
        adapter = {"a": a, "b": b}.get(name)
        lora = None if adapter is None else adapter.batch_for(len(prompt) + 8)
        got = trainer.logprobs([prompt], [out.outputs[0].token_ids], lora=lora)[0]
        assert torch.equal(got.detach(), lps(out))
    assert not torch.equal(lps(mixed[0]), lps(generate(lora_engine(), [prompts[0]], params, [None])[0]))
    before = e.stats()["prefix_hit_tokens"]
    again = generate(e, [prompts[0]], params, ["a"])[0]
    assert again.num_cached_tokens > 0 and torch.equal(lps(again), lps(mixed[0]))
    other = generate(e, [prompts[0]], params, ["b"])[0]
    assert other.num_cached_tokens == 0
    assert e.stats()["prefix_hit_tokens"] == before + again.num_cached_tokens
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        e.add_request("bad", prompts[0], params, lora_name="nope")
    e.unload_lora_adapter("b")
    assert e.lora_names() == ["a"]
    EngineArgs(enable_lora=True).validate()  # the default forward serves adapters too (tests below)
    assert EngineArgs(lora_modules="a=/x,b=/y z=/w").lora_module_paths() == {"a": "/x", "b": "/y", "z": "/w"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineArgs(batch_invariant=True, lora_modules="oops").validate()


def test_lora_training_moves_only_the_adapter_and_syncs_into_the_engine():
    e = lora_engine()
    adapter = LoRAAdapter.init(e.model, "policy", rank=4, seed=0)
    e.load_lora_adapter("policy", adapter)
    trainer = PolicyTrainer.from_engine(e)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    opt = torch.optim.Adam(adapter.trainable_parameters(), lr=1e-2)
    prompt, completion = random_prompts([12, 6], seed=9)
    loss = -trainer.logprobs([prompt], [completion], lora=adapter.batch_for(18))[0].sum()
    loss.backward()
    opt.step()
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters())
    assert any(float(b.detach().abs().max()) > 0 for _, b in adapter.weights.values())
    adapter.sync_to(e)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=5, logprobs=0, ignore_eos=True)
    out = generate(e, [prompt], params, ["policy"])[0]
    got = trainer.logprobs([prompt], [out.outputs[0].token_ids], lora=adapter.batch_for(17))[0]
    assert torch.equal(got.detach(), lps(out))


# the default (fast) forward: kimiserve.lora.serving --------------------------------------------

def test_serving_lora_ops_match_the_per_adapter_reference():
    """segment_delta (eager), masked_delta (graph) and the experts' segment and dense forms against one
    plain matmul per adapter (and per expert), odd sizes; a base row's output is untouched, bit for bit."""
    from kimiserve.lora.serving import LoRARows, gathered_delta, masked_delta, segment_delta

    g = torch.Generator().manual_seed(0)
    S, R, n_in, n_out, N = 3, 6, 13, 11, 17
    A, B = torch.randn(S + 1, R, n_in, generator=g), torch.randn(n_out, S + 1, R, generator=g)
    A[0], B[:, 0] = 0, 0
    ranks = {1: 6, 2: 3, 3: 5}
    for s, r in ranks.items():
        A[s, r:], B[:, s, r:] = 0, 0
    x, y = torch.randn(N, n_in, generator=g), torch.randn(N, n_out, generator=g)
    slots = [0, 2, 2, 1, 0, 3, 1, 1, 0, 2, 3, 3, 0, 0, 1, 2, 2]
    want = y.clone()
    for i, s in enumerate(slots):
        want[i] += B[:, s] @ (A[s] @ x[i])
    rows = LoRARows.of(slots, ranks, "cpu")
    assert any(isinstance(r, torch.Tensor) for _, _, r in rows.groups)
    for got in (segment_delta(x, y.clone(), A, B, rows.groups), masked_delta(x, y.clone(), A, B, rows.slots)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        base = rows.slots == 0
        assert torch.equal(got[base], y[base])
    contiguous = LoRARows.of([0, 2, 2, 2, 0], ranks, "cpu")
    assert contiguous.groups == [(2, 3, slice(1, 4))]
    E = 5
    A4, B4 = torch.randn(S + 1, E, R, n_in, generator=g), torch.randn(S + 1, E, n_out, R, generator=g)
    experts = torch.randint(0, E, (N,), generator=g)
    want = torch.stack([B4[s, e] @ (A4[s, e] @ x[i]) for i, (s, e) in enumerate(zip(slots, experts.tolist()))])
    torch.testing.assert_close(gathered_delta(x, A4, B4, rows.slots, experts), want, rtol=1e-5, atol=1e-5)


def test_serving_lora_experts_forms_match_per_pair_reference(model, monkeypatch):
    """LoRAExperts' segment form (eager, many tokens) and dense form (graphs, few tokens) against each
    (token, expert) pair run alone with its adapter's weights merged in."""
    from kimiserve.lora import serving as serving_module
    from kimiserve.lora.serving import LoRARows, ServingLoRA

    serving = ServingLoRA(model, max_loras=3, max_rank=8)
    a = LoRAAdapter.init(model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(model, "b", rank=8, random_b=True, seed=2)
    serving.write(1, a)
    serving.write(3, b)
    name = next(k.rsplit(".", 1)[0] for k in a.expert_weights)
    experts = model.get_submodule(name)
    try:
        g = torch.Generator().manual_seed(3)
        N, k = 9, model.config.num_experts_per_token
        x = torch.randn(N, experts.w1_packed.shape[2] * 2 if experts.mxfp4 else experts.w1.shape[2], generator=g)
        ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:k] for _ in range(N)])
        weights = torch.rand(N, k, generator=g)
        slots = [1, 0, 3, 3, 1, 0, 0, 3, 1]
        want = torch.zeros(N, x.shape[1])
        for n in range(N):
            adapter = {1: a, 3: b}.get(slots[n])
            for j in range(k):
                e = int(ids[n, j])
                w = {}
                for wn in experts.NAMES:
                    w[wn] = experts.expert_weight(wn, e).float()
                    if adapter is not None:
                        A, B = adapter.expert_weights[f"{name}.{wn}"]
                        w[wn] = w[wn] + adapter.scaling * B[e] @ A[e]
                want[n] += weights[n, j] * (experts.act(x[n] @ w["w1"].T, x[n] @ w["w3"].T) @ w["w2"].T)
        forms = []
        monkeypatch.setattr(serving_module.LoRAExperts, "_segments",
                            lambda self, *a, f=serving_module.LoRAExperts._segments: forms.append("segments") or f(self, *a))
        for rows, static_tokens in ((LoRARows.of(slots, serving.ranks, "cpu"), 0), (LoRARows(torch.tensor(slots)), 0),
                                    (LoRARows.of(slots, serving.ranks, "cpu"), N)):
            monkeypatch.setattr(serving_module, "STATIC_MOE_TOKENS", static_tokens)
            with serving.active(rows):
                assert experts.lora.applies()
                got = experts(x, ids, weights)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert forms == ["segments"]  # only the eager step past STATIC_MOE_TOKENS
        assert not experts.lora.applies()  # outside a step: the plain forward
    finally:
        for module in model.modules():
            module.__dict__.pop("lora", None)


@pytest.mark.parametrize("form", ["eager", "graph"])
def test_default_mode_serves_several_adapters_as_the_merged_full_forward(form, monkeypatch):
    """Default (fast) mode, a batch of a, base, b, a in 16-token chunks: every request's logits == the
    full-sequence forward of a model with its adapter merged into the weights (W + B A alpha / r), fp32
    bounds; == each request alone in a LoRA engine; the base request == a LoRA-less engine. `graph`:
    every step through the fixed-shape forms a captured decode graph runs (slots tensor only)."""
    from engine_utils import (MERGE_TEST, assert_rows_match, compare_with_full_forward, fp32_row_tolerance, make_engine,
                              merged_twin)
    from kimiserve.lora.serving import LoRARows

    if form == "graph":
        monkeypatch.setattr(LoRARows, "of", classmethod(lambda cls, s, r, d: cls(torch.tensor(s, device=d))))
    e = make_engine(max_num_batched_tokens=16, **MERGE_TEST)
    a = LoRAAdapter.init(e.model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(e.model, "b", rank=8, random_b=True, seed=2)
    e.load_lora_adapter("a", a)
    e.load_lora_adapter("b", b)
    prompts = random_prompts([40, 20, 27, 9], seed=3)
    names = ["a", None, "b", "a"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    mixed = generate(e, prompts, params, names)
    twins = {"a": merged_twin(e, a), "b": merged_twin(e, b), None: None}
    errors, agree, moved = [], [], []
    for prompt, name, out in zip(prompts, names, mixed):
        err, ok, ref = compare_with_full_forward(e, prompt, out.outputs[0].token_ids, model=twins[name])
        errors, agree = errors + err, agree + ok
        if name is not None:  # the adapter moves the logits far past the bound: the check is not vacuous
            base = e.model(torch.tensor(prompt + out.outputs[0].token_ids))
            moved.append(float((ref - base).norm() / base.norm()))
    assert_rows_match(errors, agree, fp32_row_tolerance(e))
    assert min(moved) > 0.05, moved
    alone_errors, alone_agree = [], []
    for prompt, name, out in zip(prompts, names, mixed):
        alone = make_engine(**MERGE_TEST) if name is not None else make_engine(model_overrides=MERGE_TEST["model_overrides"])
        if name is not None:
            alone.load_lora_adapter(name, {"a": a, "b": b}[name])
        got = generate(alone, [prompt], params, [name])[0]
        assert got.outputs[0].token_ids == out.outputs[0].token_ids
        for step in range(len(got.outputs[0].token_ids)):
            x, y = e.recorded[(tuple(prompt), None, step)], alone.recorded[(tuple(prompt), None, step)]
            alone_errors.append(float((x - y).norm() / y.norm()))
            alone_agree.append(bool(x.argmax() == y.argmax()))
    assert_rows_match(alone_errors, alone_agree, fp32_row_tolerance(e))


def test_default_mode_prefix_cache_is_keyed_by_adapter_and_args():
    """A repeated prompt under adapter a hits the cache (same tokens), under b it does not; unloading
    frees the slot for the next adapter; LoRA refuses tensor parallelism and speculative decoding."""
    e = LLMEngine(EngineArgs(model="tiny", dtype="float32", max_model_len=256, num_pages=200, enable_lora=True,
                             max_loras=2))
    a = LoRAAdapter.init(e.model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(e.model, "b", rank=8, random_b=True, seed=2)
    e.load_lora_adapter("a", a)
    e.load_lora_adapter("b", b)
    prompt = random_prompts([40], seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = generate(e, [prompt], params, ["a"])[0]
    again = generate(e, [prompt], params, ["a"])[0]
    other = generate(e, [prompt], params, ["b"])[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids != first.outputs[0].token_ids
    with pytest.raises(ValueError, match="max_loras"):
        e.load_lora_adapter("c", a)
    with pytest.raises(ValueError, match="indexer's wq_b"):  # run on row subsets: batch-invariant mode only
        e.lora.serving.write(2, LoRAAdapter.init(e.model, "ix", rank=2, targets=("wq_b",)))
    e.unload_lora_adapter("a")
    e.load_lora_adapter("c", b)
    assert e.lora.slots == {"b": 2, "c": 1}
    assert generate(e, [prompt], params, ["c"])[0].outputs[0].token_ids == other.outputs[0].token_ids
    with pytest.raises(ValueError, match="one rank"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="speculative_config with LoRA"):
        EngineArgs(enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()
