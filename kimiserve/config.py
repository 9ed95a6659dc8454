"""ModelConfig: what a Kimi-K3.1-family checkpoint means, read from a HF `config.json`.

Layer indices are 0-based everywhere in kimiserve; HF's `linear_attn_config` lists are 1-based
and are converted on the way in and out.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")
"""Architectures kimiserve can load. K3 nests the text model under `language_model.`."""

PRESETS_DIR = Path(__file__).parent / "presets"
TRAINED_PRESETS = ("kimi-demo", "kimi-demo-draft")
"""Presets shipped with trained weights: a model folder in the package (scripts/train_demo.py: `kimi-demo`,
and `kimi-demo-draft`, its small draft for speculative decoding)."""
RANDOM_PRESETS = ("tiny", "small", "kimi-k3.1-pro")
"""Presets that are configurations only: their weights are random, drawn from a seed."""
PRESET_NAMES = TRAINED_PRESETS + RANDOM_PRESETS
DEFAULT_MODEL = "kimi-demo"


@dataclass
class ModelConfig:
    """Hyper-parameters of one Kimi-K3.1-family text model."""

    architecture: str = "KimiK3ForConditionalGeneration"
    """HF architecture; decides the checkpoint's tensor-name prefix (`language_model.` for K3)."""
    vocab_size: int = 163840
    """Rows of the embedding and of lm_head."""
    hidden_size: int = 7168
    """Width of the residual stream."""
    num_hidden_layers: int = 93
    """Decoder layers, KDA and MLA together."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (and of the attention-residual score norm)."""
    max_position_embeddings: int = 1048576
    """Longest context the model was trained for."""
    bos_token_id: int = 163584
    """Beginning-of-sequence token id."""
    eos_token_id: int = 163586
    """End-of-sequence token id (`<|im_end|>` for Kimi chat models)."""
    pad_token_id: int = 163839
    """Padding token id."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with lm_head."""
    torch_dtype: str = "bfloat16"
    """Dtype of the released (non-quantised) weights."""

    full_attn_layers: tuple[int, ...] = ()
    """0-based indices of the MLA layers; every other layer is a KDA layer."""
    kda_num_heads: int = 96
    """KDA heads."""
    kda_head_dim: int = 128
    """KDA key = value head size."""
    kda_conv_size: int = 4
    """Kernel of the causal depthwise short convolution on KDA q, k and v."""
    gate_lower_bound: float | None = -5.0
    """K3 gate: g = lb * sigmoid(exp(A_log) * (f + dt_bias)). None selects Kimi-Linear's softplus gate."""
    kda_full_rank_output_gate: bool = True
    """Output gate g_proj: hidden -> heads*head_dim (K3). False: low rank g_a_proj/g_b_proj (Kimi-Linear)."""

    num_attention_heads: int = 96
    """MLA heads."""
    q_lora_rank: int | None = 1536
    """Rank of the MLA query LoRA (q_a_proj/q_b_proj); None: one q_proj."""
    kv_lora_rank: int = 512
    """Width of the normed MLA latent cached per token."""
    qk_nope_head_dim: int = 128
    """Per-head query/key width produced from the latent."""
    qk_rope_head_dim: int = 64
    """Per-token shared key part (named rope, never rotated: the model is NoPE)."""
    v_head_dim: int = 128
    """Per-head value width."""
    mla_use_output_gate: bool = True
    """Multiply MLA output by sigmoid(g_proj x) before o_proj."""

    index_n_heads: int | None = None
    """Indexer heads (K3.1). None: no indexer, dense MLA."""
    index_head_dim: int | None = None
    """Indexer query/key width."""
    index_topk: int | None = None
    """Tokens each query attends to when the indexer is present."""

    hidden_act: str = "situ"
    """MLP activation: `situ` (K3) or `silu` (Kimi-Linear)."""
    activation_situ_beta: float = 4.0
    """SiTU gate bound: beta * tanh(gate / beta) * sigmoid(gate)."""
    activation_situ_linear_beta: float | None = 25.0
    """SiTU up bound: lb * tanh(up / lb); None leaves `up` unbounded."""
    intermediate_size: int = 33792
    """Intermediate width of the dense MLP layers."""
    first_k_dense_replace: int = 1
    """The first this-many layers use a dense MLP instead of MoE."""
    moe_layer_freq: int = 1
    """Every this-many layers (after the dense ones) is MoE."""
    num_experts: int | None = 896
    """Routed experts per MoE layer; None: every layer is dense."""
    num_experts_per_token: int = 16
    """Routed experts active per token."""
    num_shared_experts: int = 2
    """Shared experts (run as one MLP of width num_shared_experts * moe_intermediate_size)."""
    moe_intermediate_size: int = 3072
    """Intermediate width of one expert."""
    routed_expert_hidden_size: int | None = 3584
    """LatentMoE: routed experts run in this width (down/up projections around them); None: plain MoE."""
    latent_moe_use_norm: bool = True
    """RMSNorm the combined routed output in latent space before the up-projection."""
    moe_router_activation_func: str = "sigmoid"
    """Router score function: `sigmoid` or `softmax`."""
    moe_renormalize: bool = True
    """Renormalise the selected experts' weights to sum to one."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' weights."""
    num_expert_group: int = 1
    """Expert groups for grouped top-k routing (1: plain top-k)."""
    topk_group: int = 1
    """Groups kept per token in grouped routing."""

    attn_res_block_size: int | None = 12
    """Block attention-residuals: a snapshot of the stream is sealed every this-many layers; None: plain residuals."""

    routed_experts_mxfp4: bool = True
    """Routed expert weights are stored MXFP4 (compressed-tensors `mxfp4-pack-quantized`, group 32)."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Fields of the original config.json kept verbatim so a written checkpoint round-trips."""

    def __post_init__(self) -> None:
        self.full_attn_layers = tuple(int(i) for i in self.full_attn_layers)
        self.validate()

    # ------------------------------------------------------------------ structure
    @property
    def is_k3(self) -> bool:
        return self.architecture == "KimiK3ForConditionalGeneration"

    @property
    def weight_prefix(self) -> str:
        """Prefix of every text-model tensor name in the checkpoint."""
        return "language_model." if self.is_k3 else ""

    @property
    def kda_layers(self) -> tuple[int, ...]:
        full = set(self.full_attn_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in full)

    def is_mla_layer(self, layer: int) -> bool:
        return layer in self.full_attn_layers

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token per MLA layer: normed latent + shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_hidden_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def validate(self) -> None:
        """Raise ValueError naming the field when the configuration cannot describe a model."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim", "kda_conv_size",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
            "moe_layer_freq", "num_expert_group", "topk_group",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bad = [i for i in self.full_attn_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"full_attn_layers {bad} outside 0..{self.num_hidden_layers - 1} (0-based)")
        if self.hidden_act not in ("situ", "silu"):
            raise ValueError(f"hidden_act must be 'situ' or 'silu', got {self.hidden_act!r}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func must be 'sigmoid' or 'softmax', got {self.moe_router_activation_func!r}")
        index = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if any(v is not None for v in index) and any(v is None for v in index):
            raise ValueError("index_n_heads, index_head_dim and index_topk must be given together (or all left out)")
        if self.index_topk is not None and self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")
        if self.num_experts is not None:
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_token must be in 1..num_experts={self.num_experts}, got {self.num_experts_per_token}"
                )
            if self.num_experts % self.num_expert_group:
                raise ValueError(f"num_experts={self.num_experts} is not divisible by num_expert_group={self.num_expert_group}")
            if self.topk_group > self.num_expert_group:
                raise ValueError(f"topk_group={self.topk_group} exceeds num_expert_group={self.num_expert_group}")
            if self.routed_experts_mxfp4:
                for name in ("moe_hidden_size", "moe_intermediate_size"):
                    if getattr(self, name) % 32:
                        raise ValueError(f"MXFP4 experts need {name} divisible by 32, got {getattr(self, name)}")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1 or None, got {self.attn_res_block_size}")

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a HF `config.json` (K3 multimodal wrapper or Kimi-Linear)."""
        architectures = raw.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        text = raw["text_config"] if arch == "KimiK3ForConditionalGeneration" else raw
        if not isinstance(text, dict):
            raise ValueError("config.json of KimiK3ForConditionalGeneration needs a `text_config` object")
        lin = text.get("linear_attn_config") or {}
        n_layers = text["num_hidden_layers"]
        full_1based = lin.get("full_attn_layers")
        full = tuple(i - 1 for i in full_1based) if full_1based is not None else tuple(range(n_layers))
        quant = text.get("quantization_config") or raw.get("quantization_config")
        mxfp4 = bool(quant) and "mxfp4" in str(quant.get("format", ""))
        get = text.get
        return cls(
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_hidden_layers=n_layers,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            max_position_embeddings=get("max_position_embeddings") or get("model_max_length") or 4096,
            bos_token_id=get("bos_token_id", raw.get("bos_token_id", 1)),
            eos_token_id=get("eos_token_id", raw.get("eos_token_id", 2)),
            pad_token_id=get("pad_token_id", raw.get("pad_token_id", 0)),
            tie_word_embeddings=get("tie_word_embeddings", False),
            torch_dtype=get("dtype", get("torch_dtype", "bfloat16")),
            full_attn_layers=full,
            kda_num_heads=lin.get("num_heads", text["num_attention_heads"]),
            kda_head_dim=lin.get("head_dim", 128),
            kda_conv_size=lin.get("short_conv_kernel_size", 4),
            gate_lower_bound=lin.get("gate_lower_bound"),
            kda_full_rank_output_gate=bool(lin.get("use_full_rank_gate", False)),
            num_attention_heads=text["num_attention_heads"],
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank") or 512,
            qk_nope_head_dim=get("qk_nope_head_dim") or 128,
            qk_rope_head_dim=get("qk_rope_head_dim") or 64,
            v_head_dim=get("v_head_dim") or 128,
            mla_use_output_gate=bool(get("mla_use_output_gate", False)),
            index_n_heads=get("index_n_heads"),
            index_head_dim=get("index_head_dim"),
            index_topk=get("index_topk"),
            hidden_act=get("hidden_act", "silu"),
            activation_situ_beta=get("activation_situ_beta") or 1.0,
            activation_situ_linear_beta=get("activation_situ_linear_beta"),
            intermediate_size=get("intermediate_size"),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            moe_layer_freq=get("moe_layer_freq", 1),
            num_experts=get("num_experts"),
            num_experts_per_token=get("num_experts_per_token") or 1,
            num_shared_experts=get("num_shared_experts") or 0,
            moe_intermediate_size=get("moe_intermediate_size") or 0,
            routed_expert_hidden_size=get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(get("latent_moe_use_norm", False)),
            moe_router_activation_func=get("moe_router_activation_func", "sigmoid"),
            moe_renormalize=bool(get("moe_renormalize", True)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            num_expert_group=get("num_expert_group") or 1,
            topk_group=get("topk_group") or 1,
            attn_res_block_size=get("attn_res_block_size"),
            routed_experts_mxfp4=mxfp4,
            extra=copy.deepcopy(raw),
        )

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json; give a model folder or one of the presets {PRESET_NAMES}")
        with open(path) as f:
            return cls.from_hf_config(json.load(f))

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict of this model, in its architecture's release layout."""
        kda_1based = [i + 1 for i in self.kda_layers]
        full_1based = [i + 1 for i in self.full_attn_layers]
        lin: dict[str, Any] = {
            "full_attn_layers": full_1based,
            "kda_layers": kda_1based,
            "head_dim": self.kda_head_dim,
            "num_heads": self.kda_num_heads,
            "short_conv_kernel_size": self.kda_conv_size,
        }
        if self.gate_lower_bound is not None:
            lin["gate_lower_bound"] = self.gate_lower_bound
        if self.kda_full_rank_output_gate:
            lin["use_full_rank_gate"] = True
        text: dict[str, Any] = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.torch_dtype,
            "linear_attn_config": lin,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": self.mla_use_output_gate,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_activation_func": self.moe_router_activation_func,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "use_grouped_topk": True,
            "topk_method": "noaux_tc",
        }
        if self.hidden_act == "situ":
            text["activation_situ_beta"] = self.activation_situ_beta
            text["activation_situ_linear_beta"] = self.activation_situ_linear_beta
        if self.routed_expert_hidden_size is not None:
            text["routed_expert_hidden_size"] = self.routed_expert_hidden_size
            text["latent_moe_use_norm"] = self.latent_moe_use_norm
        if self.attn_res_block_size is not None:
            text["attn_res_block_size"] = self.attn_res_block_size
        if self.has_indexer:
            text.update(index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk)
        if self.routed_experts_mxfp4:
            text["quantization_config"] = mxfp4_quantization_config()
        if not self.is_k3:
            text["architectures"] = ["KimiLinearForCausalLM"]
            return text
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.torch_dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }

    def replace(self, **changes: Any) -> "ModelConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def mxfp4_quantization_config() -> dict[str, Any]:
    """compressed-tensors config for MXFP4 routed experts, as the K3 release writes it."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                    "observer": "minmax",
                },
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
    }


def load_preset(name: str) -> ModelConfig:
    """A built-in configuration: `kimi-demo` (the trained demo model), `tiny` (random, CPU tests), `small`
    (random, one GPU, real attention sizes), `kimi-k3.1-pro` (random, the full model's shape)."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)}")
    folder = PRESETS_DIR / name
    path = folder / "config.json" if folder.is_dir() else PRESETS_DIR / f"{name}.json"
    with open(path) as f:
        return ModelConfig.from_hf_config(json.load(f))


def apply_overrides(config: ModelConfig, overrides: dict[str, Any] | None) -> ModelConfig:
    """`config` with the given fields changed (ModelConfig field names, 0-based layer indices; vLLM's
    `hf_overrides` in kimiserve's terms); ValueError naming an unknown field or an invalid result. The
    original config.json (`extra`) no longer describes the result, so it is dropped."""
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise ValueError(f"model overrides must be a dict of ModelConfig fields, got {type(overrides).__name__}")
    known = {f.name for f in fields(ModelConfig)} - {"extra"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model overrides name unknown ModelConfig fields {unknown}; known: {', '.join(sorted(known))}")
    try:
        return config.replace(**overrides, extra={})
    except TypeError as e:  # e.g. a list where a number belongs
        raise ValueError(f"model overrides {overrides} do not make a ModelConfig: {e}") from None


def model_folder(model: str | os.PathLike) -> Path | None:
    """The checkpoint folder of `model`: a trained preset's folder in the package or `model` itself when it
    is a folder; None for a random-weight preset (and for anything else)."""
    if str(model) in TRAINED_PRESETS:
        return PRESETS_DIR / str(model)
    if str(model) in RANDOM_PRESETS or not os.path.isdir(model):
        return None
    return Path(model)


def resolve_model_folder(model: str | os.PathLike) -> Path:
    """`model_folder`, or a ValueError saying why `model` has no checkpoint folder."""
    folder = model_folder(model)
    if folder is None:
        raise ValueError(f"{model!r} has no checkpoint folder: give a model folder or a trained preset "
                         f"({', '.join(TRAINED_PRESETS)}); {', '.join(RANDOM_PRESETS)} have random weights")
    return folder


def resolve_model(model: str) -> ModelConfig:
    """A preset name or a model folder."""
    if model in PRESET_NAMES:
        return load_preset(model)
    if os.path.isdir(model):
        return ModelConfig.from_pretrained(model)
    raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a model folder")


def tiny_parallel_config() -> ModelConfig:
    """The tiny preset resized for the tensor-parallel tests: every split size divides by 2, 3 and 4
    (12 KDA heads, 12 MLA heads, 12 routed experts, dense intermediate 192, latent 96, shared
    expert 384) and MXFP4 experts still split on whole 32-value scale groups at tp 2, 3 and 4
    (moe_intermediate_size 384: 192, 128, 96 per rank). The vocabulary (1024) does not divide by 3,
    so tp 3 pads it. 5 layers = 3 KDA + 2 MLA (with the indexer, replicated), attention-residual
    block 2."""
    return load_preset("tiny").replace(
        hidden_size=128, num_hidden_layers=5, full_attn_layers=(2, 4), kda_num_heads=12, kda_head_dim=8,
        num_attention_heads=12, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        index_n_heads=4, index_head_dim=16, index_topk=8, intermediate_size=192, num_experts=12,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=384, routed_expert_hidden_size=96,
        attn_res_block_size=2, extra={},
    )
