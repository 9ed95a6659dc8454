"""Writing new tokens' MLA latents and index keys into their page slots, in the cache dtype."""

from __future__ import annotations

import torch

from kimiserve.cache import formats


def write_mla_tokens(
    latent_cache: torch.Tensor,
    key_cache: torch.Tensor | None,
    key_scales: torch.Tensor | None,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    latent: torch.Tensor,
    keys: torch.Tensor | None,
    kv_cache_dtype: str,
    latent_scale: float,
) -> None:
    """Store tokens' latents [N, L + R] into latent_cache [P, block_size, L + R] and index keys
    [N, D] into key_cache [P, block_size, D] (with per-token fp32 scales into key_scales
    [P, block_size] for fp8) at slots (pages [N], offsets [N]). bf16: values rounded to bf16;
    fp8: latent / latent_scale in e4m3, keys in e4m3 with scale amax / 448 per token."""
    latent_cache[pages, offsets] = formats.store_latent(latent, kv_cache_dtype, latent_scale)
    if keys is not None:
        codes, scales = formats.store_index_key(keys, kv_cache_dtype)
        key_cache[pages, offsets] = codes
        if scales is not None:
            key_scales[pages, offsets] = scales
