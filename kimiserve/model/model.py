"""The Kimi-K3.1 family decoder stack: embedding, hybrid KDA/MLA layers, (latent) MoE, attention residuals."""

from __future__ import annotations

import math

import torch
from torch import nn

from kimiserve.cache.formats import check_kv_cache_dtype
from kimiserve.config import ModelConfig
from kimiserve.model import attn_res
from kimiserve.model.batch import CacheRoundTrip, ForwardBatch
from kimiserve.model.kda import KimiDeltaAttention
from kimiserve.model.layers import Linear, RMSNorm, Weights
from kimiserve.model.mla import MLAAttention
from kimiserve.model.moe import MLP, SparseMoE
from kimiserve.ops.quant.reference import quantize_mxfp4

AttentionContext = ForwardBatch | CacheRoundTrip | None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        d = config.hidden_size
        self.layer, self.eps = layer, config.rms_norm_eps
        self.block_size = config.attn_res_block_size
        if config.is_mla_layer(layer):
            self.self_attn = MLAAttention(config, dtype, config.full_attn_layers.index(layer))
        else:
            self.self_attn = KimiDeltaAttention(config, dtype, config.kda_layers.index(layer))
        if config.is_moe_layer(layer):
            self.block_sparse_moe = SparseMoE(config, dtype)
        else:
            self.mlp = MLP(config, d, config.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        if self.block_size is not None:
            self.self_attention_res_norm, self.self_attention_res_proj = attn_res.read_site_modules(d, dtype)
            self.mlp_res_norm, self.mlp_res_proj = attn_res.read_site_modules(d, dtype)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, x: torch.Tensor, ctx: AttentionContext = None) -> torch.Tensor:
        """Plain pre-norm residual layer (no attention residuals)."""
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.ffn(self.post_attention_layernorm(x))

    def forward_attn_res(
        self, running: torch.Tensor, blocks: list[torch.Tensor], ctx: AttentionContext = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One layer with block attention-residuals.

        `running` is the live sum of sublayer outputs since the last seal, `blocks` the sealed
        snapshots (the first is the embedding). Each sublayer input is a read (softmax mix) of the
        snapshots and the live sum; a snapshot is sealed before the attention of every
        block_size-th layer; sublayer outputs are added to the live sum only.
        """
        x = attn_res.read(running, blocks, self.self_attention_res_norm, self.self_attention_res_proj, self.eps) if blocks else running
        live: torch.Tensor | None = running
        if self.layer % self.block_size == 0:
            blocks, live = [*blocks, running], None
        a = self.self_attn(self.input_layernorm(x), ctx)
        live = a if live is None else live + a
        x = attn_res.read(live, blocks, self.mlp_res_norm, self.mlp_res_proj, self.eps)
        return live + self.ffn(self.post_attention_layernorm(x)), blocks


class KimiModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = Weights(config.vocab_size, d, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm, self.output_attn_res_proj = attn_res.read_site_modules(d, dtype)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext = None) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, d] (after the final norm).

        ctx: None (full sequences from scratch), a CacheRoundTrip (the same, reading the attention
        cache as a lossy cache dtype would), or a ForwardBatch (packed serving tokens, B = 1).
        """
        h = torch.nn.functional.embedding(input_ids, self.embed_tokens.weight)
        if self.config.attn_res_block_size is None:
            for layer in self.layers:
                h = layer(h, ctx)
        else:
            blocks: list[torch.Tensor] = []
            for layer in self.layers:
                h, blocks = layer.forward_attn_res(h, blocks, ctx)
            h = attn_res.read(h, blocks, self.output_attn_res_norm, self.output_attn_res_proj, self.config.rms_norm_eps)
        return self.norm(h)


class KimiForCausalLM(nn.Module):
    """Full-sequence forward of a Kimi-K3.1-family text model: token ids in, fp32 logits out."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.model = KimiModel(config, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.lm_head_weight.to(h.dtype)).float()

    def check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv_cache_dtype: str | None = None,
                index_key_rotation: bool | None = None) -> torch.Tensor:
        """Full-sequence forward: ids [B, T] or [T] -> fp32 logits [B, T, vocab] (or [T, vocab]).

        kv_cache_dtype: read MLA latents and index keys as that cache dtype would return them
        (the oracle of the serving path); None keeps them exact. index_key_rotation: as the engine's
        (None = on for fp4 index keys).
        """
        if input_ids.dim() == 1:
            return self.forward(input_ids.unsqueeze(0), kv_cache_dtype, index_key_rotation)[0]
        self.check_ids(input_ids)
        ctx = None
        if kv_cache_dtype is not None:
            check_kv_cache_dtype(kv_cache_dtype)
            ctx = CacheRoundTrip(kv_cache_dtype, index_key_rotation=index_key_rotation)
        return self.logits(self.model(input_ids, ctx))

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, logits_rows: torch.Tensor) -> torch.Tensor:
        """Serving forward of packed tokens ids [N] through the page cache -> fp32 logits of `logits_rows` [M, vocab]."""
        h = self.model(input_ids.unsqueeze(0), batch)[0]
        return self.logits(h[logits_rows])


@torch.no_grad()
def init_random_weights(model: KimiForCausalLM, seed: int = 0) -> KimiForCausalLM:
    """Deterministic random weights of sensible scale (for tests, benchmarks and checkpoints).

    Routed MXFP4 experts are drawn in float and quantised, so a checkpoint written from the model
    holds exactly the model's weights. Values are drawn on the parameters' device: the same seed
    gives the same weights on the same kind of device.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, device=device) * std

    def uniform(shape):
        return torch.rand(shape, generator=gen, device=device)

    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(param.shape)
        if name.endswith("_packed"):
            continue  # drawn together with its scale below
        if name.endswith("_scale"):
            base = name[: -len("_scale")]
            packed = model.get_parameter(base + "_packed")
            E, out, half = packed.shape
            w = normal((E, out, half * 2), (half * 2) ** -0.5)
            packed.data, param.data = quantize_mxfp4(w)
            continue
        if leaf == "A_log":
            value = torch.log(uniform(shape) * 15 + 1)
        elif leaf == "dt_bias":
            dt = torch.exp(uniform(shape) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif "conv1d" in name:
            value = (uniform(shape) * 2 - 1) * shape[-1] ** -0.5
        elif name.endswith("e_score_correction_bias") or name.endswith("k_norm.bias"):
            value = normal(shape, 0.05)
        elif name.endswith("embed_tokens.weight"):
            value = normal(shape, 1.0)
        elif len(shape) == 1:  # norm gains
            value = 1.0 + normal(shape, 0.05)
        else:  # [out, in] projections ([1, d] attention-residual queries, [E, out, in] float experts)
            value = normal(shape, shape[-1] ** -0.5)
        param.data.copy_(value)
    return model


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int | None = 0, device: str | torch.device = "cpu"
) -> KimiForCausalLM:
    """A model on `device` with random weights from `seed` (None: uninitialised, for a loader to fill)."""
    with torch.device(device):
        model = KimiForCausalLM(config, dtype)
    model.eval()
    return init_random_weights(model, seed) if seed is not None else model
