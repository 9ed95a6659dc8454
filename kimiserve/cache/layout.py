"""Byte layout of the packed page pool (DESIGN.md section 2).

Every page has the same size. An attention page holds `block_size` consecutive tokens of one
sequence for ALL MLA layers: per layer a latent region [block_size, latent_dim], an index-key
region [block_size, index_dim] and, for fp8, an index-key scale region [block_size] fp32. A
state page holds one KDA layer's state of one sequence: the fp32 recurrent state [H, K, V] and
the conv state [3 (q, k, v), H * K, conv_size - 1] in the model dtype. `block_size` is the
smallest multiple of 64 tokens whose attention page is at least a state page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimiserve.cache.formats import STORAGE_DTYPES, check_kv_cache_dtype, index_key_has_scale
from kimiserve.config import ModelConfig

PAGE_TOKEN_MULTIPLE = 64
ALIGN = 16


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Region:
    """A typed array at a fixed byte offset inside every page."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def view(self, pool: torch.Tensor) -> torch.Tensor:
        """[num_pages, *shape] view of this region in every page of a [num_pages, page_bytes] uint8 pool."""
        raw = pool[:, self.offset : self.offset + self.nbytes]
        return raw.view(self.dtype).view(pool.shape[0], *self.shape)


@dataclass(frozen=True)
class CacheLayout:
    kv_cache_dtype: str
    block_size: int
    page_bytes: int
    latent: tuple[Region, ...]
    """Per MLA layer: [block_size, kv_latent_dim] in the cache dtype."""
    index_key: tuple[Region, ...]
    """Per MLA layer: [block_size, index_head_dim] in the cache dtype (empty without an indexer)."""
    index_scale: tuple[Region, ...]
    """Per MLA layer: [block_size] fp32 (fp8 only)."""
    recurrent: Region | None
    """KDA recurrent state [H, K, V] fp32 (None without KDA layers)."""
    conv: Region | None
    """KDA conv state [3, H * K, conv_size - 1] in the model dtype."""

    @property
    def num_mla_layers(self) -> int:
        return len(self.latent)

    @property
    def state_bytes(self) -> int:
        return 0 if self.recurrent is None else self.conv.offset + self.conv.nbytes

    @classmethod
    def from_config(
        cls, config: ModelConfig, kv_cache_dtype: str, state_dtype: torch.dtype, block_size: int | None = None
    ) -> "CacheLayout":
        check_kv_cache_dtype(kv_cache_dtype)
        store = STORAGE_DTYPES[kv_cache_dtype]
        num_mla = len(config.full_attn_layers)
        recurrent = conv = None
        state_end = 0
        if config.kda_layers:
            H, K = config.kda_num_heads, config.kda_head_dim
            recurrent = Region(0, torch.float32, (H, K, K))
            conv = Region(_align(recurrent.nbytes), state_dtype, (3, H * K, config.kda_conv_size - 1))
            state_end = conv.offset + conv.nbytes

        def attention_regions(bs: int):
            offset, latent, keys, scales = 0, [], [], []
            for _ in range(num_mla):
                latent.append(Region(offset, store, (bs, config.kv_latent_dim)))
                offset = _align(offset + latent[-1].nbytes)
                if config.has_indexer:
                    keys.append(Region(offset, store, (bs, config.index_head_dim)))
                    offset = _align(offset + keys[-1].nbytes)
                    if index_key_has_scale(kv_cache_dtype):
                        scales.append(Region(offset, torch.float32, (bs,)))
                        offset = _align(offset + scales[-1].nbytes)
            return offset, tuple(latent), tuple(keys), tuple(scales)

        per_block = attention_regions(PAGE_TOKEN_MULTIPLE)[0]
        if block_size is None:
            blocks = max(1, -(-state_end // per_block)) if per_block else 1
            block_size = blocks * PAGE_TOKEN_MULTIPLE
        elif block_size < 1 or block_size % PAGE_TOKEN_MULTIPLE:
            raise ValueError(f"block_size must be a positive multiple of {PAGE_TOKEN_MULTIPLE}, got {block_size}")
        attn_bytes, latent, keys, scales = attention_regions(block_size)
        if attn_bytes < state_end and num_mla:
            raise ValueError(
                f"block_size {block_size} gives {attn_bytes}-byte attention pages, smaller than a KDA state page "
                f"({state_end} bytes): leave block_size unset or raise it"
            )
        return cls(kv_cache_dtype, block_size, _align(max(attn_bytes, state_end)), latent, keys, scales, recurrent, conv)
