"""The Kimi-K3.1 family decoder stack: embedding, hybrid KDA/MLA layers, (latent) MoE, attention residuals."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from kimiserve.cache.formats import check_kv_cache_dtype
from kimiserve.config import ModelConfig
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.model import attn_res
from kimiserve.model.batch import CacheRoundTrip, ForwardBatch
from kimiserve.model.kda import KimiDeltaAttention
from kimiserve.model.layers import RMSNorm
from kimiserve.model.mla import MLAAttention
from kimiserve.model.moe import MLP, SparseMoE
from kimiserve.model.parallel_layers import ParallelLMHead, VocabParallelEmbedding, context, vocab_parallel_logits
from kimiserve.ops.backend import REFERENCE_OPS, DecodeOps
from kimiserve.ops.quant.reference import quantize_mxfp4

AttentionContext = ForwardBatch | CacheRoundTrip | None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, parallel: ParallelContext | None = None):
        super().__init__()
        d = config.hidden_size
        self.layer, self.eps = layer, config.rms_norm_eps
        self.block_size = config.attn_res_block_size
        if config.is_mla_layer(layer):
            self.self_attn = MLAAttention(config, dtype, config.full_attn_layers.index(layer), parallel)
        else:
            self.self_attn = KimiDeltaAttention(config, dtype, config.kda_layers.index(layer), parallel)
        if config.is_moe_layer(layer):
            self.block_sparse_moe = SparseMoE(config, dtype, parallel)
        else:
            self.mlp = MLP(config, d, config.intermediate_size, dtype, parallel, what="the dense MLP's intermediate_size")
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        if self.block_size is not None:
            self.self_attention_res_norm, self.self_attention_res_proj = attn_res.read_site_modules(d, dtype)
            self.mlp_res_norm, self.mlp_res_proj = attn_res.read_site_modules(d, dtype)

    def ffn(self, x: torch.Tensor, ops: DecodeOps = REFERENCE_OPS) -> torch.Tensor:
        return self.block_sparse_moe(x, ops) if hasattr(self, "block_sparse_moe") else self.mlp(x, ops)

    def forward(self, x: torch.Tensor, ctx: AttentionContext = None) -> torch.Tensor:
        """Plain pre-norm residual layer (no attention residuals)."""
        ops = glue_ops(ctx)
        h, _ = ops.add_read_norm(x, None, [], None, None, self.input_layernorm.weight, self.eps)
        h, x = ops.add_read_norm(x, self.self_attn(h, ctx), [], None, None, self.post_attention_layernorm.weight,
                                 self.eps)
        return x + self.ffn(h, ops)

    def forward_attn_res(
        self, running: torch.Tensor, blocks: list[torch.Tensor], ctx: AttentionContext = None,
        store: torch.Tensor | None = None, addend: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """One layer with block attention-residuals.

        `running` is the live sum of sublayer outputs since the last seal (plus `addend`, the layer
        before's MLP output, when given: the add is done in this layer's first read), `blocks` the
        sealed snapshots (the first is the embedding). Each sublayer input is a read (softmax mix) of
        the snapshots and the live sum; a snapshot is sealed before the attention of every
        block_size-th layer (into `store` when given, `attn_res.seal`); sublayer outputs are added to
        the live sum only. The residual add, the read and the norm before a sublayer are one op
        (`DecodeOps.add_read_norm`: one kernel on the serving path on CUDA). Returns (the live sum
        without this layer's MLP output, that output, the blocks).
        """
        ops = glue_ops(ctx)
        x, running = ops.add_read_norm(running, addend, blocks, self.self_attention_res_norm.weight,
                                       self.self_attention_res_proj.weight, self.input_layernorm.weight, self.eps)
        live: torch.Tensor | None = running
        if self.layer % self.block_size == 0:
            blocks, live = attn_res.seal(blocks, running, store), None
        a = self.self_attn(x, ctx)
        x, live = ops.add_read_norm(a if live is None else live, None if live is None else a, blocks,
                                    self.mlp_res_norm.weight, self.mlp_res_proj.weight,
                                    self.post_attention_layernorm.weight, self.eps)
        return live, self.ffn(x, ops), blocks


def glue_ops(ctx: AttentionContext) -> DecodeOps:
    """The ops of the norms, residual reads, router and activations: a serving batch's (`ForwardBatch.ops`,
    the Triton kernels on CUDA), the references for the full-sequence forward and training."""
    return ctx.ops if isinstance(ctx, ForwardBatch) else REFERENCE_OPS


class KimiModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: ParallelContext | None = None):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d, dtype, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, parallel) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm, self.output_attn_res_proj = attn_res.read_site_modules(d, dtype)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext = None) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, d] (after the final norm).

        ctx: None (full sequences from scratch), a CacheRoundTrip (the same, reading the attention
        cache as a lossy cache dtype would), or a ForwardBatch (packed serving tokens, B = 1).
        """
        h = self.embed_tokens(input_ids)
        ops = glue_ops(ctx)
        if self.config.attn_res_block_size is None:
            for layer in self.layers:
                h = layer(h, ctx)
            return ops.rms_norm(h, self.norm.weight, self.norm.eps)
        blocks: list[torch.Tensor] = []
        store = attn_res.block_store(h, self.config) if isinstance(ctx, ForwardBatch) else None
        mlp_out = None  # each layer's MLP output is added to the live sum by the next read
        for layer in self.layers:
            h, mlp_out, blocks = layer.forward_attn_res(h, blocks, ctx, store, mlp_out)
        out, _ = ops.add_read_norm(h, mlp_out, blocks, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
                                   self.norm.weight, self.config.rms_norm_eps)
        return out


