"""Parameter counts and cache sizes of a configuration, computed from a model built on the meta device."""

from __future__ import annotations

import math
from typing import Any

import torch

from kimiserve.cache.formats import index_key_storage, latent_storage
from kimiserve.config import ModelConfig
from kimiserve.model.model import KimiForCausalLM

# bytes per token per MLA layer: (latent, index key) for each cache dtype of DESIGN.md section 2
CACHE_DTYPES = ("bf16", "fp8", "fp4")
KDA_CONV_STATE_BYTES = 2  # conv state kept in bf16; the recurrent state is fp32
PAGE_TOKEN_MULTIPLE = 64


def latent_bytes(config: ModelConfig, dtype: str) -> int:
    """Stored bytes of one token's latent (fp8: e4m3 with one scale per layer, not per token; fp4:
    NVFP4, e2m1 + one e4m3 scale per 16 values + one fp32 scale per layer)."""
    store, n = latent_storage(dtype, config.kv_latent_dim)
    return store.itemsize * n


def index_key_bytes(config: ModelConfig, dtype: str) -> int:
    """Stored bytes of one token's index key (fp8: e4m3 + fp32 scale; fp4: MXFP4, e2m1 + one ue8m0 per 32)."""
    if not config.has_indexer:
        return 0
    code, n, scale, m = index_key_storage(dtype, config.index_head_dim)
    return code.itemsize * n + (scale.itemsize * m if scale is not None else 0)


def kda_state_bytes_per_layer(config: ModelConfig) -> int:
    P = config.kda_num_heads * config.kda_head_dim
    recurrent = config.kda_num_heads * config.kda_head_dim * config.kda_head_dim * 4
    conv = 3 * P * (config.kda_conv_size - 1) * KDA_CONV_STATE_BYTES
    return recurrent + conv


def count_params(config: ModelConfig) -> dict[str, int]:
    """Logical parameter counts (an MXFP4 weight counts its 4-bit values, not its bytes or scales)."""
    with torch.device("meta"):
        model = KimiForCausalLM(config, torch.bfloat16)
    total = routed = embedding = 0
    for name, p in model.named_parameters():
        if name.endswith("_scale") and ".experts." in name:
            continue
        n = p.numel() * (2 if name.endswith("_packed") else 1)
        total += n
        if ".experts." in name:
            routed += n
        if name.endswith("embed_tokens.weight"):
            embedding += n
    k, E = config.num_experts_per_token, config.num_experts or 1
    active = total - embedding - routed + routed * k // E
    return {"total_params": total, "active_params": active, "embedding_params": embedding, "routed_expert_params": routed}


def model_summary(config: ModelConfig) -> dict[str, Any]:
    """What `kimiserve inspect` prints."""
    n_mla, n_kda = len(config.full_attn_layers), len(config.kda_layers)
    state_layer = kda_state_bytes_per_layer(config)
    cache: dict[str, Any] = {}
    for dt in CACHE_DTYPES:
        per_layer = latent_bytes(config, dt) + index_key_bytes(config, dt)
        per_token = per_layer * n_mla
        block = PAGE_TOKEN_MULTIPLE * max(1, math.ceil(state_layer / max(per_token, 1) / PAGE_TOKEN_MULTIPLE))
        cache[dt] = {
            "latent_bytes_per_token_per_layer": latent_bytes(config, dt),
            "index_key_bytes_per_token_per_layer": index_key_bytes(config, dt),
            "bytes_per_token_per_mla_layer": per_layer,
            "bytes_per_token": per_token,
            "block_size_tokens": block if n_kda and per_token else None,
        }
    return {
        "architecture": config.architecture,
        **count_params(config),
        "layers": config.num_hidden_layers,
        "mla_layers": n_mla,
        "kda_layers": n_kda,
        "indexer_topk": config.index_topk,
        "kda_state_bytes_per_layer": state_layer if n_kda else 0,
        "kda_state_bytes_per_seq": state_layer * n_kda,
        "cache": cache,
    }


def format_summary(name: str, s: dict[str, Any]) -> str:
    lines = [
        f"model {name} ({s['architecture']}): {s['layers']} layers = {s['kda_layers']} KDA + {s['mla_layers']} MLA"
        + (f", indexer top-{s['indexer_topk']}" if s["indexer_topk"] else ", dense MLA"),
        f"  total params   {s['total_params']:>20,} ({s['total_params'] / 1e9:.2f} B)",
        f"  active params  {s['active_params']:>20,} ({s['active_params'] / 1e9:.2f} B per token; excludes the input embedding table)",
        f"  KDA state      {s['kda_state_bytes_per_seq']:>20,} bytes per sequence ({s['kda_state_bytes_per_layer']:,} per KDA layer: fp32 recurrent + bf16 conv)",
        "  cache dtype | latent B | index key B | B/token/MLA layer | B/token (all MLA layers) | page (tokens)",
    ]
    for dt, c in s["cache"].items():
        lines.append(
            f"  {dt:<11} | {c['latent_bytes_per_token_per_layer']:>8} | {c['index_key_bytes_per_token_per_layer']:>11} | "
            f"{c['bytes_per_token_per_mla_layer']:>17} | {c['bytes_per_token']:>24,} | {c['block_size_tokens']}"
        )
    return "\n".join(lines)
