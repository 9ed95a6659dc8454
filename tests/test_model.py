"""Whole-model and per-layer properties of the reference forward, and the checkpoint format."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import rel_rms, tiny_linear_config
from kimiserve.config import load_preset
from kimiserve.model.loader import load_model, load_weights, save_checkpoint
from kimiserve.model.mla import MLAAttention
from kimiserve.model.model import KimiForCausalLM, build_model
from kimiserve.model.moe import SparseMoE
from kimiserve.ops.activation.reference import situ_and_mul


@pytest.fixture(scope="module")
def tiny32():
    return build_model(load_preset("tiny"), torch.float32, seed=1)


def test_tiny_forward_is_finite_deterministic_and_causal(tiny32):
    ids = torch.randint(0, 1024, (2, 37))
    logits = tiny32(ids)
    assert logits.shape == (2, 37, 1024) and torch.isfinite(logits).all()
    assert torch.equal(logits, tiny32(ids))
    assert torch.equal(logits, build_model(load_preset("tiny"), torch.float32, seed=1)(ids))
    # changing token 20 leaves every earlier position unchanged (KDA, indexer and MLA are causal)
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 1024
    other = tiny32(changed)
    assert torch.equal(other[:, :20], logits[:, :20]) and not torch.equal(other[:, 20:], logits[:, 20:])
    # batch rows are independent: row 1 alone equals row 1 of the batch up to fp32 rounding. Another
    # batch size M runs another BLAS kernel (another summation order): fp32 dot products of K <= 1024
    # terms round differently by ~sqrt(K) * 6e-8 ~ 2e-6, grown through 7 layers (measured: median
    # 2e-6, worst position 1e-5, on AVX-512/AVX2/generic kernels, MKL's CNR paths, 1 and 2 threads),
    # so no elementwise 1e-5 bound holds on every CPU. Median position <= 1e-4 and at most one
    # position in ten off by > 1e-3 (a routed expert or a top-k pick at a near-tie may flip), as the
    # engine tests bound fp32 (engine_utils); rows that mixed would differ by ~1.4.
    alone = tiny32(ids[1:])[0]
    errors = sorted(rel_rms(alone[t], logits[1, t]) for t in range(37))
    assert errors[len(errors) // 2] <= 1e-4 and sum(e > 1e-3 for e in errors) <= 37 // 10, errors


def test_bf16_model_tracks_fp32_with_the_same_weights():
    b16 = build_model(load_preset("tiny"), torch.bfloat16, seed=2)
    f32 = KimiForCausalLM(b16.config, torch.float32).eval()
    f32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in b16.state_dict().items()})
    ids = torch.randint(0, 1024, (8, 25))
    a, b = b16(ids), f32(ids)
    assert torch.isfinite(a).all()
    # bf16 rounding (2^-9 per op, through 7 layers) moves each row by a few %; past the first
    # index_topk = 8 positions it also flips discrete choices (top-k picks; routed experts anywhere),
    # which move a row by 10-100%. So the check is statistical, over 200 rows, not a few (which flip
    # with another CPU's rounding): the first 8 positions, where only routing can flip, median < 0.06
    # (measured 0.029); all rows median < 0.15 (measured 0.060-0.063 on AVX-512/AVX2/generic kernels,
    # oneDNN's bf16 paths, MKL's CNR paths). A model of other weights gives 1.41.
    errors = torch.tensor([[rel_rms(a[i, t], b[i, t]) for t in range(25)] for i in range(8)])
    assert errors[:, :8].median() < 0.06 and errors.median() < 0.15, errors


def test_kimi_linear_shaped_model_runs():
    config = tiny_linear_config()
    model = build_model(config, torch.float32, seed=0)
    assert not hasattr(model.model.layers[3].self_attn, "indexer")
    assert hasattr(model.model.layers[0].self_attn, "g_a_proj")
    logits = model(torch.randint(0, 1024, (1, 30)))
    assert torch.isfinite(logits).all()


def test_sparse_mla_with_topk_at_least_context_equals_dense():
    config = load_preset("tiny").replace(index_topk=64)
    attn = build_model(config, torch.float32, seed=3).model.layers[3].self_attn
    x = torch.randn(2, 40, config.hidden_size)
    sparse = attn(x)
    del attn.indexer
    assert torch.equal(sparse, attn(x))


def test_sparsity_changes_attention_when_context_exceeds_topk(tiny32):
    attn: MLAAttention = tiny32.model.layers[3].self_attn
    x = torch.randn(1, 30, 64)
    sparse = attn(x)
    indexer = attn.indexer
    del attn.indexer
    dense = attn(x)
    attn.indexer = indexer
    topk = indexer.topk
    assert torch.equal(sparse[:, :topk], dense[:, :topk])  # contexts <= k attend to all
    assert not torch.allclose(sparse[:, topk:], dense[:, topk:])


def test_moe_layer_equals_per_token_loop(tiny32):
    moe: SparseMoE = tiny32.model.layers[1].block_sparse_moe
    cfg = tiny32.config
    x = torch.randn(9, cfg.hidden_size)
    out = moe(x)
    for n in range(9):
        scores = torch.sigmoid(x[n] @ moe.gate.weight.T)
        chosen = torch.argsort(scores + moe.gate.e_score_correction_bias, descending=True)[: cfg.num_experts_per_token]
        weights = scores[chosen] / scores[chosen].sum()
        h = moe.routed_expert_down_proj.weight @ x[n]
        routed = sum(
            w * (moe.experts.expert_weight("w2", int(e)) @ situ_and_mul(
                moe.experts.expert_weight("w1", int(e)) @ h, moe.experts.expert_weight("w3", int(e)) @ h, 4.0, 25.0))
            for e, w in zip(chosen, weights)
        )
        rms = routed.pow(2).mean().sqrt()
        routed = moe.routed_expert_norm.weight * routed / torch.sqrt(rms**2 + cfg.rms_norm_eps)
        shared = moe.shared_experts.down_proj.weight @ situ_and_mul(
            moe.shared_experts.gate_proj.weight @ x[n], moe.shared_experts.up_proj.weight @ x[n], 4.0, 25.0)
        torch.testing.assert_close(out[n], moe.routed_expert_up_proj.weight @ routed + shared, rtol=1e-4, atol=1e-5)


def test_shared_expert_overlap_computes_the_serial_sum(tiny32, monkeypatch):
    """`DecodeOps.overlap_shared_experts` (CUDA streams, here stand-ins that record the order of the calls): the
    shared experts' down projection goes to the side stream after it waits for the main one, the main stream waits
    for it before the add, and the block's output is bit for bit the serial one (`linear_ref.linear_add`'s sum);
    without CUDA the flag changes nothing."""
    import contextlib

    from kimiserve.ops.backend import REFERENCE_OPS, shared_expert_overlap_ops

    moe: SparseMoE = tiny32.model.layers[1].block_sparse_moe
    x = torch.randn(5, tiny32.config.hidden_size, generator=torch.Generator().manual_seed(3))
    ops = shared_expert_overlap_ops(REFERENCE_OPS)
    serial = moe(x)
    assert torch.equal(moe(x, ops), serial) and moe.side_stream is None  # the CPU: no second stream
    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(f"{self.name} waits for {other.name}")

    main, side = Stream("main"), Stream("side")

    @contextlib.contextmanager
    def on(stream):
        calls.append(f"enter {stream.name}")
        yield
        calls.append(f"leave {stream.name}")

    down = moe.shared_experts.down
    monkeypatch.setattr(moe, "_side_stream", lambda t: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(moe.shared_experts, "down", lambda *a: calls.append("shared down") or down(*a))
    assert torch.equal(moe(x, ops), serial)
    assert calls == ["side waits for main", "enter side", "shared down", "leave side", "main waits for side"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear", [False, True])
def test_checkpoint_round_trip_is_bit_identical(tmp_path, dtype, linear):
    config = tiny_linear_config() if linear else load_preset("tiny")
    model = build_model(config, dtype, seed=4)
    shards = save_checkpoint(model, tmp_path, max_shard_bytes=200_000)
    assert len(shards) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    loaded = load_model(tmp_path, dtype)
    ids = torch.randint(0, 1024, (1, 33))
    assert torch.equal(model(ids), loaded(ids))


def test_checkpoint_uses_release_names_and_mxfp4_layout(tmp_path):
    config = load_preset("tiny")
    save_checkpoint(build_model(config, torch.bfloat16, seed=0), tmp_path)
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    p = "language_model.model.layers."
    expected = [
        "language_model.lm_head.weight", "language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
        "language_model.model.output_attn_res_norm.weight", "language_model.model.output_attn_res_proj.weight",
        p + "0.mlp.gate_proj.weight", p + "0.self_attn.q_conv1d.weight", p + "0.self_attn.A_log", p + "0.self_attn.g_proj.weight",
        p + "0.self_attention_res_proj.weight", p + "1.mlp_res_norm.weight",
        p + "3.self_attn.kv_a_proj_with_mqa.weight", p + "3.self_attn.q_a_layernorm.weight",
        p + "3.self_attn.indexer.wq_b.weight", p + "3.self_attn.indexer.k_norm.bias", p + "3.self_attn.indexer.weights_proj.weight",
        p + "1.block_sparse_moe.gate.e_score_correction_bias", p + "1.block_sparse_moe.routed_expert_down_proj.weight",
        p + "1.block_sparse_moe.experts.7.w2.weight_packed", p + "1.block_sparse_moe.experts.7.w2.weight_scale",
        p + "1.block_sparse_moe.shared_experts.up_proj.weight",
    ]
    assert not [n for n in expected if n not in names]
    tensors = load_file(str(tmp_path / names[p + "1.block_sparse_moe.experts.7.w2.weight_packed"]))
    packed = tensors[p + "1.block_sparse_moe.experts.7.w2.weight_packed"]
    h, inter = config.moe_hidden_size, config.moe_intermediate_size
    assert packed.dtype == torch.uint8 and packed.shape == (h, inter // 2)
    assert tensors[p + "1.block_sparse_moe.experts.7.w2.weight_scale"].shape == (h, inter // 32)
    with safe_open(str(tmp_path / names[p + "0.self_attn.q_conv1d.weight"]), "pt") as f:
        assert f.get_slice(p + "0.self_attn.q_conv1d.weight").get_shape() == [64, 1, 4]
        assert f.get_slice(p + "0.self_attn.A_log").get_shape() == [128]  # K3 pads A_log to 128 entries
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"


def _rewrite_shard(folder, name, fn):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard))


def test_bad_checkpoints_fail_with_names(tmp_path):
    save_checkpoint(build_model(load_preset("tiny"), torch.float32, seed=0), tmp_path)
    model = build_model(load_preset("tiny"), torch.float32, seed=None)
    name = "language_model.model.layers.2.self_attn.o_proj.weight"
    _rewrite_shard(tmp_path, name, lambda t: t.__setitem__(name, t[name][:, :10].contiguous()))
    with pytest.raises(ValueError, match=r"layers\.2\.self_attn\.o_proj\.weight has shape \(64, 10\).*\(64, 64\)"):
        load_weights(model, tmp_path)
    _rewrite_shard(tmp_path, name, lambda t: t.pop(name))
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.2\.self_attn\.o_proj\.weight"):
        load_weights(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: KimiK3ForConditionalGeneration, KimiLinearForCausalLM"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    save_checkpoint(build_model(load_preset("tiny"), torch.float32, seed=0), tmp_path)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    _rewrite_shard(tmp_path, name, lambda t: t.__setitem__("language_model.model.layers.0.self_attn.bogus", torch.zeros(2)))
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["language_model.model.layers.0.self_attn.bogus"] = index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="match no parameter.*self_attn.bogus"):
        load_weights(build_model(load_preset("tiny"), torch.float32, seed=None), tmp_path)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 9, 300])
def test_routed_expert_forms_agree(tokens, mxfp4):
    """The routing-independent forms (a token's own experts; every expert, weighted 0 where unrouted)
    equal the loop over picked experts."""
    from kimiserve.model.moe import RoutedExperts
    from kimiserve.ops.moe.reference import experts_forward

    config = load_preset("tiny").replace(routed_experts_mxfp4=mxfp4)
    experts = build_model(config, torch.float32, seed=4).model.layers[1].block_sparse_moe.experts
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, config.moe_hidden_size, generator=g)
    ids = torch.stack([torch.randperm(config.num_experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    ref = experts_forward(x, ids, weights, experts.run_expert, experts.num_experts)
    assert isinstance(experts, RoutedExperts)
    assert torch.allclose(experts(x, ids, weights), ref, rtol=1e-5, atol=1e-6)
