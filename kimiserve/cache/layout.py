"""Byte layout of the packed page pool (DESIGN.md section 2).

Every page has the same size. An attention page holds `block_size` consecutive tokens of one
sequence for ALL MLA layers: per layer a latent region [block_size, latent_dim] (fp4: packed
NVFP4 rows, uint8 [block_size, 9 * ceil(latent_dim / 16)]), an index-key region
[block_size, index_dim] (fp4: uint8 [block_size, 16 * ceil(index_dim / 32)]) and an index-key scale
region (fp8: [block_size] fp32; fp4: uint8 ue8m0 [block_size, ceil(index_dim / 32)]). A last
partial 4-bit group is zero-padded. A
state page holds one KDA layer's state of one sequence: the fp32 recurrent state [H, K, V] and
the conv state [3 (q, k, v), H * K, conv_size - 1] in the model dtype. `block_size` is the
smallest multiple of 64 tokens whose attention page is at least a state page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimiserve.cache.formats import check_kv_cache_dtype, index_key_storage, latent_storage, rotates_index_keys
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
    """Per MLA layer: [block_size, kv_latent_dim] in the cache dtype (fp4: uint8 NVFP4 rows)."""
    index_key: tuple[Region, ...]
    """Per MLA layer: [block_size, index_head_dim] in the cache dtype (fp4: uint8 MXFP4 codes);
    empty without an indexer."""
    index_scale: tuple[Region, ...]
    """Per MLA layer: fp8 keys [block_size] fp32, fp4 keys [block_size, groups of 32] uint8 ue8m0; else empty."""
    recurrent: Region | None
    """KDA recurrent state [H, K, V] fp32 (None without KDA layers)."""
    conv: Region | None
    """KDA conv state [3, H * K, conv_size - 1] in the model dtype."""
    latent_dim: int = 0
    """Values per stored latent (kv_latent_dim)."""
    index_dim: int = 0
    """Values per stored index key (index_head_dim; 0 without an indexer)."""
    index_key_rotation: bool = False
    """Index keys are stored rotated by the orthonormal Hadamard matrix (the pool rotates them on the
    way in and back on the way out; the decode scan rotates its queries)."""

    @property
    def token_bytes(self) -> int:
        """Cache bytes per token over all MLA layers (excluding the alignment padding of regions)."""
        return sum(r.nbytes for r in self.latent + self.index_key + self.index_scale) // self.block_size

    @property
    def num_mla_layers(self) -> int:
        return len(self.latent)

    @property
    def state_bytes(self) -> int:
        return 0 if self.recurrent is None else self.conv.offset + self.conv.nbytes

    @classmethod
    def from_config(
        cls, config: ModelConfig, kv_cache_dtype: str, state_dtype: torch.dtype, block_size: int | None = None,
        index_key_rotation: bool | None = None,
    ) -> "CacheLayout":
        """index_key_rotation: None = on for fp4 index keys (where it raises top-k recall), off otherwise."""
        check_kv_cache_dtype(kv_cache_dtype)
        index_key_rotation = rotates_index_keys(kv_cache_dtype, index_key_rotation)
        if index_key_rotation and config.has_indexer and config.index_head_dim & (config.index_head_dim - 1):
            raise ValueError(f"index_key_rotation needs a power-of-two index_head_dim, got {config.index_head_dim}")
        latent_dtype, latent_width = latent_storage(kv_cache_dtype, config.kv_latent_dim)
        key_dtype, key_width, scale_dtype, scale_width = index_key_storage(kv_cache_dtype, config.index_head_dim or 0)
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
                latent.append(Region(offset, latent_dtype, (bs, latent_width)))
                offset = _align(offset + latent[-1].nbytes)
                if config.has_indexer:
                    keys.append(Region(offset, key_dtype, (bs, key_width)))
                    offset = _align(offset + keys[-1].nbytes)
                    if scale_dtype is not None:
                        scales.append(Region(offset, scale_dtype, (bs,) if scale_dtype == torch.float32 else (bs, scale_width)))
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
        return cls(kv_cache_dtype, block_size, _align(max(attn_bytes, state_end)), latent, keys, scales, recurrent, conv,
                   config.kv_latent_dim, config.index_head_dim or 0, index_key_rotation and config.has_indexer)
