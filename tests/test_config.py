import json
from pathlib import Path

import pytest

from kimiserve.config import ModelConfig, load_preset, resolve_model
from kimiserve.utils.docs import field_docs

pytestmark = pytest.mark.fixed_threads  # no torch work: configs and their docs: OMP_NUM_THREADS changes nothing

FIXTURES = Path(__file__).parent / "fixtures"


def load_fixture(name):
    return ModelConfig.from_hf_config(json.loads((FIXTURES / name).read_text()))


def test_kimi_k3_release_config_parses():
    c = load_fixture("kimi_k3_config.json")
    assert c.architecture == "KimiK3ForConditionalGeneration" and c.weight_prefix == "language_model."
    assert c.num_hidden_layers == 93 and len(c.full_attn_layers) == 24 and len(c.kda_layers) == 69
    assert c.full_attn_layers[:2] == (3, 7) and c.full_attn_layers[-2:] == (91, 92)  # 1-based 4, 8, ..., 92, 93
    assert c.gate_lower_bound == -5.0 and c.kda_full_rank_output_gate
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_conv_size) == (96, 128, 4)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (1536, 512, 128, 64, 128)
    assert c.kv_latent_dim == 576 and c.qk_head_dim == 192 and c.mla_use_output_gate
    assert not c.has_indexer  # real K3: dense MLA
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.routed_expert_hidden_size, c.moe_intermediate_size, c.intermediate_size) == (3584, 3072, 33792)
    assert c.hidden_act == "situ" and c.activation_situ_beta == 4.0 and c.activation_situ_linear_beta == 25.0
    assert c.attn_res_block_size == 12 and c.routed_experts_mxfp4 and c.latent_moe_use_norm
    assert not c.is_moe_layer(0) and c.is_moe_layer(1) and c.is_moe_layer(92)
    assert c.max_position_embeddings == 1048576 and c.rms_norm_eps == 1e-5


def test_kimi_linear_release_config_parses():
    c = load_fixture("kimi_linear_48b_a3b_config.json")
    assert c.architecture == "KimiLinearForCausalLM" and c.weight_prefix == ""
    assert c.full_attn_layers == (3, 7, 11, 15, 19, 23, 26) and len(c.kda_layers) == 20
    assert c.gate_lower_bound is None and not c.kda_full_rank_output_gate  # softplus gate, low-rank output gate
    assert c.q_lora_rank is None and not c.mla_use_output_gate and not c.has_indexer
    assert c.routed_expert_hidden_size is None and c.hidden_act == "silu" and c.attn_res_block_size is None
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (256, 8, 1)
    assert c.routed_scaling_factor == 2.446 and not c.routed_experts_mxfp4
    assert c.max_position_embeddings == 1048576  # from model_max_length


def test_presets_and_round_trip_through_hf_json():
    pro = load_preset("kimi-k3.1-pro")
    assert (pro.index_n_heads, pro.index_head_dim, pro.index_topk) == (32, 128, 2048)
    tiny = load_preset("tiny")
    assert tiny.has_indexer and tiny.attn_res_block_size and tiny.routed_expert_hidden_size and tiny.q_lora_rank
    assert tiny.num_hidden_layers > tiny.attn_res_block_size * 2  # several seals
    for name in ("tiny", "small", "kimi-k3.1-pro"):
        c = load_preset(name)
        assert ModelConfig.from_hf_config(c.to_hf_config()) == c
    small = load_preset("small")
    assert (small.kda_num_heads, small.num_attention_heads, small.kv_latent_dim, small.index_topk) == (96, 96, 576, 2048)


def test_unknown_architecture_names_supported_ones():
    with pytest.raises(ValueError, match="KimiK3ForConditionalGeneration.*KimiLinearForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_experts_per_token": 0}, "num_experts_per_token"),
        ({"full_attn_layers": (7,)}, "full_attn_layers"),
        ({"index_topk": None}, "index_n_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"moe_intermediate_size": 48}, "moe_intermediate_size"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        load_preset("tiny").replace(**change)


def test_resolve_model_errors_and_field_docs(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    docs = field_docs(ModelConfig)
    assert all(name in docs and docs[name] for name in ModelConfig.__dataclass_fields__)