class KimiForCausalLM(nn.Module):
    """Full-sequence forward of a Kimi-K3.1-family text model: token ids in, fp32 logits out.

    `parallel` (None: one process) makes this one tensor-parallel rank's shard of the model (DESIGN.md
    section 4, `kimiserve.distributed`): every layer holds its rank's heads / rows / columns, the
    forward runs the TP collectives, and the ranks of a TP group, given the same inputs, together
    compute what one process computes; every rank returns the full logits. The rank's page pool is
    laid out from `cache_config` (its KDA heads only).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = context(parallel)
        self.parallel.config.check_model(config)
        self.config, self.dtype = config, dtype
        self.model = KimiModel(config, dtype, self.parallel)
        if not config.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype, self.parallel)

    @property
    def cache_config(self) -> ModelConfig:
        """The config to lay this rank's page pool out from (`CacheLayout.from_config`): H / tp KDA heads."""
        return self.parallel.config.cache_config(self.config)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's vocab rows of lm_head (all of them in one process)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., vocab] of final hidden states (all-gathered over the TP ranks)."""
        return vocab_parallel_logits(h, self.lm_head_weight, self.config.vocab_size, self.parallel)

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
        if batch.pcp is not None:
            return self.token_sharded_logits(h, batch.pcp, logits_rows)
        return self.logits(h[logits_rows])

    def token_sharded_logits(self, h: torch.Tensor, shard, logits_rows: torch.Tensor) -> torch.Tensor:
        """Logits of the chunk rows `logits_rows` (0 = the chunk's first token) when this rank holds only
        rows [shard.start, shard.end) - b_0 of it: each rank computes the rows it holds, one all-gather
        (padded to the most rows any rank holds) gives every rank all of them, in row order."""
        import torch.distributed as dist

        b0 = shard.bounds[0]
        rows = logits_rows.tolist()
        counts = [sum(lo - b0 <= r < hi - b0 for r in rows) for lo, hi in zip(shard.bounds, shard.bounds[1:])]
        mine = [r - (shard.start - b0) for r in rows if shard.start - b0 <= r < shard.end - b0]
        local = self.logits(h[torch.tensor(mine, dtype=torch.long, device=h.device)])
        if shard.size == 1:
            return local
        width = max(counts)
        padded = torch.cat([local, local.new_zeros(width - len(mine), local.shape[1])]) if width > len(mine) else local
        parts = [torch.empty_like(padded) for _ in range(shard.size)]
        dist.all_gather(parts, padded.contiguous(), group=shard.group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)])


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator seeded by (seed, checkpoint tensor name): every tensor's draw is independent of the
    others, of their order and of how the model is sharded."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _random_tensor(param_name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A parameter's full logical value of sensible scale (fp32), by what the parameter is."""
    normal = lambda std: torch.randn(shape, generator=gen, device=device) * std  # noqa: E731
    uniform = lambda: torch.rand(shape, generator=gen, device=device)  # noqa: E731
    leaf = param_name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.log(uniform() * 15 + 1)
    if leaf == "dt_bias":
        dt = torch.exp(uniform() * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if "conv1d" in param_name:
        return (uniform() * 2 - 1) * shape[-1] ** -0.5
    if param_name.endswith(("e_score_correction_bias", "k_norm.bias")):
        return normal(0.05)
    if param_name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if len(shape) == 1:  # norm gains
        return 1.0 + normal(0.05)
    return normal(shape[-1] ** -0.5)  # [out, in] projections ([1, d] attention-residual queries, experts)


@torch.no_grad()
def init_random_weights(model: KimiForCausalLM, seed: int = 0) -> KimiForCausalLM:
    """Deterministic random weights of sensible scale (for tests, benchmarks and checkpoints).

    Random init is the loading of a virtual checkpoint: each checkpoint tensor's full logical value is
    drawn from a generator seeded by (seed, its checkpoint name) and handed to its parameter's
    `weight_loader`, which keeps the rank's slice; so the same seed gives the same global model at
    every tensor-parallel size. Routed MXFP4 experts are drawn in float per expert and quantised, so
    a checkpoint written from the model holds exactly the model's weights. Values are drawn on the
    parameters' device: the same seed gives the same weights on the same kind of device.
    """
    from kimiserve.model.loader import checkpoint_layout  # the loader module imports this one

    device = next(model.parameters()).device
    params = dict(model.named_parameters())
    for entry in checkpoint_layout(model):
        if entry.remote or entry.param_name.endswith("_scale"):
            continue  # another rank's expert; MXFP4 scales come with their packed codes below
        param = params[entry.param_name]
        full = param.full_shape if entry.expert is None else param.full_shape[1:]
        gen = _generator(seed, entry.name, device)
        if entry.param_name.endswith("_packed"):
            w = _random_tensor(entry.param_name, (full[0], full[1] * 2), gen, device)
            packed, scale = quantize_mxfp4(w)
            param.weight_loader(param, packed, entry.name, entry.expert)
            scale_param = params[entry.param_name[: -len("_packed")] + "_scale"]
            scale_param.weight_loader(scale_param, scale, entry.name.replace("weight_packed", "weight_scale"), entry.expert)
            continue
        value = entry.to_checkpoint(_random_tensor(entry.param_name, tuple(full), gen, device))
        if entry.expert is None:
            param.weight_loader(param, value, entry.name)
        else:
            param.weight_loader(param, value, entry.name, entry.expert)
    from kimiserve.model.expert_layout import weights_written

    weights_written(model, params)  # the loaders wrote checkpoint codes: re-laid if the model holds another layout
    return model


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int | None = 0, device: str | torch.device = "cpu",
    parallel: ParallelContext | None = None,
) -> KimiForCausalLM:
    """A model (one rank's shard with `parallel`) on `device` with random weights from `seed` (None:
    uninitialised, for a loader to fill)."""
    with torch.device(device):
        model = KimiForCausalLM(config, dtype, parallel)
    model.eval()
    return init_random_weights(model, seed) if seed is not None else model
