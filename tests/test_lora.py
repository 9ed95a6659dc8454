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
    with pytest.raises(ValueError, match="batch-invariant"):
        EngineArgs(enable_lora=True).validate()
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
