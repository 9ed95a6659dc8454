"""The MXFP4 routed experts held in the shift layout (`model.expert_layout`, `RoutedExperts.use_layout`):
the accessor gives back exactly the checkpoint codes, every torch reader and the checkpoint export see
the checkpoint layout, weight syncs land in the layout the engine holds, scale bytes above
MAX_SHIFT_SCALE keep a layer in the checkpoint layout, and the engine picks the layout from its ops.
The fused kernel on the shift layout: tests/test_triton_moe_interpret.py (interpreter) and
tests/test_triton_moe.py (GPU)."""

import logging

import pytest
import torch

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.config import load_preset
from kimiserve.engine import runner as runner_module
from kimiserve.model.expert_layout import apply_moe_layout, moe_layouts, named_checkpoint_tensors
from kimiserve.model.loader import load_weights, save_checkpoint
from kimiserve.model.model import build_model
from kimiserve.model.moe import RoutedExperts
from kimiserve.ops.backend import REFERENCE_OPS, shift_moe_layout
from kimiserve.ops.moe.mxfp4_layout import MAX_SHIFT_SCALE
from kimiserve.rl.weight_sync import sync_weights
from kimiserve.sampling_params import SamplingParams


def experts_of(model) -> dict[str, RoutedExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}


def codes_of(model) -> dict[str, torch.Tensor]:
    return {f"{n}.{w}": getattr(m, f"{w}_packed").clone() for n, m in experts_of(model).items() for w in m.NAMES}


@pytest.fixture(scope="module")
def tiny_bf16():
    return build_model(load_preset("tiny"), torch.bfloat16, seed=0)


def test_checkpoint_codes_after_relayout(tiny_bf16):
    model = tiny_bf16
    before = codes_of(model)
    ids = torch.randint(0, 768, (2, 9), generator=torch.Generator().manual_seed(0))
    want = model(ids)
    assert apply_moe_layout(model, "shift") and moe_layouts(model) == {"shift": len(experts_of(model))}
    try:
        named = named_checkpoint_tensors(model)
        picks = torch.tensor([5, 0, 5])
        for n, m in experts_of(model).items():
            for w in m.NAMES:
                codes = before[f"{n}.{w}"]
                assert not torch.equal(getattr(m, f"{w}_packed"), codes)  # really re-laid in place
                assert torch.equal(m.checkpoint_codes(w), codes)
                assert torch.equal(m.checkpoint_codes(w, picks), codes[picks])
                assert torch.equal(m.checkpoint_codes(w, 3), codes[3])
                assert torch.equal(named[f"{n}.{w}_packed"], codes)
        assert torch.equal(model(ids), want)  # the torch forms read the checkpoint codes
    finally:
        assert apply_moe_layout(model, "checkpoint")
    assert all(torch.equal(c, before[k]) for k, c in codes_of(model).items())


def test_export_and_load_after_relayout(tiny_bf16, tmp_path):
    """save_checkpoint of a shift-laid model writes the checkpoint codes; load_weights into a shift-laid
    model lands them in the shift layout."""
    model = tiny_bf16
    before = codes_of(model)
    apply_moe_layout(model, "shift")
    try:
        save_checkpoint(model, tmp_path)
    finally:
        apply_moe_layout(model, "checkpoint")
    target = build_model(load_preset("tiny"), torch.bfloat16, seed=3)
    apply_moe_layout(target, "shift")
    load_weights(target, tmp_path)
    assert moe_layouts(target) == {"shift": len(experts_of(target))}
    for n, m in experts_of(target).items():
        for w in m.NAMES:
            assert torch.equal(m.checkpoint_codes(w), before[f"{n}.{w}"])


def test_large_scale_bytes_keep_the_checkpoint_layout(caplog):
    model = build_model(load_preset("tiny"), torch.bfloat16, seed=0)
    experts = experts_of(model)
    name = next(iter(experts))
    experts[name].w2_scale[1, 2, 0] = MAX_SHIFT_SCALE + 1  # one group with |w| >= 16
    before = codes_of(model)
    with caplog.at_level(logging.WARNING, logger="kimiserve.model"):
        apply_moe_layout(model, "shift")
    assert experts[name].mxfp4_layout == "checkpoint"
    assert all(m.mxfp4_layout == "shift" for n, m in experts.items() if n != name)
    assert all(torch.equal(getattr(experts[name], f"{w}_packed"), before[f"{name}.{w}"]) for w in ("w1", "w2", "w3"))
    warnings = [r for r in caplog.records if "MAX_SHIFT_SCALE" in r.getMessage()]
    assert len(warnings) == 1 and name in warnings[0].getMessage()
    fp32 = build_model(load_preset("tiny"), torch.float32, seed=0)
    assert not apply_moe_layout(fp32, "shift") and moe_layouts(fp32) == {"checkpoint": len(experts)}


def test_engine_picks_the_layout_from_its_ops(monkeypatch):
    """`runner.ops = shift_moe_layout(...)` re-lays where the device runs the fused kernel (none on the
    CPU: the checkpoint layout stays), and back."""
    engine = make_engine("bfloat16")
    engine.runner.ops = shift_moe_layout(REFERENCE_OPS)
    assert set(moe_layouts(engine.model)) == {"checkpoint"}
    monkeypatch.setattr(runner_module, "fused_moe_for", lambda device_type: object())
    engine.runner.ops = shift_moe_layout(REFERENCE_OPS)
    assert set(moe_layouts(engine.model)) == {"shift"}
    engine.runner.ops = REFERENCE_OPS
    assert set(moe_layouts(engine.model)) == {"checkpoint"}


def greedy_outputs(engine, prompts):
    outs = run(engine, prompts, SamplingParams(max_tokens=4, **GREEDY))
    return [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], dict(engine.recorded)


def test_weight_sync_after_relayout():
    """A bf16 engine holding the shift layout, synced to other weights (checkpoint-layout codes, one
    layer's scales then past MAX_SHIFT_SCALE): the same tokens and logits as a fresh engine with those
    weights, the codes in the layout each layer can hold."""
    prompts = random_prompts([13, 30], seed=2)
    new = build_model(load_preset("tiny"), torch.bfloat16, seed=1)
    layer = next(iter(experts_of(new)))
    new.get_submodule(layer).w1_scale[0, 0, 0] = MAX_SHIFT_SCALE + 2  # tiny: 2^3 times a few weights
    fresh = make_engine("bfloat16", seed=1)
    sync_weights(fresh, new)
    want_tokens, want_logits = greedy_outputs(fresh, prompts)
    engine = make_engine("bfloat16")
    apply_moe_layout(engine.model, "shift")
    sync_weights(engine, new)
    layouts = {n: m.mxfp4_layout for n, m in experts_of(engine.model).items()}
    assert layouts.pop(layer) == "checkpoint" and set(layouts.values()) == {"shift"}
    for n, m in experts_of(engine.model).items():
        for w in m.NAMES:
            assert torch.equal(m.checkpoint_codes(w), getattr(new.get_submodule(n), f"{w}_packed"))
    tokens, logits = greedy_outputs(engine, prompts)
    assert tokens == want_tokens
    assert logits.keys() == want_logits.keys() and all(torch.equal(logits[k], want_logits[k]) for k in logits)
    # a later sync whose scales allow it brings that layer back to the wanted shift layout
    sync_weights(engine, build_model(load_preset("tiny"), torch.bfloat16, seed=1))
    assert set(moe_layouts(engine.model)) == {"shift"}


def test_random_init_into_a_relaid_model():
    """init_random_weights on a model holding the shift layout: the same checkpoint codes as a fresh build."""
    from kimiserve.model.model import init_random_weights

    model = build_model(load_preset("tiny"), torch.bfloat16, seed=0)
    want = codes_of(build_model(load_preset("tiny"), torch.bfloat16, seed=5))
    apply_moe_layout(model, "shift")
    init_random_weights(model, seed=5)
    assert moe_layouts(model) == {"shift": len(experts_of(model))}
    for n, m in experts_of(model).items():
        assert all(torch.equal(m.checkpoint_codes(w), want[f"{n}.{w}"]) for w in m.NAMES)
